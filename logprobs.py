"""Log-probs of the sampled tokens under a model: the forward pass that feeds grpo.grpo_loss.

    logp = sequence_log_probs(model, input_ids, attention_mask, C, temperature)   # (N, C) fp32

Only the chosen tokens' log-probs are ever computed: log softmax(logits / T)[id] = logits[id] / T -
logsumexp(logits / T), in row chunks with the backward written out, or straight from the last hidden
states without the (N, T, V) logits (grpo.fused_lm_head), both in plumbing/logsoftmax.py. Positions
skip left padding; grpo.share_prompt runs a group's prompt through the model once.
Shapes: N = B prompts x G completions, P = prompt length, C = completion length, V = vocab.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from plumbing.logsoftmax import fused_head_log_probs, plain_output_head, selective_log_probs


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: cumsum(mask) - 1 (pads get 0). (N, T) -> (N, T)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def share_prompt_in_loss(setting: bool | str, device: torch.device) -> bool:
    """grpo.share_prompt for the loss forward: true or false as set; "auto" shares on CPU only.
    Sharing runs a micro-batch through the model twice (the prompts, then the completions on their
    cache), doubling its kernel launches (25k vs 12k aten operators for Qwen3-0.6B's 28 layers,
    counted on CPU: bench/gpu_h100/op_count_cpu.log). A CPU is bound by arithmetic, so the prompt
    work saved wins there (0.64x the training time at 45-token prompts); a GPU on a small model is
    bound by launches, and on an H100 (same model and prompts) minigrpo's training took 2.5x TRL's
    with it on. The sampling prefill shares unless it is false: one extra forward per rollout."""
    return setting is True or (setting == "auto" and device.type != "cuda")


def sequence_log_probs(model, input_ids: Tensor, attention_mask: Tensor, num_completion: int,
                       temperature: float = 1.0, chunk: int = 0, fused_head: bool = False,
                       share_prompt: bool = False) -> Tensor:
    """log softmax(logits / T)[token], the tempered policy's log-prob of each of the last
    `num_completion` tokens of each row given its prefix: (N, num_completion).

    The attention mask and left-padding-aware position ids are always passed (RoPE hides a wrong
    position, absolute-position models do not); only the C logits that score a token are
    computed (`logits_to_keep`). fused_head (grpo.fused_lm_head): the decoder's hidden states go
    through the output head chunk by chunk (_FusedHeadLogSoftmax), so the (N, C, V) logits never
    exist; models whose head is not plain (plain_output_head) take the usual path. share_prompt
    (grpo.share_prompt): rows with the same prompt run it through the model once
    (_shared_prompt_log_probs); the same values up to float rounding.
    input_ids, attention_mask: (N, P + C) -> (N, C) fp32.
    """
    assert input_ids.shape[1] > num_completion, \
        "a completion needs at least one prompt token before it"
    # the last token predicts nothing we score: leave it out, so the kept logits are exactly the
    # C positions j whose logits predict token j + 1, contiguous (a [:, :-1] slice would copy them)
    inputs = dict(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                  position_ids=position_ids(attention_mask)[:, :-1], use_cache=False)
    ids = input_ids[:, -num_completion:]  # (N, C)
    head = plain_output_head(model) if fused_head else None
    if share_prompt:
        logp = _shared_prompt_log_probs(model, input_ids, attention_mask, num_completion,
                                        temperature, chunk, head)
        if logp is not None:
            return logp
    if head is not None:
        hidden = model.get_decoder()(**inputs).last_hidden_state[:, -num_completion:]  # (N, C, H)
        return fused_head_log_probs(hidden, head, ids, temperature, chunk)  # (N, C)
    out = model(**inputs, logits_to_keep=num_completion)
    return selective_log_probs(out.logits, ids, temperature, chunk)  # (N, C)


SHARED_ATTENTION = ("sdpa", "eager")  # attention implementations prompt sharing is tested with


def prompt_cache(model):
    """An empty DynamicCache for `model` when every layer keeps plain keys and values (no sliding
    window, no recurrent state) and attention is one of SHARED_ATTENTION, else None: only then is a
    cache filled once per prompt and indexed row by row (prompt sharing) known to score the same."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    if getattr(model.config, "_attn_implementation", None) not in SHARED_ATTENTION:
        return None
    try:
        cache = DynamicCache(config=model.config)
    except (TypeError, ValueError, AttributeError):
        return None
    return cache if cache.layers and all(type(x) is DynamicLayer for x in cache.layers) else None


