"""GRPO: the math, as pure tensor functions of rewards and log-probs (no model in sight).

    rewards = normalize_then_sum(per_reward, weights, G)  # (N,) GDPO; else the weighted sum
    adv  = group_advantages(rewards, G)                                  # (N,)
    mask, truncated = completion_mask(completion_ids, eos_ids)           # (N, C), (N,)
    s = LossSettings.of(cfg.grpo)                                        # epsilons, beta, variants
    loss, stats = grpo_loss(logp, old_logp, ref_logp, adv, mask, norm, s)  # scalar, dict of sums

The log-probs come from logprobs.py (sequence_log_probs), the completions from rollout.py.
Shapes: N = B prompts x G completions, C = completion length.
Departures from the paper (arXiv 2402.03300), all switchable in the config:
- the clip has separate lower and upper bounds (DAPO clip-higher, `epsilon_high`);
- the loss normalisation is a named choice (`loss_type`), default DAPO's global token mean;
- no KL term unless `beta > 0` (TRL's default; when on, it is the paper's k3 estimator);
- the ratio can be one per completion instead of one per token (GSPO, `importance_sampling_level`);
- the policy-gradient term can be limited to high-entropy tokens (`top_entropy_quantile`);
- negative-advantage ratios can be capped too (INTELLECT-2's two-sided clip, `delta`), or the
  clipped objective swapped for CISPO's clipped, detached importance weight (`policy_loss: cispo`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# ----------------------------------------------------------------------------- the math

EPS = 1e-4  # keeps a group whose rewards barely differ from dividing by ~0


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group",
                     zero_std_tol: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean_g(r)) / (std + EPS), groups of `group_size` consecutive rewards.

    scale: "group" -> std of the group; "batch" -> std of all rewards; "none" -> no division
    (Dr. GRPO, arXiv 2503.20783: dividing by the group std up-weights too easy / too hard prompts).
    std is the unbiased sample std, as in TRL. A group whose rewards are equal (within
    zero_std_tol) gets exactly 0: rounding in the mean would otherwise leave ~1e-7 / EPS.
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
        centered = centered / (std[:, None] + EPS)
    elif scale == "batch":
        kept = rewards[~torch.isnan(rewards)]  # (<= N,)
        centered = centered / ((kept.std() if kept.numel() > 1 else 0.0) + EPS)
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
    """(B,) bool: groups whose rewards are all equal (up to `tol`: judge scores are noisy floats);
    NaN rewards (skipped) are left out, and a group with none left counts as equal."""
    r = rewards.view(-1, group_size)  # (B, G)
    valid = ~torch.isnan(r)
    high = torch.where(valid, r, -torch.inf).max(dim=1).values  # (B,)
    low = torch.where(valid, r, torch.inf).min(dim=1).values  # (B,)
    return (high - low) <= tol


def normalize_then_sum(rewards: Tensor, weights: Tensor, group_size: int,
                       zero_std_tol: float = 1e-6) -> Tensor:
    """GDPO's aggregation (arXiv 2601.05242; TRL's multi_objective_aggregation): each reward is
    normalised within its group before the weighted sum, so a reward with a wide spread does not
    drown one with a narrow spread, and distinct combinations keep distinct values:

        s_i = sum_k w_k (r_ik - mean_g(r_k)) / (std_g(r_k) + EPS)

    mean_g, std_g (unbiased) over the group's non-NaN values of reward k; a NaN r_ik (no value:
    the reward does not apply, or was skipped) adds 0, and a reward whose values in a group are
    equal within zero_std_tol (or fewer than 2) adds 0 to that group. group_advantages then
    takes the advantages of s as of any reward (GDPO normalises the sum over the batch).
    rewards: (N, K) with NaN for no value; weights: (K,). Returns (N,).
    """
    N, K = rewards.shape
    r = rewards.T.reshape(K * N // group_size, group_size)  # (K*B, G): reward k's groups in turn
    mean, std, _ = group_stats(r.reshape(-1), group_size)  # (K*B,) each
    flat = zero_std_groups(r.reshape(-1), group_size, zero_std_tol)  # (K*B,)
    z = (r - mean[:, None]) / (std[:, None] + EPS)  # (K*B, G)
    z = torch.where(torch.isnan(r) | flat[:, None], 0.0, z)  # (K*B, G)
    return (z.reshape(K, N) * weights[:, None].to(z)).sum(0)  # (N,)


def completion_mask(completion_ids: Tensor, eos_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask by position: 1 for every token up to and including the first EOS, 0 after.

    Masking by `token != pad` is wrong when pad == eos: it drops the real EOS, so the model
    never learns to stop. Returns (mask (N, C) float, truncated (N,) bool: no EOS at all).
    """
    is_eos = torch.isin(completion_ids, completion_ids.new_tensor(eos_ids))  # (N, C)
    has_eos = is_eos.any(dim=1)  # (N,)
    C = completion_ids.shape[1]
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), C)  # (N,)
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


