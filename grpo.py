"""GRPO: the math, as pure tensor functions of rewards and log-probs (no model in sight).

    adv  = group_advantages(rewards, G)                                  # (N,)
    mask, truncated = completion_mask(completion_ids, eos_ids)           # (N, C), (N,)
    loss, stats = grpo_loss(logp, old_logp, ref_logp, adv, mask, norm)   # scalar, dict of sums

The log-probs come from logprobs.py (sequence_log_probs), the completions from rollout.py.
Shapes: N = B prompts x G completions, C = completion length.
Departures from the paper (arXiv 2402.03300), all switchable in the config:
- the clip has separate lower and upper bounds (DAPO clip-higher, `epsilon_high`);
- the loss normalisation is a named choice (`loss_type`), default DAPO's global token mean;
- no KL term unless `beta > 0` (TRL's default; when on, it is the paper's k3 estimator);
- the ratio can be one per completion instead of one per token (GSPO, `importance_sampling_level`);
- the policy-gradient term can be limited to the step's high-entropy tokens (`top_entropy_quantile`);
- negative-advantage ratios can be capped too (INTELLECT-2's two-sided clip, `delta`), or the clipped
  objective swapped for CISPO's clipped, detached importance weight (`policy_loss: cispo`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

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


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """(N, C) bool: the tokens of `mask` whose entropy is in the top `quantile` share of the masked
    tokens' entropies, H_t >= tau with tau their (1 - quantile) quantile (linear interpolation, as
    torch.quantile's default); ties at tau are all kept, so slightly more than that share can be.

    "Beyond the 80/20 Rule" (arXiv 2506.01939): RL with verifiable rewards changes mostly the few
    high-entropy "forking" tokens; training only on the top 20% (quantile 0.2) matched all tokens
    on Qwen3-8B and beat them on larger models. quantile 1 keeps every masked token, 0 the
    highest-entropy one(s). tau is taken over the whole step's tokens, so the choice does not depend
    on the micro-batch size (TRL takes it per micro-batch).
    entropy, mask: (N, C) -> (N, C) bool.
    """
    m = mask.bool()  # (N, C)
    if quantile >= 1 or not m.any():
        return m
    h = entropy[m].float().sort().values  # (n,) ascending; torch.quantile refuses over 2^24 values
    pos = (len(h) - 1) * (1 - quantile)  # linear interpolation between the two nearest ranks
    lo = int(pos)
    tau = h[lo] + (h[min(lo + 1, len(h) - 1)] - h[lo]) * (pos - lo)  # scalar
    return m & (entropy >= tau)


def per_token_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor,
                   epsilon: float, epsilon_high: float, beta: float,
                   is_weight: Tensor | None = None, seq_mask: Tensor | None = None,
                   keep: Tensor | None = None, delta: float = 0.0,
                   cispo_cap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """l_t = -k_t w_t min(rho_t A, clip(rho_t, 1 - eps, 1 + eps_high) A) + beta * KL_t, rho_t = exp(logp_t - old_logp_t).

    delta > 0 (INTELLECT-2's two-sided clip, arXiv 2505.07291; TRL's `delta`): rho_t A becomes
    min(rho_t, delta) A. With A > 0 nothing changes (delta > 1 + eps_high); with A < 0 the PPO clip
    leaves rho unbounded, so one token the policy now favours far more than the sampler did could
    push an arbitrarily large update; past delta its gradient is 0 instead.

    cispo_cap given (CISPO, MiniMax-M1 arXiv 2506.13585, as in ScaleRL and TRL): the clip moves from
    the objective to a detached weight, l_t = -k_t w_t sg(min(rho_t, cap)) A logp_t + beta * KL_t.
    Every token keeps a gradient (PPO's clip zeroes it outside [1 - eps, 1 + eps_high]); large
    ratios only stop growing its weight. On-policy (rho = 1) its gradient is the clipped objective's;
    its loss value is -A logp, not near 0.

    seq_mask (N, C) given: GSPO's sequence-level ratio (arXiv 2507.18071) instead, the same for
    every token of completion i, the geometric mean of its tokens' ratios over the mask:
    rho_i = exp((1/|y_i|) sum_t m_it (logp_it - old_logp_it)); clipped per completion, so its
    epsilons are much smaller (3e-4 / 4e-4 in the paper). With the "grpo" loss_type the loss is
    then GSPO's (1/N) sum_i -min(rho_i A_i, clip(rho_i) A_i). On-policy (rho = 1) the gradient is
    the token-level one of that loss_type: the two differ where ratios leave 1 (off-policy updates),
    and with importance weights w_t, whose gradient each token then takes as its completion's
    mean w. The KL term stays per token. Clip fractions still count tokens (the paper's figure).

    w_t is 1, or the detached weight step.sampler_weight gives when another engine (vLLM) sampled:
    exp(old_logp - sampler_logp) per token or per completion (grpo.tis_mode), capped at tis_cap or
    zeroed past it; it corrects the policy-gradient term for the sampler's slightly different
    distribution (see vllm_engine.py).

    k_t is 1, or 0/1 from `keep` (N, C) (high_entropy_mask, grpo.top_entropy_quantile): a token with
    k_t = 0 leaves the policy-gradient term but keeps its KL term and its place in the loss
    normalisation (the paper's and TRL's choice: the normaliser is the same with or without it).
    Token-level ratios only: under GSPO's per-completion ratio a dropped token would still get a
    gradient through rho_i (config.py refuses the pair).

    KL_t is the k3 estimator exp(ref_t - logp_t) - (ref_t - logp_t) - 1 >= 0 (0 when beta = 0).
    With one update per rollout, old_logp is logp.detach(): rho is exactly 1 in value but
    exp(logp - logp.detach()) still carries d logp, so the loss value is only a token-weighted mean
    of -A, plus beta * KL (-A alone is 0 for loss_type "grpo", whose group advantages sum to 0, as long
    as no completion is masked out whole and no keep or w_t is on; for the others it is set by how
    length and advantage go together) while the policy learns. That is
    why "loss is 0" (or a small number) is normal in GRPO: watch the reward instead.
    logp, old_logp, ref_logp: (N, C); adv: (N,). Returns (loss, rho, kl), each (N, C).
    """
    log_rho = logp - old_logp  # (N, C)
    if seq_mask is not None:  # GSPO: each completion's mean log-ratio, broadcast to its tokens
        kept = torch.where(seq_mask.bool(), log_rho, 0.0)  # a NaN at a masked position stays out of the mean
        log_rho = (kept.sum(1, keepdim=True) / seq_mask.sum(1, keepdim=True).clamp(min=1)).expand_as(logp)
    rho = torch.exp(log_rho)  # (N, C)
    a = adv[:, None]  # (N, 1)
    if cispo_cap is not None:
        loss = -torch.clamp(rho, max=cispo_cap).detach() * a * logp  # (N, C)
    else:
        unclipped = torch.clamp(rho, max=delta) if delta > 0 else rho  # (N, C)
        loss = -torch.minimum(unclipped * a, torch.clamp(rho, 1 - epsilon, 1 + epsilon_high) * a)  # (N, C)
    if is_weight is not None:
        loss = loss * is_weight.detach()
    if keep is not None:
        loss = loss * keep
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
    num_sequences: int  # completions in the optimizer step that have a reward (fallback: skip ones are left out)
    num_tokens: int  # unmasked completion tokens in the optimizer step
    max_completion_length: int  # rollout.max_new_tokens
    num_micro_batches: int  # micro-batches accumulated into the step that hold a scored completion


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
              is_weight: Tensor | None = None, level: str = "token",
              keep: Tensor | None = None, delta: float = 0.0,
              cispo_cap: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """The micro-batch's share of the step loss, and token sums for the step's metrics. The defaults
    are PPO's symmetric clip; the config's are DAPO's clip-higher (grpo.epsilon_high: 0.28).

    old_logp None means on-policy (one update per rollout batch): old_logp = logp.detach().
    Outside the mask (padding, skipped or masked truncated rows) old_logp and ref_logp are replaced
    by logp.detach(), so rho = 1 and KL = 0 there: masking the loss afterwards hides only the value,
    and exp(ref - logp) overflowing at a padding token would still make the gradient 0 * inf = NaN.
    Clip fractions count tokens where the clip is active: rho < 1 - eps with A < 0 (low),
    rho > 1 + eps_high with A > 0 (high); with delta, rho > delta with A < 0 (clip_delta); under
    CISPO (cispo_cap) the weight's cap, rho > cap, counts as high and nothing as low. Divide the sums
    by `tokens` for means. level: "token" (a ratio per token) or "sequence" (GSPO: a ratio per
    completion, see per_token_loss). keep (n, C) bool: the tokens in the policy-gradient term
    (high_entropy_mask); None: all. delta, cispo_cap: see per_token_loss.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be token or sequence, got {level!r}")
    m = mask.bool()  # (n, C)
    old_logp = logp.detach() if old_logp is None else torch.where(m, old_logp, logp.detach())  # (n, C)
    if ref_logp is not None:
        ref_logp = torch.where(m, ref_logp, logp.detach())  # (n, C)
    loss_tok, rho, kl = per_token_loss(logp, old_logp, ref_logp, adv, epsilon, epsilon_high, beta, is_weight,
                                       mask if level == "sequence" else None, keep, delta, cispo_cap)  # (n, C) x3
    loss = aggregate(loss_tok, mask, norm)
    a = adv[:, None].expand_as(rho)  # (n, C)
    with torch.no_grad():
        stats = {
            "tokens": float(m.sum()),
            "kl_sum": float(kl[m].sum()),
            "ratio_sum": float(rho[m].sum()),
            "clip_low_sum": 0.0 if cispo_cap is not None else float(((rho < 1 - epsilon) & (a < 0))[m].sum()),
            "clip_high_sum": float((rho > cispo_cap)[m].sum()) if cispo_cap is not None
            else float(((rho > 1 + epsilon_high) & (a > 0))[m].sum()),
            "clip_delta_sum": float(((rho > delta) & (a < 0))[m].sum()) if delta > 0 and cispo_cap is None else 0.0,
        }
    return loss, stats
