"""GRPO: the math as pure tensor functions, and the rollout that feeds it.

    adv  = group_advantages(rewards, G)                                  # (N,)
    logp = sequence_log_probs(model, ids, attn, C, temperature)          # (N, C)
    loss, stats = grpo_loss(logp, old_logp, ref_logp, adv, mask, norm)   # scalar, dict of sums

Shapes: N = B prompts x G completions, P = prompt length, C = completion length, V = vocab.
Departures from the paper (arXiv 2402.03300), all switchable in the config:
- the clip has separate lower and upper bounds (DAPO clip-higher, `epsilon_high`);
- the loss normalisation is a named choice (`loss_type`), default DAPO's global token mean;
- no KL term unless `beta > 0` (TRL's default), and the KL uses the k3 estimator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

# ----------------------------------------------------------------------------- the math


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
                     zero_std_tol: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean_g(r)) / (std + eps), groups of `group_size` consecutive rewards.

    scale: "group" -> std of the group; "batch" -> std of all rewards; "none" -> no division
    (Dr. GRPO, arXiv 2503.20783: dividing by the group std up-weights too easy / too hard prompts).
    std is the unbiased sample std, as in TRL. A group whose rewards are equal (within
    zero_std_tol) gets exactly 0: rounding in the mean would otherwise leave ~1e-7 / eps.
    A NaN reward (a judge or rating that failed, with fallback: skip) is left out: the mean and
    std are over the group's other rewards, and the skipped completion's advantage is 0 (the
    trainer also drops it from the loss). A group with fewer than 2 rewards carries no signal: 0.
    """
    r = rewards.view(-1, group_size)  # (B, G)
    mean, std, n = group_stats(rewards, group_size)  # (B,) each
    centered = torch.where(torch.isnan(r), 0.0, r - mean[:, None])  # (B, G)
    flat = zero_std_groups(rewards, group_size, zero_std_tol) | (n < 2)  # (B,)
    centered = torch.where(flat[:, None], 0.0, centered)
    if scale == "group":
        centered = centered / (std[:, None] + eps)
    elif scale == "batch":
        kept = rewards[~torch.isnan(rewards)]  # (<= N,)
        centered = centered / ((kept.std() if kept.numel() > 1 else 0.0) + eps)
    elif scale != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale!r}")
    return centered.view(-1)  # (N,)