@dataclass(frozen=True)
class LossSettings:
    """The loss's settings, built from the config by LossSettings.of(cfg.grpo); the defaults are
    PPO's symmetric clip (the config's are DAPO's clip-higher, epsilon_high: 0.28)."""
    epsilon: float = 0.2  # lower clip: rho >= 1 - epsilon
    epsilon_high: float = 0.2  # upper clip: rho <= 1 + epsilon_high
    beta: float = 0.0  # weight of the KL term (0: none, and no reference pass)
    delta: float = 0.0  # two-sided clip: with A < 0, rho is capped at delta too (0: off)
    cispo_cap: float | None = None  # CISPO: a detached min(rho, cap) weight instead of the clip
    sequence: bool = False  # GSPO: one ratio per completion instead of one per token
    tis_cap: float = 0.0  # weights against a sampler's log-probs (sampler_weight); 0: off
    tis_mode: str = "token_truncate"  # one of TIS_MODES

    @classmethod
    def of(cls, g) -> LossSettings:
        """From the config's grpo section (config.GrpoConfig)."""
        return cls(g.epsilon, g.epsilon_high, g.beta, g.delta,
                   g.cispo_cap if g.policy_loss == "cispo" else None,
                   g.importance_sampling_level == "sequence", g.tis_cap, g.tis_mode)


def per_token_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor,
                   mask: Tensor, s: LossSettings, is_weight: Tensor | None = None,
                   keep: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """l_t = -k_t w_t min(rho_t A, clip(rho_t, 1 - eps, 1 + eps_high) A) + beta KL_t,
    rho_t = exp(logp_t - old_logp_t), KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (k3, >= 0).

    Variants (docs/loss.md says when each helps):
      delta > 0        rho_t A -> min(rho_t, delta) A                   (INTELLECT-2 two-sided clip)
      cispo_cap        l_t = -k_t w_t sg(min(rho_t, cap)) A logp_t + beta KL_t            (CISPO)
      sequence         rho_i = exp(mean over completion i's mask of log rho_t), every token (GSPO)
    w_t: the detached importance weight of the sampler (sampler_weight, below), else 1;
    k_t: 0/1 from `keep` (high_entropy_mask), else 1: a dropped token keeps its KL term.
    With old_logp = logp.detach() (on-policy) rho is 1 in value but still carries d logp: the loss
    value is about -mean(A) + beta KL while the policy learns, so a loss near 0 is normal.
    logp, old_logp, ref_logp, mask: (N, C); adv: (N,). Returns (loss, rho, kl), each (N, C).
    """
    log_rho = logp - old_logp  # (N, C)
    if s.sequence:  # a NaN at a masked position stays out of the mean
        kept = torch.where(mask.bool(), log_rho, 0.0)
        log_rho = (kept.sum(1) / mask.sum(1).clamp(min=1))[:, None].expand_as(logp)
    rho = torch.exp(log_rho)  # (N, C)
    a = adv[:, None]  # (N, 1)
    if s.cispo_cap is not None:
        loss = -torch.clamp(rho, max=s.cispo_cap).detach() * a * logp  # (N, C)
    else:
        unclipped = torch.clamp(rho, max=s.delta) if s.delta > 0 else rho  # (N, C)
        loss = -torch.minimum(unclipped * a, rho.clamp(1 - s.epsilon, 1 + s.epsilon_high) * a)
    if is_weight is not None:
        loss = loss * is_weight.detach()
    if keep is not None:
        loss = loss * keep
    kl = torch.zeros_like(logp)
    if s.beta > 0:
        d = ref_logp - logp  # (N, C)
        kl = torch.exp(d) - d - 1
        loss = loss + s.beta * kl
    return loss, rho, kl


