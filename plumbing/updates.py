"""What every training mode's update shares (GRPO's step.py, modes/sft.py, modes/dpo.py): rows cut
into micro-batches, their log-probs, the optimizer step (fp16 loss scaling, a non-finite gradient
skipped), the gradient-norm metrics and the peak memory.

    for mb in micro_batches(batch, cfg.optim.micro_batch_size, cfg.optim.micro_batch_tokens):
        logp, C = micro_batch_log_probs(model, batch, batch.input_ids, batch.attention_mask,
                                        mb, cfg)
    grad_norm, lr = optimizer_step(run)
"""
from __future__ import annotations

import math
import resource
import sys
import warnings

import torch

import logprobs
import rollout
from config import Config
from model import mixed_precision
from parallel.distributed import sum_gradients


def micro_batches(batch: rollout.Rollout, size: int, max_tokens: int = 0,
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
    if not max_tokens:
        return [slice(s, min(s + size, n)) for s in range(0, n, size)]
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


def micro_batch_log_probs(model, batch: rollout.Rollout, ids, attn, mb: slice, cfg: Config,
                          temperature: float | None = None) -> tuple[torch.Tensor, int]:
    """(n, C) log-probs of the micro-batch's completion tokens, all-padding columns trimmed; and C.
    The temperature is the sampler's (rollout.temperature) unless given."""
    i, a, C = logprobs.trim(ids[mb], attn[mb], batch.completion_mask[mb])
    T = cfg.rollout.temperature if temperature is None else temperature
    share = logprobs.share_prompt_in_loss(cfg.grpo.share_prompt, i.device)
    with mixed_precision(model):  # bf16/fp16 matmuls over a 16-bit base; nothing on an fp32 model
        return logprobs.sequence_log_probs(model, i, a, C, T, cfg.grpo.logprob_chunk,
                                           cfg.grpo.fused_lm_head, share), C


@torch.no_grad()
def batch_log_probs(model, batch: rollout.Rollout, cfg: Config,
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


def optimizer_step(r) -> tuple[float, float]:
    """Unscale (fp16), clip, step the optimizer and schedule of r (a step.Run) -> (grad norm, lr).
    A non-finite gradient skips the update (the schedule still advances): one AdamW step on it
    would write NaN into every trained weight for the rest of the run. Under torchrun the
    gradients are first summed over the processes (each loss is its share of the global one)."""
    sum_gradients(r.params)
    if r.scaler:
        r.scaler.unscale_(r.optimizer)
    max_norm = r.cfg.optim.max_grad_norm if r.cfg.optim.max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(r.params, max_norm))
    lr = r.scheduler.get_last_lr()[0]
    if r.scaler:
        r.scaler.step(r.optimizer)  # skips non-finite gradients itself, and lowers the loss scale
        r.scaler.update()
        # halved 17 times from 65536: not a scale still to find, a pass that overflows
        if r.scaler.get_scale() < 1.0:
            raise rollout.NonFiniteLogits("float16 loss scaling has halved its scale below 1, "
                                          "skipping update after update: the training pass gives "
                                          "inf or NaN; " + rollout.NON_FINITE)
    elif math.isfinite(grad_norm):
        r.optimizer.step()
    else:
        print(f"[minigrpo] warning: the gradient norm is {grad_norm}; this update is skipped",
              file=sys.stderr)
    if math.isfinite(grad_norm):
        r.scheduler.step()
    else:  # skipped: torch warns that no optimizer.step came first (LambdaLR reads only the count)
        # only here, as catch_warnings resets which warnings were shown: others would repeat
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            r.scheduler.step()
    return grad_norm, lr


def norm_metrics(norms: list[float]) -> dict:
    """grad_norm: the mean over the step's applied updates; skipped_updates: how many had a
    non-finite gradient (fp16's GradScaler skips those as it finds its scale; see optimizer_step),
    only when some did. A step with no update applied logs no grad_norm (JSON has no inf or NaN).

    >>> norm_metrics([1.0, 3.0]), norm_metrics([2.0, float("inf")]), norm_metrics([float("nan")])
    ({'grad_norm': 2.0}, {'grad_norm': 2.0, 'skipped_updates': 1}, {'skipped_updates': 1})
    """
    applied = [n for n in norms if math.isfinite(n)]
    skipped = len(norms) - len(applied)
    return (({"grad_norm": sum(applied) / len(applied)} if applied else {})
            | ({"skipped_updates": skipped} if skipped else {}))


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