def group_stats(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per group of `group_size` consecutive rewards, over its non-NaN ones: (mean, unbiased std,
    count), each (B,); mean 0 without rewards, std 0 with fewer than 2."""
    r = rewards.view(-1, group_size)  # (B, G)
    valid = ~torch.isnan(r)  # (B, G)
    n = valid.sum(dim=1)  # (B,)
    mean = torch.where(valid, r, 0.0).sum(dim=1) / n.clamp(min=1)  # (B,)
    sq = torch.where(valid, (r - mean[:, None]) ** 2, 0.0).sum(dim=1)  # (B,)
    return mean, (sq / (n - 1).clamp(min=1)).sqrt(), n


def zero_std_groups(rewards: Tensor, group_size: int, tol: float = 1e-6) -> Tensor:
    """(B,) bool: groups whose rewards are all equal (up to `tol`, as judge scores are noisy floats);
    NaN rewards (skipped) are left out, and a group with none left counts as equal."""
    r = rewards.view(-1, group_size)  # (B, G)
    valid = ~torch.isnan(r)
    high = torch.where(valid, r, -torch.inf).max(dim=1).values  # (B,)
    low = torch.where(valid, r, torch.inf).min(dim=1).values  # (B,)
    return (high - low) <= tol


def completion_mask(completion_ids: Tensor, eos_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask by position: 1 for every token up to and including the first EOS, 0 after.

    Masking by `token != pad` is wrong when pad == eos: it drops the real EOS, so the model
    never learns to stop. Returns (mask (N, C) float, truncated (N,) bool: no EOS at all).
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))  # (N, C)
    has_eos = is_eos.any(dim=1)  # (N,)
    C = completion_ids.shape[1]
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, C, dtype=torch.long))  # (N,)
    positions = torch.arange(C, device=completion_ids.device)[None, :]  # (1, C)
    return (positions <= first[:, None]).float(), ~has_eos


def _pick_and_lse(z: Tensor, ids: Tensor, temperature: float, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """A chunk of logits z (c, V) -> (log softmax(z / T)[ids], logsumexp(z / T)), each (c,), in `acc`."""
    lg = z.to(acc, copy=True).div_(temperature)  # (c, V): one fp32 buffer, not a cast and a quotient
    lse = torch.logsumexp(lg, dim=-1)  # (c,)
    return lg.gather(-1, ids[:, None]).squeeze(-1) - lse, lse


def _logits_grad(z: Tensor, ids: Tensor, lse: Tensor, grad_out: Tensor, temperature: float, owned: bool) -> Tensor:
    """d(sum_i g_i logp_i) / dz = (onehot(ids) - softmax(z / T)) * g / T for a chunk z (c, V), in
    lse's dtype, built in place in one (c, V) buffer. owned: z is a temporary that may be
    overwritten (else it is copied: fp32 logits would otherwise be the saved input itself)."""
    g = grad_out[:, None].to(lse.dtype) / temperature  # (c, 1)
    dz = z.to(lse.dtype, copy=not owned).div_(temperature).sub_(lse[:, None]).exp_().mul_(-g)  # -softmax * g
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
            out[s:s + chunk], lse[s:s + chunk] = _pick_and_lse(logits[s:s + chunk], ids[s:s + chunk], temperature, acc)
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


LOGITS_PER_CHUNK = 2**26  # grpo.logprob_chunk 0: rows per chunk = this // V (256 MiB of fp32 logits a chunk)


def chunk_rows(chunk: int, vocab: int) -> int:
    """Rows of logits per chunk: `chunk`, or for 0 as many as make LOGITS_PER_CHUNK logits. A fixed
    row count does not scale: 4096 rows are 0.8 GB of fp32 at V = 49k but 2.5 GB at Qwen's 151k, part
    of the H100 run's excess memory (bench/RESULTS.md, GPU)."""
    return chunk or max(1, LOGITS_PER_CHUNK // vocab)


def selective_log_probs(logits: Tensor, ids: Tensor, temperature: float = 1.0, chunk: int = 0) -> Tensor:
    """log softmax(logits / T)[ids] = logits[ids] / T - logsumexp(logits / T), in fp32, `chunk` rows at a time
    (0: chunk_rows's automatic size).

    Never materialises a full (N, T, V) fp32 log-softmax (20 GB for Qwen's V = 151k at 64 x 512):
    forward and backward (_SelectiveLogSoftmax) each hold one fp32 chunk at a time.
    logits (N, T, V), ids (N, T) -> (N, T) fp32.
    """
    N, T, V = logits.shape
    flat, flat_ids = logits.reshape(N * T, V), ids.reshape(N * T)  # (N*T, V), (N*T,)
    return _SelectiveLogSoftmax.apply(flat, flat_ids, temperature, chunk_rows(chunk, V)).view(N, T)  # (N, T)


def per_token_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor,
                   epsilon: float, epsilon_high: float, beta: float,
                   is_weight: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """l_t = -w_t min(rho_t A, clip(rho_t, 1 - eps, 1 + eps_high) A) + beta * KL_t, rho_t = exp(logp_t - old_logp_t).

    w_t is 1, or the (detached) truncated importance weight min(exp(old_logp_t - sampler_logp_t), cap)
    when another engine (vLLM) sampled: it corrects the policy-gradient term for the sampler's
    slightly different distribution (see vllm_engine.py).

    KL_t is the k3 estimator exp(ref_t - logp_t) - (ref_t - logp_t) - 1 >= 0 (0 when beta = 0).
    With one update per rollout, old_logp is logp.detach(): rho is exactly 1 in value but
    exp(logp - logp.detach()) still carries d logp, so the loss value sits near 0 while the policy
    learns. That is why "loss is 0" is normal in GRPO: watch the reward instead.
    logp, old_logp, ref_logp: (N, C); adv: (N,). Returns (loss, rho, kl), each (N, C).
    """
    rho = torch.exp(logp - old_logp)  # (N, C)
    a = adv[:, None]  # (N, 1)
    loss = -torch.minimum(rho * a, torch.clamp(rho, 1 - epsilon, 1 + epsilon_high) * a)  # (N, C)
    if is_weight is not None:
        loss = loss * is_weight.detach()
    kl = torch.zeros_like(logp)
    if beta > 0:
        d = ref_logp - logp  # (N, C)
        kl = torch.exp(d) - d - 1
        loss = loss + beta * kl
    return loss, rho, kl


@dataclass
class LossNorm:
    """What the loss is divided by; the counts are for the whole optimizer step, not the micro-batch."""
    loss_type: str  # grpo | bnpo | dr_grpo | dapo
    num_sequences: int  # completions in the optimizer step
    num_tokens: int  # unmasked completion tokens in the optimizer step
    max_completion_length: int  # rollout.max_new_tokens
    num_micro_batches: int  # micro-batches accumulated into the step


def aggregate(loss_tok: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """Reduce a micro-batch's (n, C) per-token loss so that summing micro-batches gives the step loss.

    grpo:    (1/N) sum_i (sum_t m_it l_it / sum_t m_it)       mean per sequence, then over sequences
    bnpo:    (1/M) sum m l / sum m (this micro-batch)          token mean per micro-batch (M micro-batches)
    dr_grpo: sum m l / (N * max_completion_length)             constant normaliser, no length bias
    dapo:    sum m l / (sum of m over the whole step)          global token mean
    N = sequences in the step. Only bnpo depends on how the step is split into micro-batches.
    """
    masked = torch.where(mask.bool(), loss_tok, torch.zeros_like(loss_tok))  # (n, C)
    if norm.loss_type == "grpo":
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / norm.num_sequences
    if norm.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1) / norm.num_micro_batches
    if norm.loss_type == "dr_grpo":
        return masked.sum() / (norm.num_sequences * norm.max_completion_length)
    if norm.loss_type == "dapo":
        return masked.sum() / max(norm.num_tokens, 1)
    raise ValueError(f"unknown loss_type {norm.loss_type!r}")


def grpo_loss(logp: Tensor, old_logp: Tensor | None, ref_logp: Tensor | None, adv: Tensor, mask: Tensor,
              norm: LossNorm, epsilon: float = 0.2, epsilon_high: float = 0.2, beta: float = 0.0,
              is_weight: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The micro-batch's share of the step loss, and token sums for the step's metrics.

    old_logp None means on-policy (num_iterations = 1): old_logp = logp.detach().
    Clip fractions count tokens where the clip is active: rho < 1 - eps with A < 0 (low),
    rho > 1 + eps_high with A > 0 (high). Divide the sums by `tokens` for means.
    """
    if old_logp is None:
        old_logp = logp.detach()
    loss_tok, rho, kl = per_token_loss(logp, old_logp, ref_logp, adv, epsilon, epsilon_high, beta, is_weight)  # (n, C) x3
    loss = aggregate(loss_tok, mask, norm)
    m = mask.bool()
    a = adv[:, None].expand_as(rho)  # (n, C)
    with torch.no_grad():
        stats = {
            "tokens": float(m.sum()),
            "kl_sum": float(kl[m].sum()),
            "ratio_sum": float(rho[m].sum()),
            "clip_low_sum": float(((rho < 1 - epsilon) & (a < 0))[m].sum()),
            "clip_high_sum": float(((rho > 1 + epsilon_high) & (a > 0))[m].sum()),
        }
    return loss, stats


# ----------------------------------------------------------------------------- model-facing pieces


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: cumsum(mask) - 1 (pads get 0). (N, T) -> (N, T)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class _FusedHeadLogSoftmax(torch.autograd.Function):
    """log softmax(h W^T / T)[id] per row without ever holding the (rows, V) logits: each chunk of
    rows is projected through the output head, reduced to its log-prob and logsumexp, and
    dropped; backward projects the chunk again. With z = h W^T and p = softmax(z / T):

        d logp / d h = (onehot - p) W / T,    d logp / d W = (onehot - p)^T h / T
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, chunk: int) -> Tensor:
        acc = torch.promote_types(hidden.dtype, torch.float32)
        lse = hidden.new_empty(hidden.shape[0], dtype=acc)  # (rows,)
        out = torch.empty_like(lse)  # (rows,)
        for s in range(0, hidden.shape[0], chunk):  # each chunk's logits as the model's head would give them
            out[s:s + chunk], lse[s:s + chunk] = _pick_and_lse(hidden[s:s + chunk] @ weight.T, ids[s:s + chunk], temperature, acc)
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, ids, lse = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None  # (rows, H)
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if want_w else None  # (V, H)
        for s in range(0, hidden.shape[0], chunk):
            e = slice(s, s + chunk)
            dz = _logits_grad(hidden[e] @ weight.T, ids[e], lse[e], grad_out[e], T, owned=True)  # (c, V)
            if want_h:
                grad_h[e] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                grad_w += dz.T @ hidden[e].to(lse.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def fused_head_log_probs(hidden: Tensor, head: nn.Linear, ids: Tensor, temperature: float, chunk: int) -> Tensor:
    """log softmax(head(hidden) / T)[ids] through _FusedHeadLogSoftmax. hidden (N, C, H), ids (N, C) -> (N, C)."""
    N, C, H = hidden.shape
    return _FusedHeadLogSoftmax.apply(hidden.reshape(N * C, H), head.weight, ids.reshape(N * C),
                                      temperature, chunk_rows(chunk, head.weight.shape[0])).view(N, C)


_HEAD_SCALES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def plain_output_head(model) -> nn.Linear | None:
    """The output head when logits are exactly hidden @ W^T (a bias-free nn.Linear, no logit
    scaling or soft-capping, a decoder we can call on its own), else None."""
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    if type(head) is not nn.Linear or head.bias is not None or any(getattr(config, k, None) not in (None, 1, 1.0) for k in _HEAD_SCALES):
        return None
    try:
        model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    return head


def share_prompt_in_loss(setting: bool | str, device: torch.device) -> bool:
    """grpo.share_prompt for the loss forward: true or false as set; "auto" shares on CPU only.
    Sharing runs a micro-batch through the model twice (the prompts, then the completions on their
    cache), which doubles its kernel launches (25k against 12k aten operators for Qwen3-0.6B's 28
    layers, counted on CPU: bench/gpu_h100/op_count_cpu.log). A CPU is bound by arithmetic, so the prompt work saved wins there (0.64x the
    training time at 45-token prompts); a GPU running a small model is bound by launches, and on an
    H100 (Qwen3-0.6B shape, 45-token prompts) minigrpo's training phase took 2.5x TRL's with it on.
    The sampling prefill shares unless the setting is false: one extra forward per rollout."""
    return setting is True or (setting == "auto" and device.type != "cuda")


def sequence_log_probs(model, input_ids: Tensor, attention_mask: Tensor, num_completion: int,
                       temperature: float = 1.0, chunk: int = 0, fused_head: bool = False,
                       share_prompt: bool = False) -> Tensor:
    """log pi(token | prefix) / T-tempered, for the last `num_completion` tokens of each row.

    The attention mask and left-padding-aware position ids are always passed (RoPE hides a wrong
    position, absolute-position models do not); only the C logits that score a token are
    computed (`logits_to_keep`). fused_head (grpo.fused_lm_head): the decoder's hidden states go
    through the output head chunk by chunk (_FusedHeadLogSoftmax), so the (N, C, V) logits never
    exist; models whose head is not plain (plain_output_head) take the usual path. share_prompt
    (grpo.share_prompt): rows with the same prompt run it through the model once
    (_shared_prompt_log_probs); the same values up to float rounding.
    input_ids, attention_mask: (N, P + C) -> (N, C) fp32.
    """
    assert input_ids.shape[1] > num_completion, "a completion needs at least one prompt token before it"
    # the last token predicts nothing we score: leave it out, so the kept logits are exactly the
    # C positions j whose logits predict token j + 1, contiguous (a [:, :-1] slice would copy them)
    inputs = dict(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                  position_ids=position_ids(attention_mask)[:, :-1], use_cache=False)
    ids = input_ids[:, -num_completion:]  # (N, C)
    head = plain_output_head(model) if fused_head else None
    if share_prompt:
        logp = _shared_prompt_log_probs(model, input_ids, attention_mask, num_completion, temperature, chunk, head)
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
    return cache if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers) else None


def _shared_prompt_log_probs(model, input_ids: Tensor, attention_mask: Tensor, C: int, temperature: float,
                             chunk: int, head: nn.Linear | None) -> Tensor | None:
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
    if len(uniq) == N or any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return None
    cache = prompt_cache(model)
    if cache is None:
        return None
    pos = position_ids(attention_mask)  # (N, W)
    u_mask = uniq[:, P:]  # (u, P)
    first_in = dict(input_ids=uniq[:, :P], attention_mask=u_mask, position_ids=position_ids(u_mask),
                    past_key_values=cache, use_cache=True)
    rest_in = dict(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], position_ids=pos[:, P:-1],
                   past_key_values=cache, use_cache=True)  # (N, C - 1) on top of the (N, P) cache
    ids = input_ids[:, P:]  # (N, C)
    if head is not None:
        decoder = model.get_decoder()
        hidden = decoder(**first_in).last_hidden_state[:, -1:][inv]  # (N, 1, H)
        if C > 1:
            cache.batch_select_indices(inv)
            hidden = torch.cat([hidden, decoder(**rest_in).last_hidden_state], dim=1)  # (N, C, H)
        return fused_head_log_probs(hidden, head, ids, temperature, chunk)  # (N, C)
    first = selective_log_probs(model(**first_in, logits_to_keep=1).logits[inv], ids[:, :1], temperature, chunk)  # (N, 1)
    if C == 1:
        return first
    cache.batch_select_indices(inv)
    rest = selective_log_probs(model(**rest_in).logits, ids[:, 1:], temperature, chunk)  # (N, C - 1)
    return torch.cat([first, rest], dim=1)  # (N, C)


@dataclass
class Rollout:
    """B x G sampled completions; rows i*G .. i*G+G-1 share prompt i."""
    prompt_ids: Tensor  # (N, P) left-padded
    prompt_mask: Tensor  # (N, P)
    completion_ids: Tensor  # (N, C) right-padded
    completion_mask: Tensor  # (N, C) 1 up to and including the first EOS (or stop string)
    truncated: Tensor  # (N,) bool: hit max_new_tokens without EOS
    texts: list[str]  # decoded completions, EOS and padding removed
    sampler_logp: Tensor | None = None  # (N, C) the sampler's own log-probs (vLLM), for importance weights

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # (N, P + C)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask.long()], dim=1)  # (N, P + C)


def chat_messages(prompt: str | list[dict], system_prompt: str | None = None) -> list[dict]:
    """A prompt (a user message, or a list of messages) with the system prompt in front."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def render_prompt(tokenizer, prompt: str | list[dict], system_prompt: str | None = None, assistant_prefix: str = "",
                  template_kwargs: dict | None = None) -> str:
    """Chat-template a prompt; the forced assistant prefix is part of the prompt. template_kwargs go
    to the chat template (Qwen3: {"enable_thinking": False})."""
    return tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), tokenize=False,
                                         add_generation_prompt=True, **(template_kwargs or {})) + assistant_prefix


def render_rows(tokenizer, rows: list[dict], data, assistant_prefix: str | None = None) -> list[str]:
    """Each row's prompt rendered as the data config says (system prompt, chat template arguments,
    forced assistant prefix unless `assistant_prefix` is given)."""
    prefix = data.assistant_prefix if assistant_prefix is None else assistant_prefix
    return [render_prompt(tokenizer, r["prompt"], data.system_prompt, prefix, data.chat_template_kwargs) for r in rows]


def eos_token_ids(tokenizer, model) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def _cut_at_stop_strings(tokenizer, ids: Tensor, mask: Tensor, truncated: Tensor, stops: list[str]) -> None:
    """Shorten masks in place so a completion ends with the token that completes its first stop string."""
    for i in range(ids.shape[0]):
        n = int(mask[i].sum())
        text = tokenizer.decode(ids[i, :n], skip_special_tokens=True)
        if not any(s in text for s in stops):
            continue
        lo, hi = 1, n  # smallest prefix length whose text contains a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in tokenizer.decode(ids[i, :mid], skip_special_tokens=True) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        mask[i, lo:] = 0
        truncated[i] = False


STATIC_BUCKET = 64  # rollout.compile: prompts are left-padded to a multiple of this many tokens


@torch.no_grad()
def generate_rollout(model, tokenizer, prompts: list[str], num_generations: int, max_new_tokens: int,
                     temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                     stop_strings: list[str] = (), max_prompt_tokens: int = 100_000, ignore_eos: bool = False,
                     share_prompt: bool = False, static_cache: bool = False) -> Rollout:
    """Sample `num_generations` completions for each rendered prompt with HF generate (left padding);
    temperature 0 decodes greedily (evaluation). ignore_eos suppresses EOS until max_new_tokens, so
    every completion has the same length (speed benchmarks; such completions count as truncated).
    share_prompt (grpo.share_prompt): each prompt but its last token is run through the model once
    and its KV cache copied to the G rows, instead of G identical prefills (prefill_shared).
    static_cache (rollout.compile): HF generate with a preallocated KV cache, which transformers
    compiles with torch.compile on CUDA; prompts are left-padded to a multiple of STATIC_BUCKET
    tokens so that few distinct cache shapes (each one a compilation) occur. No prompt sharing then."""
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False,
                    pad_to_multiple_of=STATIC_BUCKET if static_cache else None).to(device)
    longest = int(enc.attention_mask.sum(1).max())
    if longest > max_prompt_tokens:
        raise ValueError(f"a prompt has {longest} tokens > rollout.max_prompt_tokens={max_prompt_tokens}")
    eos = eos_token_ids(tokenizer, model)
    was_training = model.training
    model.eval()
    decoding = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None) if temperature > 0 \
        else dict(do_sample=False)
    shared = share_prompt and not static_cache
    cache = prefill_shared(model, enc.input_ids, enc.attention_mask, num_generations) if shared else None
    if cache is not None:  # generate runs only the last prompt token, then samples
        rows = dict(input_ids=enc.input_ids.repeat_interleave(num_generations, 0),
                    attention_mask=enc.attention_mask.repeat_interleave(num_generations, 0), past_key_values=cache)
    else:
        rows = dict(input_ids=enc.input_ids, attention_mask=enc.attention_mask, num_return_sequences=num_generations)
    out = model.generate(
        **rows, **decoding, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens if ignore_eos else None,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, use_cache=True,
        cache_implementation="static" if static_cache else None,
        stop_strings=list(stop_strings) or None, tokenizer=tokenizer if stop_strings else None)
    model.train(was_training)
    P = enc.input_ids.shape[1]
    completion_ids = out[:, P:]  # (N, C)
    mask, truncated = completion_mask(completion_ids, eos)  # (N, C), (N,)
    if stop_strings:
        _cut_at_stop_strings(tokenizer, completion_ids, mask, truncated, list(stop_strings))
    lengths = mask.sum(1).long().tolist()
    texts = tokenizer.batch_decode([completion_ids[i, :n] for i, n in enumerate(lengths)], skip_special_tokens=True)
    return Rollout(prompt_ids=enc.input_ids.repeat_interleave(num_generations, 0),
                   prompt_mask=enc.attention_mask.repeat_interleave(num_generations, 0),
                   completion_ids=completion_ids, completion_mask=mask, truncated=truncated, texts=texts)


def generate_in_slices(model, tokenizer, prompts: list[str], per_call: int, *args,
                       on_slice: Callable[[int, Rollout], None] | None = None, **kwargs) -> Rollout:
    """generate_rollout on `per_call` prompts at a time (0: all in one call), the slices joined in
    order: each call's KV cache holds per_call x num_generations rows (rollout.prompts_per_generate,
    eval.batch_size). on_slice(first prompt's index, slice) runs after each call, before the next
    one samples (train.score starts scoring the slice there). Further arguments are generate_rollout's."""
    k, parts = per_call or len(prompts), []
    for s in range(0, len(prompts), k):
        parts.append(generate_rollout(model, tokenizer, prompts[s:s + k], *args, **kwargs))
        if on_slice is not None:
            on_slice(s, parts[-1])
    return concat_rollouts(parts, tokenizer.pad_token_id)


def prefill_shared(model, input_ids: Tensor, attention_mask: Tensor, num_generations: int):
    """The KV cache of every prompt but its last token, computed once per prompt and repeated to its
    G rows (B * G, P - 1), for generate to continue from; None where sharing does not apply or pay:
    G = 1, a prompt of one token, or a cache that is not plain keys and values (prompt_cache).
    input_ids, attention_mask: (B, P), left-padded."""
    cache = prompt_cache(model) if num_generations > 1 and int(attention_mask.sum(1).min()) >= 2 else None
    if cache is None:
        return None
    mask = attention_mask[:, :-1]  # (B, P - 1)
    model(input_ids=input_ids[:, :-1], attention_mask=mask, position_ids=position_ids(mask),
          past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(num_generations)  # (B * G, P - 1): rows i*G .. i*G+G-1 share prompt i
    return cache


def _pad_to(x: Tensor, width: int, value: int, left: bool) -> Tensor:
    pad = x.new_full((x.shape[0], width - x.shape[1]), value)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts of different lengths: prompts stay left-padded, completions right-padded."""
    if len(parts) == 1:
        return parts[0]
    P = max(r.prompt_ids.shape[1] for r in parts)
    C = max(r.completion_ids.shape[1] for r in parts)
    return Rollout(
        prompt_ids=torch.cat([_pad_to(r.prompt_ids, P, pad_id, True) for r in parts]),
        prompt_mask=torch.cat([_pad_to(r.prompt_mask, P, 0, True) for r in parts]),
        completion_ids=torch.cat([_pad_to(r.completion_ids, C, pad_id, False) for r in parts]),
        completion_mask=torch.cat([_pad_to(r.completion_mask, C, 0, False) for r in parts]),
        truncated=torch.cat([r.truncated for r in parts]),
        texts=[t for r in parts for t in r.texts],
        sampler_logp=None if parts[0].sampler_logp is None else torch.cat([_pad_to(r.sampler_logp, C, 0, False) for r in parts]))


def select_rows(r: Rollout, rows: list[int]) -> Rollout:
    ix = torch.tensor(rows, dtype=torch.long, device=r.prompt_ids.device)
    return Rollout(r.prompt_ids[ix], r.prompt_mask[ix], r.completion_ids[ix], r.completion_mask[ix],
                   r.truncated[ix], [r.texts[i] for i in rows], None if r.sampler_logp is None else r.sampler_logp[ix])


def trim(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """Drop all-padding columns of a micro-batch: leading prompt pads and completion columns past the
    longest completion. Causal attention makes the result identical. -> (ids, attn, C kept)."""
    C_all = completion_mask.shape[1]
    C = max(int(completion_mask.sum(1).max()), 1)
    start = int((attention_mask[:, : attention_mask.shape[1] - C_all].sum(0) > 0).long().argmax()) if attention_mask.shape[1] > C_all else 0
    end = attention_mask.shape[1] - C_all + C
    return input_ids[:, start:end], attention_mask[:, start:end], C
