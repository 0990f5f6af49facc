"""Memory-lean log-softmax kernels for logprobs.py: the sampled tokens' log-probs without a full
(N, T, V) fp32 log-softmax, in chunks of rows, with the backward written out.

    logp = selective_log_probs(logits, ids, temperature)            # (N, T, V), (N, T) -> (N, T)
    logp = fused_head_log_probs(hidden, head, ids, temperature, 0)  # no (N, T, V) logits at all

Both give log softmax(z / T)[id] = z[id] / T - logsumexp(z / T) and its exact gradient
(tests/test_logprobs.py checks them against the plain expression and with gradcheck).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


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
