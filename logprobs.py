"""Log-probs of the sampled tokens under a model: the forward pass that feeds grpo.grpo_loss.

    logp = sequence_log_probs(model, input_ids, attention_mask, C, temperature)   # (N, C) fp32

The plain path: the model's logits at the C completion positions, log_softmax(logits / T), and the
sampled token's entry gathered. Positions skip left padding. Its speed levers, chosen at setup
(gpu/auto.py, named on the "chosen for this machine" line) and each the same values up to float
rounding (tests/test_logprobs.py, tests/test_share_prompt.py), enter through one seam
(lean_log_probs): grpo.logprob_kernel computes only the chosen tokens' log-probs,
logits[id] / T - logsumexp(logits / T), in row chunks with the backward written out;
grpo.fused_lm_head goes straight from the last hidden states without the (N, T, V) logits (both
below: the kernels); grpo.share_prompt runs a group's prompt through the model once.
Shapes: N = B prompts x G completions, P = prompt length, C = completion length, V = vocab.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor, nn


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: cumsum(mask) - 1 (pads get 0). (N, T) -> (N, T)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_log_probs(model, input_ids: Tensor, attention_mask: Tensor, num_completion: int,
                       temperature: float = 1.0, chunk: int = 0, fused_head: bool = False,
                       share_prompt: bool = False, kernel: bool = False) -> Tensor:
    """log softmax(logits / T)[token], the tempered policy's log-prob of each of the last
    `num_completion` tokens of each row given its prefix: (N, num_completion).

    The attention mask and left-padding-aware position ids are always passed (RoPE hides a wrong
    position, absolute-position models do not); only the C logits that score a token are
    computed (`logits_to_keep`). With every lever off (kernel, fused_head, share_prompt: the
    step's come from grpo.logprob_kernel, fused_lm_head, share_prompt) the plain path below runs;
    else lean_log_probs, the same values up to float rounding.
    input_ids, attention_mask: (N, P + C) -> (N, C) fp32.
    """
    assert input_ids.shape[1] > num_completion, \
        "a completion needs at least one prompt token before it"
    # the last token predicts nothing we score: leave it out, so the kept logits are exactly the
    # C positions j whose logits predict token j + 1, contiguous (a [:, :-1] slice would copy them)
    inputs = dict(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                  position_ids=position_ids(attention_mask)[:, :-1], use_cache=False)
    if kernel or fused_head or share_prompt:  # speed levers, chosen at setup (gpu/auto.py)
        return lean_log_probs(model, inputs, input_ids, attention_mask, num_completion,
                              temperature, chunk, fused_head, share_prompt, kernel)
    logits = model(**inputs, logits_to_keep=num_completion).logits  # (N, C, V)
    return token_log_probs(logits, input_ids[:, -num_completion:], temperature)  # (N, C)


def token_log_probs(logits: Tensor, ids: Tensor, temperature: float, chunk: int = 0) -> Tensor:
    """log softmax(logits / T)[ids] in fp32, the plain way: (N, C, V), (N, C) -> (N, C). (chunk:
    selective_log_probs's, unused here.)"""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, C, V)
    return logp.gather(-1, ids[..., None])[..., 0]  # (N, C): each sampled token's entry


def lean_log_probs(model, inputs: dict, input_ids: Tensor, attention_mask: Tensor, C: int,
                   temperature: float, chunk: int, fused_head: bool, share_prompt: bool,
                   kernel: bool) -> Tensor:
    """sequence_log_probs through its speed levers. kernel (grpo.logprob_kernel): the log-probs by
    selective_log_probs, fp32 chunks with the backward written out. fused_head
    (grpo.fused_lm_head): the decoder's hidden states go through the output head chunk by chunk
    (_FusedHeadLogSoftmax), so the (N, C, V) logits never exist; models whose head is not plain
    (plain_output_head) take the usual path. share_prompt (grpo.share_prompt): rows with the same
    prompt run it through the model once (_shared_prompt_log_probs)."""
    pick = selective_log_probs if kernel else token_log_probs
    ids = input_ids[:, -C:]  # (N, C)
    head = plain_output_head(model) if fused_head else None
    if share_prompt:
        logp = _shared_prompt_log_probs(model, input_ids, attention_mask, C, temperature, chunk,
                                        head, pick)
        if logp is not None:
            return logp
    if head is not None:
        hidden = model.get_decoder()(**inputs).last_hidden_state[:, -C:]  # (N, C, H)
        return fused_head_log_probs(hidden, head, ids, temperature, chunk)  # (N, C)
    return pick(model(**inputs, logits_to_keep=C).logits, ids, temperature, chunk)  # (N, C)


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
        temperature: float, chunk: int, head: nn.Linear | None,
        pick: Callable = None) -> Tensor | None:
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
    attention is not one it is tested with (prompt_cache). pick: logits -> log-probs
    (selective_log_probs, the default, or token_log_probs).
    """
    pick = pick or selective_log_probs
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
    first = pick(model(**first_in, logits_to_keep=1).logits[inv], ids[:, :1],
                 temperature, chunk)  # (N, 1)
    if C == 1:
        return first
    cache.batch_select_indices(inv)
    rest = pick(model(**rest_in).logits, ids[:, 1:], temperature, chunk)  # (N, C - 1)
    return torch.cat([first, rest], dim=1)  # (N, C)


def trim(input_ids: Tensor, attention_mask: Tensor,
         completion_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """Drop all-padding columns of a micro-batch: leading prompt pads and completion columns past
    the longest completion. Causal attention makes the result identical. -> (ids, attn, C kept)."""
    P = attention_mask.shape[1] - completion_mask.shape[1]  # prompt columns
    C = max(int(attention_mask[:, P:].sum(1).max()), 1)  # an episode's env tokens count too
    start = int((attention_mask[:, :P].sum(0) > 0).long().argmax()) if P > 0 else 0
    return input_ids[:, start:P + C], attention_mask[:, start:P + C], C


# ---------------------------------------------------------------- per micro-batch, in the step
# batch: a rollout.Rollout, cfg: the config.Config (not imported: rollout.py imports this file)


def micro_batches(batch, size: int, max_tokens: int = 0,
                  group: int = 1) -> list[slice]:
    """Consecutive rows, at most `size` a micro-batch and, with max_tokens > 0
    (optim.micro_batch_tokens), at most that many padded tokens: rows x (longest prompt + longest
    completion) of the micro-batch, what its forward pays for after trimming. A row over the budget
    on its own gets its own micro-batch. Consecutive rows keep a group's rows together
    (grpo.share_prompt) when `size` is a multiple of G; other sizes split groups (the same gradient,
    less prompt sharing). group: cut only between whole groups of that many rows (a DPO pair's two
    replies, which one loss term joins)."""
    n = batch.completion_ids.shape[0]
    size = max(size // group, 1) * group
    if max_tokens:
        return token_budget_slices(batch, size, max_tokens, group)
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def token_budget_slices(batch, size: int, max_tokens: int, group: int) -> list[slice]:
    """micro_batches under optim.micro_batch_tokens: rows x (longest prompt + longest completion)
    at most max_tokens a micro-batch, and at most `size` rows."""
    n = batch.completion_ids.shape[0]
    p_len, c_len = batch.prompt_mask.sum(1).tolist(), batch.completion_mask.sum(1).tolist()
    out, start = [], 0
    # do rows i .. i + group - 1 still fit in the micro-batch that starts at `start`?
    for i in range(group, n, group):
        end = min(i + group, n)
        padded = (end - start) * (max(p_len[start:end]) + max(c_len[start:end]))
        if i - start >= size or padded > max_tokens:
            out.append(slice(start, i))
            start = i
    return out + [slice(start, n)]


def micro_batch_log_probs(model, batch, ids, attn, mb: slice, cfg, temperature: float | None = None,
                          entropy: bool = False) -> tuple:
    """(n, C) log-probs of the micro-batch's completion tokens, all-padding columns trimmed; and C.
    The temperature is the sampler's (rollout.temperature) unless given. entropy (the entropy
    bonus): (logp, C, each position's entropy), log_probs_and_entropy's plain path."""
    i, a, C = trim(ids[mb], attn[mb], batch.completion_mask[mb])
    g, T = cfg.grpo, cfg.rollout.temperature if temperature is None else temperature
    with mixed_precision(model):  # bf16/fp16 matmuls over a 16-bit base; nothing on an fp32 model
        return log_probs_and_entropy(model, i, a, C, T) if entropy else (sequence_log_probs(
            model, i, a, C, T, g.logprob_chunk, g.fused_lm_head,  # the levers, chosen at setup
            share_prompt=g.share_prompt is True, kernel=g.logprob_kernel is not False), C)


def log_probs_and_entropy(model, input_ids: Tensor, attention_mask: Tensor, C: int,
                          temperature: float) -> tuple[Tensor, int, Tensor]:
    """sequence_log_probs's plain path, and the entropy of each of those C positions' tempered
    distributions, both with their gradient: H_t = -sum_v p_t,v log p_t,v, p_t = softmax(logits_t
    / T) (the entropy bonus needs each whole distribution, so no speed lever applies).
    input_ids, attention_mask: (N, P + C) -> ((N, C) log-probs, C, (N, C) entropies), fp32."""
    inputs = dict(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                  position_ids=position_ids(attention_mask)[:, :-1], use_cache=False)
    logp_all = torch.log_softmax(
        model(**inputs, logits_to_keep=C).logits.float() / temperature, dim=-1)  # (N, C, V)
    logp = logp_all.gather(-1, input_ids[:, -C:, None])[..., 0]  # (N, C)
    return logp, C, -(logp_all.exp() * logp_all).sum(-1)  # (N, C), C, (N, C)


@torch.no_grad()
def batch_log_probs(model, batch, cfg,
                    mbs: list[slice] | None = None) -> torch.Tensor:
    """(N, C) log-probs of the sampled tokens (old or reference policy): zero past each
    micro-batch's longest completion; between a row's end and that, the log-probs of padding, which
    the loss masks out."""
    out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32,
                      device=batch.completion_ids.device)
    ids, attn = batch.input_ids, batch.attention_mask
    for mb in mbs or micro_batches(batch, cfg.optim.micro_batch_size, cfg.optim.micro_batch_tokens):
        logp, C = micro_batch_log_probs(model, batch, ids, attn, mb, cfg)
        out[mb, :C] = logp
    return out


HALF = (torch.bfloat16, torch.float16)  # the weight dtypes mixed_precision runs matmuls in


def mixed_precision(model: nn.Module, device_type: str | None = None):
    """Autocast for the training forward where frozen bf16/fp16 weights carry fp32 trained ones
    (LoRA on a half-precision or 4-bit base): matmuls then run in the base's dtype, as HF Trainer's
    bf16/fp16 modes do, while the trained weights stay fp32 (autocast casts them). peft's own cast
    of each adapted layer's input to its weights' fp32 is switched off meanwhile: autograd kept
    those copies. For one 8 x 557-token Qwen3-0.6B micro-batch this takes the forward's peak from
    12.8 to 9.2 GiB (estimated on CPU: bench/memory_estimate.py). Else a nullcontext (fp32 models:
    the CPU default). device_type: autocast's if not the weights' (meta weights traced on a CPU)."""
    frozen = next((p.dtype for p in model.parameters()
                   if not p.requires_grad and p.dtype in HALF), None)
    trained = any(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    if frozen is None or not trained:
        return contextlib.nullcontext()
    return _autocast(model, frozen, device_type)


def _autocast(model: nn.Module, frozen: torch.dtype, device_type: str | None):
    """mixed_precision's autocast in the frozen weights' dtype, peft's input casts off."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type or next(model.parameters()).device.type,
                                       dtype=frozen))
    if hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):  # peft's
        from peft.helpers import disable_input_dtype_casting
        stack.enter_context(disable_input_dtype_casting(model))
    return stack