def _shared_prompt_log_probs(model, input_ids: Tensor, attention_mask: Tensor, C: int,
        temperature: float, chunk: int, head: nn.Linear | None) -> Tensor | None:
    """sequence_log_probs with each distinct prompt run through the model once (grpo.share_prompt).

    A group's G rows share their prompt, so a plain forward computes the same P prompt positions
    G times. Here the u distinct prompts go through the model once, filling a KV cache (u, P);
    the cache is indexed out to the N rows (an index, so gradients from every row flow back into
    the one prompt pass) and the completions run on top of it:

        pass 1: prompts (u, P)        -> KV cache, and the logits of the last prompt position,
                                         which score completion token 0
        pass 2: completions (N, C - 1) on the cache -> the logits that score tokens 1 .. C-1

    Attention mask and positions are those of the full rows, so each token sees exactly what it
    sees in one pass. Returns None (the caller takes the one-pass path) when no two rows share a
    prompt, under gradient checkpointing (HF drops the cache there), or when the model's cache or
    attention is not one it is tested with (prompt_cache).
    """
    N, W = input_ids.shape
    P = W - C
    key = torch.cat([input_ids[:, :P], attention_mask[:, :P].to(input_ids.dtype)], dim=1)  # (N, 2P)
    uniq, inv = torch.unique(key, dim=0, return_inverse=True)  # (u, 2P), (N,)
    if len(uniq) == N or any(getattr(m, "gradient_checkpointing", False) is True
                             for m in model.modules()):
        return None
    cache = prompt_cache(model)
    if cache is None:
        return None
    pos = position_ids(attention_mask)  # (N, W)
    u_mask = uniq[:, P:]  # (u, P)
    first_in = dict(input_ids=uniq[:, :P], attention_mask=u_mask, position_ids=position_ids(u_mask),
                    past_key_values=cache, use_cache=True)
    rest_in = dict(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1],
                   position_ids=pos[:, P:-1], past_key_values=cache,
                   use_cache=True)  # (N, C - 1) on top of the (N, P) cache
    ids = input_ids[:, P:]  # (N, C)
    if head is not None:
        decoder = model.get_decoder()
        hidden = decoder(**first_in).last_hidden_state[:, -1:][inv]  # (N, 1, H)
        if C > 1:
            cache.batch_select_indices(inv)
            hidden = torch.cat([hidden, decoder(**rest_in).last_hidden_state], dim=1)  # (N, C, H)
        return fused_head_log_probs(hidden, head, ids, temperature, chunk)  # (N, C)
    first = selective_log_probs(model(**first_in, logits_to_keep=1).logits[inv], ids[:, :1],
                                temperature, chunk)  # (N, 1)
    if C == 1:
        return first
    cache.batch_select_indices(inv)
    rest = selective_log_probs(model(**rest_in).logits, ids[:, 1:], temperature, chunk)  # (N, C-1)
    return torch.cat([first, rest], dim=1)  # (N, C)


def trim(input_ids: Tensor, attention_mask: Tensor,
         completion_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """Drop all-padding columns of a micro-batch: leading prompt pads and completion columns past
    the longest completion. Causal attention makes the result identical. -> (ids, attn, C kept)."""
    C_all = completion_mask.shape[1]
    P = attention_mask.shape[1] - C_all  # prompt columns
    C = max(int(attention_mask[:, P:].sum(1).max()), 1)  # an episode's env tokens count too
    start = int((attention_mask[:, :P].sum(0) > 0).long().argmax()) if P > 0 else 0
    end = P + C
    return input_ids[:, start:end], attention_mask[:, start:end], C