@dataclass
class LossNorm:
    """What the loss is divided by; counts are for the whole optimizer step, not the micro-batch
    (under torchrun, over every process's share of it)."""
    loss_type: str  # grpo | bnpo | dr_grpo | dapo
    num_sequences: int  # completions in the optimizer step with a reward (skipped ones left out)
    num_tokens: int  # unmasked completion tokens in the optimizer step
    max_completion_length: int  # rollout.max_new_tokens
    num_micro_batches: int  # micro-batches accumulated into the step that hold a scored completion
    num_signal: int = 0  # completions with a token in the loss and A != 0 (not a normaliser:
    #   0 with beta 0 makes the gradient exactly zero: step.update, grpo.skip_flat_updates)


def aggregate(loss_tok: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """Reduce a micro-batch's (n, C) per-token loss so summing micro-batches gives the step loss.

    grpo:    (1/N) sum_i (sum_t m_it l_it / sum_t m_it)      mean per sequence, then over sequences
    bnpo:    (1/M) sum m l / sum m (this micro-batch)         token mean per micro-batch (M of them)
    dr_grpo: sum m l / (N * max_completion_length)            constant normaliser, no length bias
    dapo:    sum m l / (sum of m over the whole step)         global token mean
    N = sequences in the step. Only bnpo depends on how the step is split into micro-batches.
    """
    masked = torch.where(mask.bool(), loss_tok, torch.zeros_like(loss_tok))  # (n, C)
    if norm.loss_type == "dapo":
        return masked.sum() / max(norm.num_tokens, 1)
    if norm.loss_type == "grpo":
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / max(norm.num_sequences, 1)
    if norm.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1) / max(norm.num_micro_batches, 1)
    if norm.loss_type == "dr_grpo":
        return masked.sum() / (max(norm.num_sequences, 1) * norm.max_completion_length)
    raise ValueError(f"unknown loss_type {norm.loss_type!r}")