# ------------------------------------------------ the kernels: log softmax(z / T)[id], lean


def _pick_and_lse(z: Tensor, ids: Tensor, temperature: float,
                  acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """Chunk logits z (c, V) -> (log softmax(z / T)[ids], logsumexp(z / T)), each (c,), in `acc`."""
    lg = z.to(acc, copy=True).div_(temperature)  # (c, V): one fp32 buffer, not a cast and quotient
    lse = torch.logsumexp(lg, dim=-1)  # (c,)
    return lg.gather(-1, ids[:, None]).squeeze(-1) - lse, lse


def _logits_grad(z: Tensor, ids: Tensor, lse: Tensor, grad_out: Tensor, temperature: float,
                 owned: bool) -> Tensor:
    """d(sum_i g_i logp_i) / dz = (onehot(ids) - softmax(z / T)) * g / T for a chunk z (c, V), in
    lse's dtype, built in place in one (c, V) buffer. owned: z is a temporary that may be
    overwritten (else it is copied: fp32 logits would otherwise be the saved input itself)."""
    g = grad_out[:, None].to(lse.dtype) / temperature  # (c, 1)
    # -softmax * g
    dz = z.to(lse.dtype, copy=not owned).div_(temperature).sub_(lse[:, None]).exp_().mul_(-g)
    return dz.scatter_add_(-1, ids[:, None], g)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(x / T)[id] per row, with the backward written out:

        d logp / d x_j = (1[j = id] - softmax(x / T)_j) / T

    Forward keeps only the (rows,) logsumexp; backward rebuilds the softmax from it chunk by
    chunk (one exp, no second logsumexp), so no fp32 (rows, V) tensor outlives its chunk and
    nothing is computed twice, unlike checkpointing the plain expression."""

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, temperature: float, chunk: int) -> Tensor:
        acc = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 for fp64 logits
        lse = logits.new_empty(logits.shape[0], dtype=acc)  # (rows,)
        out = torch.empty_like(lse)  # (rows,)
        for s in range(0, logits.shape[0], chunk):
            out[s:s + chunk], lse[s:s + chunk] = _pick_and_lse(
                logits[s:s + chunk], ids[s:s + chunk], temperature, acc)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, ids, lse = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)  # (rows, V)
        for s in range(0, logits.shape[0], chunk):
            e = slice(s, s + chunk)
            grad[e] = _logits_grad(logits[e], ids[e], lse[e], grad_out[e], T, owned=False)
        return grad, None, None, None


LOGITS_PER_CHUNK = 2**26  # grpo.logprob_chunk 0: rows per chunk = this // V (256 MiB fp32 logits)


def chunk_rows(chunk: int, vocab: int) -> int:
    """Rows of logits per chunk: `chunk`, or for 0 as many as make LOGITS_PER_CHUNK logits. A fixed
    row count does not scale: 4096 rows are 0.8 GB of fp32 at V = 49k but 2.5 GB at Qwen's 151k,
    part of the H100 run's excess memory (bench/RESULTS.md, GPU)."""
    return chunk or max(1, LOGITS_PER_CHUNK // vocab)


def selective_log_probs(logits: Tensor, ids: Tensor, temperature: float = 1.0,
                        chunk: int = 0) -> Tensor:
    """log softmax(logits / T)[ids] = logits[ids] / T - logsumexp(logits / T), in fp32, `chunk` rows
    at a time (0: chunk_rows's automatic size).

    Never materialises a full (N, T, V) fp32 log-softmax (20 GB for Qwen's V = 151k at 64 x 512):
    forward and backward (_SelectiveLogSoftmax) each hold one fp32 chunk at a time.
    logits (N, T, V), ids (N, T) -> (N, T) fp32.
    """
    N, T, V = logits.shape
    flat, flat_ids = logits.reshape(N * T, V), ids.reshape(N * T)  # (N*T, V), (N*T,)
    return _SelectiveLogSoftmax.apply(flat, flat_ids, temperature, chunk_rows(chunk, V)).view(N, T)


class _FusedHeadLogSoftmax(torch.autograd.Function):
    """log softmax(h W^T / T)[id] per row without ever holding the (rows, V) logits: each chunk of
    rows is projected through the output head, reduced to its log-prob and logsumexp, and
    dropped; backward projects the chunk again. With z = h W^T and p = softmax(z / T):

        d logp / d h = (onehot - p) W / T,    d logp / d W = (onehot - p)^T h / T
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float,
                chunk: int) -> Tensor:
        acc = torch.promote_types(hidden.dtype, torch.float32)
        lse = hidden.new_empty(hidden.shape[0], dtype=acc)  # (rows,)
        out = torch.empty_like(lse)  # (rows,)
        for s in range(0, hidden.shape[0], chunk):  # a chunk's logits as the head would give them
            out[s:s + chunk], lse[s:s + chunk] = _pick_and_lse(
                hidden[s:s + chunk] @ weight.T, ids[s:s + chunk], temperature, acc)
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, ids, lse = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None  # (rows, H)
        grad_w = (torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)  # (V, H)
                  if want_w else None)
        for s in range(0, hidden.shape[0], chunk):
            e = slice(s, s + chunk)
            dz = _logits_grad(hidden[e] @ weight.T, ids[e], lse[e], grad_out[e], T,
                              owned=True)  # (c, V)
            if want_h:
                grad_h[e] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                grad_w += dz.T @ hidden[e].to(lse.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def fused_head_log_probs(hidden: Tensor, head: nn.Linear, ids: Tensor, temperature: float,
                         chunk: int) -> Tensor:
    """log softmax(head(hidden) / T)[ids] through _FusedHeadLogSoftmax. hidden (N, C, H), ids (N, C)
    -> (N, C)."""
    N, C, H = hidden.shape
    return _FusedHeadLogSoftmax.apply(
        hidden.reshape(N * C, H), head.weight, ids.reshape(N * C), temperature,
        chunk_rows(chunk, head.weight.shape[0])).view(N, C)


_HEAD_SCALES = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                "output_multiplier_scale")


def plain_output_head(model) -> nn.Linear | None:
    """The output head when logits are exactly hidden @ W^T (a bias-free nn.Linear, no logit
    scaling or soft-capping, a decoder we can call on its own), else None."""
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    if (type(head) is not nn.Linear or head.bias is not None
            or any(getattr(config, k, None) not in (None, 1, 1.0) for k in _HEAD_SCALES)):
        return None
    try:
        model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    return head