def grpo_loss(logp: Tensor, old_logp: Tensor | None, ref_logp: Tensor | None, adv: Tensor,
              mask: Tensor, norm: LossNorm, s: LossSettings = LossSettings(),
              is_weight: Tensor | None = None,
              keep: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The micro-batch's share of the step loss, and token sums for the step's metrics.

    old_logp None: on-policy, old_logp = logp.detach(). Outside the mask old_logp and ref_logp
    become logp.detach() (rho = 1, KL = 0): exp(ref - logp) overflowing at a padding token would
    make the gradient 0 * inf = NaN even though the loss masks it. Clip fractions count the tokens
    where the clip acts: rho < 1 - eps with A < 0 (low), rho > 1 + eps_high with A > 0 (high),
    rho > delta with A < 0 (delta); under CISPO rho > cap counts as high. Divide by `tokens`.
    logp, old_logp, ref_logp, mask, keep: (n, C); adv: (n,).
    """
    m, d = mask.bool(), logp.detach()  # (n, C)
    old_logp = d if old_logp is None else torch.where(m, old_logp, d)  # (n, C)
    if ref_logp is not None:
        ref_logp = torch.where(m, ref_logp, d)  # (n, C)
    loss_tok, rho, kl = per_token_loss(logp, old_logp, ref_logp, adv, mask, s, is_weight, keep)
    a = adv[:, None].expand_as(rho)  # (n, C), as loss_tok, rho and kl
    with torch.no_grad():
        high = (rho > 1 + s.epsilon_high) & (a > 0) if s.cispo_cap is None else rho > s.cispo_cap
        low = (rho < 1 - s.epsilon) & (a < 0) & (s.cispo_cap is None)
        past_delta = (rho > s.delta) & (a < 0) & (s.delta > 0 and s.cispo_cap is None)
        stats = {"tokens": float(m.sum()), "ratio_sum": float(rho[m].sum()),
                 "clip_low_sum": float(low[m].sum()), "clip_high_sum": float(high[m].sum()),
                 "clip_delta_sum": float(past_delta[m].sum()), "kl_sum": float(kl[m].sum())}
    return aggregate(loss_tok, mask, norm), stats


# ------------------------------------------- importance weights: a sampler that records log-probs
# vLLM, or HF generate merged or compiled, samples from a slightly different distribution than the
# trainer's forward computes; with grpo.tis_cap each token's term is weighted by pi_old / pi_sampler
# (truncated importance sampling, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
# Off-Policy RL Training").

TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # as in TRL


def sampler_weight(old: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float,
                   sums: dict | None, mode: str = "token_truncate") -> Tensor | None:
    """Importance weight of the trainer's policy against the sampler's (None when cap is 0: off),
    old, sampler_logp, mask (n, C) -> (n, C), the ratio rho = pi_old / pi_sampler taken per token
    (token_*) or per completion, the product over its tokens (sequence_*, same for each of them):

        *_truncate   min(rho, cap)                 TIS: a large ratio counts as cap
        *_mask       rho where rho <= cap, else 0  MIS: tokens (completions) past cap leave the loss

    `sums` given (the first iteration, for the step's metrics): adds to it "tokens" and "abs_diff"
    (the masked tokens' |log pi_old - log pi_sampler|) and, with a cap, "units" (tokens, or in
    sequence modes completions, as TRL counts them), "weight" (their weights) and "capped" (those
    capped or masked)."""
    if mode not in TIS_MODES:
        raise ValueError(f"grpo.tis_mode must be one of {', '.join(TIS_MODES)}, got {mode!r}")
    # (n, C) a log-prob the sampler did not give: ratio 1, as TRL
    diff = torch.nan_to_num(old - sampler_logp, nan=0.0)
    weight = None
    if cap:
        log_rho = torch.where(mask.bool(), diff, 0.0)  # (n, C) padding leaves the product alone
        if mode.startswith("sequence"):
            log_rho = log_rho.sum(1, keepdim=True).expand_as(diff)  # (n, C) one per completion
        rho = torch.exp(log_rho)
        weight = (torch.clamp(rho, max=cap) if mode.endswith("truncate")
                  else torch.where(rho > cap, 0.0, rho))
        past = rho >= cap if mode.endswith("truncate") else rho > cap  # (n, C)
    if sums is not None:
        m = mask.bool()
        sums["tokens"] += float(m.sum())
        sums["abs_diff"] += float(diff.abs()[m].sum())
        if weight is not None:
            rows = m.any(1)  # (n,) completions with a token in the loss
            per_row = mode.startswith("sequence")
            sums["units"] += float(rows.sum()) if per_row else float(m.sum())
            sums["weight"] += float(weight[rows, 0].sum()) if per_row else float(weight[m].sum())
            sums["capped"] += float(past[rows, 0].sum()) if per_row else float(past[m].sum())
    return weight


TIS_SUMS = ("tokens", "abs_diff", "units", "weight", "capped")  # what sampler_weight adds up


def tis_metrics(sums: dict, cap: float) -> dict:
    """sampler_logp_abs_diff: the sampler's mean distance to the trainer's log-probs; with a cap,
    tis/*: the mean importance weight and the share capped (or masked)."""
    out = {"sampler_logp_abs_diff": sums["abs_diff"] / max(sums["tokens"], 1.0)}
    if cap:
        units = max(sums["units"], 1.0)
        out |= {"tis/weight_mean": sums["weight"] / units,
                "tis/capped_frac": sums["capped"] / units}
    return out
