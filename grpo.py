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
- no KL term unless `beta > 0` (TRL's default); when on, the paper's k3 estimator times the ratio
  (`use_bias_correction_kl`, TRL's default: its gradient is then that of the KL it estimates), and
  the reference can move towards the policy (TR-DPO, `sync_ref_model`, in step.reference);
- the ratio can be one per completion instead of one per token (GSPO, `importance_sampling_level`),
  each completion's terms summed instead of averaged (LUSPO, `loss_type: luspo`);
- the policy-gradient term can be limited to high-entropy tokens (`top_entropy_quantile`), and
  stale negative completions dropped from it (DeepSeek-V3.2, `off_policy_mask_threshold`);
- negative-advantage ratios can be capped too (INTELLECT-2's two-sided clip, `delta`), or the
  clipped objective swapped for another (`policy_loss`, OBJECTIVES): CISPO's capped, detached
  importance weight, SAPO's soft gate, VESPO's Gamma weight of the completion's ratio, prime-rl's
  DPPO + KL (a trust region on the change in probability);
- an entropy bonus (`entropy_coef`), its coefficient held by Skywork-OR1's adaptive control.
Each is TRL 1.16's formula where TRL has it (bench/trl_objectives: 1110 of 1110 cases agree).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    PPO's symmetric clip (the config's are DAPO's clip-higher, epsilon_high: 0.28). At most one of
    cispo_cap, sapo, vespo, dppo is set: the objective that replaces the clip (`objective`)."""
    epsilon: float = 0.2  # lower clip: rho >= 1 - epsilon
    epsilon_high: float = 0.2  # upper clip: rho <= 1 + epsilon_high
    beta: float = 0.0  # weight of the KL term (0: none, and no reference pass)
    delta: float = 0.0  # two-sided clip: with A < 0, rho is capped at delta too (0: off)
    cispo_cap: float | None = None  # CISPO: a detached min(rho, cap) weight instead of the clip
    sequence: bool = False  # GSPO: one ratio per completion instead of one per token
    tis_cap: float = 0.0  # weights against a sampler's log-probs (sampler_weight); 0: off
    tis_mode: str = "token_truncate"  # one of TIS_MODES
    sapo: tuple[float, float] | None = None  # SAPO: the gate's temperatures for A > 0, A <= 0
    vespo: tuple[float, float, float, float] | None = None  # VESPO: k, lambda for A >= 0; for A < 0
    dppo: tuple[float, float, float] | None = None  # DPPO + KL: mask_low, mask_high, kl_tau
    kl_bias_correction: bool = True  # the k3 term times the ratio (k3)
    off_policy_mask: float = 0.0  # A < 0 completions this far off-policy leave (off_policy_keep)
    entropy_coef: float = 0.0  # the entropy bonus's weight (entropy_bonus); adaptive: the first
    adaptive_entropy: tuple[float, float, float, float] | None = None  # min, max, delta, target
    tis_min: float = 0.0  # the importance weights' lower bound (sampler_weight); 0: none
    objective: str = field(init=False)  # clip, cispo, sapo, vespo or dppo: per_token_loss's term
    clipped: bool = field(init=False)  # objective == "clip": the clip fractions count
    entropy_bonus: bool = field(init=False)  # the step computes the training entropy (its gradient)

    def __post_init__(self):
        chosen = [k for k in ("cispo_cap", "sapo", "vespo", "dppo") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(f"one objective at a time, got {', '.join(chosen)}")
        object.__setattr__(self, "objective", chosen[0].removesuffix("_cap") if chosen else "clip")
        object.__setattr__(self, "clipped", self.objective == "clip")
        object.__setattr__(self, "entropy_bonus",
                           self.entropy_coef != 0 or self.adaptive_entropy is not None)

    @classmethod
    def of(cls, g) -> LossSettings:
        """From the config's grpo section (config.GrpoConfig)."""
        p = g.policy_loss
        return cls(g.epsilon, g.epsilon_high, g.beta, g.delta,
                   g.cispo_cap if p == "cispo" else None,
                   g.importance_sampling_level == "sequence", g.tis_cap, g.tis_mode,
                   (g.sapo_temperature_pos, g.sapo_temperature_neg) if p == "sapo" else None,
                   (g.vespo_k_pos, g.vespo_lambda_pos, g.vespo_k_neg, g.vespo_lambda_neg)
                   if p == "vespo" else None,
                   (g.dppo_mask_low, g.dppo_mask_high, g.kl_tau) if p == "dppo" else None,
                   g.use_bias_correction_kl, g.off_policy_mask_threshold, g.entropy_coef,
                   (g.entropy_coef_min, g.entropy_coef_max, g.entropy_coef_delta, g.entropy_target)
                   if g.use_adaptive_entropy else None, g.tis_min)


def per_token_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor,
                   mask: Tensor, s: LossSettings, is_weight: Tensor | None = None,
                   keep: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """l_t = -k_t m_i w_t min(rho_t A, clip(rho_t, 1 - eps, 1 + eps_high) A) + beta KL_t (k3),
    rho_t = exp(logp_t - old_logp_t); OBJECTIVES (CISPO, SAPO, VESPO, DPPO) replace the min(...).
    delta caps the unclipped rho for A < 0 (INTELLECT-2); sequence (GSPO): each token takes its
    completion's exp(mean_t log rho_t). w_t: the sampler's weight (VESPO folds it into its own),
    k_t: 0/1 from keep (a dropped token keeps its KL), m_i: off_policy_keep's; 1 when not given.
    On-policy rho is 1 in value but carries d logp: a loss near -mean(A) + beta KL is normal.
    logp, old_logp, ref_logp, mask: (N, C); adv: (N,). Returns (loss, rho, kl), each (N, C).
    """
    log_rho = logp - old_logp  # (N, C)
    if s.sequence:  # a NaN at a masked position stays out of the mean
        kept = torch.where(mask.bool(), log_rho, 0.0)
        log_rho = (kept.sum(1) / mask.sum(1).clamp(min=1))[:, None].expand_as(logp)
    rho, a = torch.exp(log_rho), adv[:, None]  # (N, C), (N, 1)
    if s.objective == "clip":
        unclipped = torch.clamp(rho, max=s.delta) if s.delta > 0 else rho  # (N, C)
        loss = -torch.minimum(unclipped * a, rho.clamp(1 - s.epsilon, 1 + s.epsilon_high) * a)
    else:  # CISPO, SAPO, VESPO or DPPO
        loss = OBJECTIVES[s.objective](logp, old_logp, rho, a, mask, s, is_weight)  # (N, C)
    if s.off_policy_mask:  # stale negative completions leave the policy term
        loss = loss * off_policy_keep(logp, old_logp, adv, mask, s.off_policy_mask)
    if is_weight is not None and s.objective != "vespo":
        loss = loss * is_weight.detach()
    if keep is not None:
        loss = loss * keep
    kl = torch.zeros_like(logp) if s.beta == 0 else k3(ref_logp, logp, rho, s)  # (N, C)
    return (loss if s.beta == 0 else loss + s.beta * kl), rho, kl


def k3(ref_logp: Tensor, logp: Tensor, rho: Tensor, s: LossSettings) -> Tensor:
    """KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (k3, >= 0), times rho_t with
    s.kl_bias_correction (TRL's use_bias_correction_kl, DeepSeek-V3.2, arXiv 2512.02556).

    Over tokens the policy sampled, KL_t's value estimates KL(pi || pi_ref). Its gradient does not:
    d KL_t / d logp_t = 1 - pi_ref / pi, whose mean under pi is the gradient of KL(pi_ref || pi).
    Times the ratio, d (rho_t KL_t) / d logp_t = rho_t (logp_t - ref_t): on-policy (rho = 1) the
    score-function gradient of KL(pi || pi_ref) itself, off-policy its importance-weighted estimate
    from the old policy's samples (docs/loss.md says why that is the default).
    ref_logp, logp, rho: (N, C) -> (N, C)."""
    d = ref_logp - logp  # (N, C)
    kl = torch.exp(d) - d - 1  # (N, C)
    return kl * rho if s.kl_bias_correction else kl


# ------------------------------------------------ the objectives that replace the clipped term
# Each: (logp, old_logp, rho, a, mask, s, is_weight) -> (N, C) per-token policy term; rho as
# per_token_loss made it (per token, or GSPO's per completion), a = A (N, 1).


def cispo(logp, old_logp, rho, a, mask, s, is_weight) -> Tensor:
    """CISPO (MiniMax-M1, arXiv 2506.13585; the ScaleRL recipe): l_t = -sg(min(rho_t, cap)) A
    logp_t. Every token keeps its gradient; the cap only stops its weight growing. On-policy:
    -A logp_t, the clip's gradient."""
    return -torch.clamp(rho, max=s.cispo_cap).detach() * a * logp  # (N, C)


def sapo(logp, old_logp, rho, a, mask, s, is_weight) -> Tensor:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347; TRL's loss_type sapo):

        l_t = -(4 / tau) sigmoid(tau (rho_t - 1)) A,   tau = tau_pos if A > 0 else tau_neg

    A soft gate instead of the clip: d l_t / d logp_t = -4 sigma (1 - sigma) rho_t A, exactly the
    policy gradient -A at rho = 1 (on-policy), fading smoothly as rho leaves 1 instead of being cut
    at 1 +- eps; a larger tau fades faster. The paper's tau_neg > tau_pos damps negative tokens
    sooner (their ratio can grow without bound)."""
    tau = torch.where(a > 0, s.sapo[0], s.sapo[1])  # (N, 1)
    return -torch.sigmoid(tau * (rho - 1)) * 4 / tau * a  # (N, C)


def vespo(logp, old_logp, rho, a, mask, s, is_weight) -> Tensor:
    """VESPO (arXiv 2602.10693; TRL's loss_type vespo): l_t = -sg(phi(w_i)) A logp_t, with a
    smooth Gamma-shaped weight of completion i's whole ratio w_i instead of a clip:

        phi(w) = exp(lambda) w^k exp(-lambda w)    (phi(1) = 1: on-policy, the plain gradient)
        w_i = prod_t rho_t (times the sampler's token weights w_t), its log clamped to [ln 1e-8, 20]

    k, lambda: vespo_k_pos, vespo_lambda_pos for A >= 0, the _neg pair for A < 0. phi peaks at
    w = k / lambda and falls to 0 on both sides, so completions far off-policy, either way, fade.
    The token ratios are taken per token whatever importance_sampling_level says (as TRL)."""
    return -vespo_weight(logp, old_logp, a, mask, s, is_weight) * a * logp  # (N, C)


@torch.no_grad()
def vespo_weight(logp, old_logp, a, mask, s, is_weight) -> Tensor:
    """VESPO's phi(w_i), (N, 1), computed in log space as TRL's get_gamma_weights (its clamps
    included: each log rho_t to [-20, 20], a weight's log to [ln 1e-8, 20])."""
    floor = math.log(1e-8)
    log_w = (torch.clamp(logp - old_logp, -20.0, 20.0) * mask).sum(1, keepdim=True)  # (N, 1)
    if is_weight is not None:  # the sampler's weights, a masked one (0) at the floor
        log_w = log_w + (torch.log(is_weight).clamp(floor, 20.0) * mask).sum(1, keepdim=True)
    log_w = log_w.clamp(floor, 20.0)
    k = torch.where(a >= 0, s.vespo[0], s.vespo[2])  # (N, 1)
    lam = torch.where(a >= 0, s.vespo[1], s.vespo[3]).clamp(min=1e-4)  # (N, 1)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)


def dppo(logp, old_logp, rho, a, mask, s, is_weight) -> Tensor:
    """DPPO + KL, prime-rl's default loss (DPPO-Binary-TV, arXiv 2602.04879, with Kimi K2.5's
    squared-log-ratio term, arXiv 2602.02276; prime-rl's loss.py, default_loss_fn):

        l_t = -(1 - M_t) A rho_t + kl_tau (log rho_t)^2
        M_t = [p_t - p_old_t > mask_high] if A > 0 else [p_t - p_old_t < -mask_low],  p = exp(logp)

    The trust region is on the change in probability, not the ratio: a token leaves the policy
    term once the update moved its probability past mask_high (up, A > 0) or mask_low (down,
    A < 0); the squared log-ratio pulls every token back towards the old policy. On-policy both
    are inert (M = 0, log rho = 0): the plain policy gradient. rho here is per token."""
    log_rho = logp - old_logp  # (N, C)
    with torch.no_grad():
        moved = torch.exp(logp) - torch.exp(old_logp)  # (N, C)
        masked = torch.where(a > 0, moved > s.dppo[1], moved < -s.dppo[0])  # (N, C)
    return -(~masked).to(rho.dtype) * a * rho + s.dppo[2] * log_rho ** 2  # (N, C)


OBJECTIVES = {"cispo": cispo, "sapo": sapo, "vespo": vespo, "dppo": dppo}


@torch.no_grad()
def off_policy_keep(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
                    threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9; TRL's
    off_policy_mask_threshold): a completion with A < 0 whose policy moved too far from the one that
    sampled it leaves the policy term:

        m_i = 0 if A_i < 0 and (1 / |o_i|) sum_t (old_logp_t - logp_t) > threshold, else 1

    The mean is an estimate of KL(pi_old || pi) over the completion's tokens; a NaN old log-prob
    counts as 0. On-policy it is 0, so nothing is masked. Measured against old_logp, the policy
    before the step's updates (TRL: the sampler's log-probs when vLLM gives them).
    logp, old_logp, mask: (N, C); adv: (N,) -> (N, 1) of 0/1."""
    kl = (torch.nan_to_num(old_logp - logp, nan=0.0) * mask).sum(1) / mask.sum(1).clamp(min=1)
    return ((adv >= 0) | (kl <= threshold)).to(logp.dtype)[:, None]  # (N, 1)


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
    luspo:   (1/N) sum m l                                    each completion's sum (LUSPO)
    N = sequences in the step. Only bnpo depends on how the step is split into micro-batches.
    """
    masked = torch.where(mask.bool(), loss_tok, torch.zeros_like(loss_tok))  # (n, C)
    if norm.loss_type == "dapo":
        return masked.sum() / max(norm.num_tokens, 1)
    if norm.loss_type == "grpo":
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / max(norm.num_sequences, 1)
    if norm.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1) / max(norm.num_micro_batches, 1)
    if norm.loss_type in ("dr_grpo", "luspo"):
        per = norm.max_completion_length if norm.loss_type == "dr_grpo" else 1
        return masked.sum() / (max(norm.num_sequences, 1) * per)
    raise ValueError(f"unknown loss_type {norm.loss_type!r}")


def grpo_loss(logp: Tensor, old_logp: Tensor | None, ref_logp: Tensor | None, adv: Tensor,
              mask: Tensor, norm: LossNorm, s: LossSettings = LossSettings(),
              is_weight: Tensor | None = None, keep: Tensor | None = None,
              entropy: tuple[Tensor, float] | None = None) -> tuple[Tensor, dict[str, float]]:
    """The micro-batch's share of the step loss, and token sums for the step's metrics.

    old_logp None: on-policy, old_logp = logp.detach(). Outside the mask old_logp and ref_logp
    become logp.detach() (rho = 1, KL = 0): exp(ref - logp) overflowing at a padding token would
    make the gradient 0 * inf = NaN even though the loss masks it. Clip fractions count the tokens
    where the clip acts (low: rho < 1 - eps, A < 0; high: rho > 1 + eps_high, A > 0, or CISPO's
    cap; delta: rho > delta, A < 0). entropy: ((n, C) entropy, coefficient) for entropy_bonus.
    logp, old_logp, ref_logp, mask, keep: (n, C); adv: (n,)."""
    m, d = mask.bool(), logp.detach()  # (n, C)
    old_logp = d if old_logp is None else torch.where(m, old_logp, d)  # (n, C)
    if ref_logp is not None:
        ref_logp = torch.where(m, ref_logp, d)  # (n, C)
    loss_tok, rho, kl = per_token_loss(logp, old_logp, ref_logp, adv, mask, s, is_weight, keep)
    a = adv[:, None].expand_as(rho)  # (n, C), as loss_tok, rho and kl
    with torch.no_grad():  # under SAPO, VESPO and DPPO nothing clips
        high = ((rho > 1 + s.epsilon_high) & (a > 0) & s.clipped if s.cispo_cap is None
                else rho > s.cispo_cap)
        low = (rho < 1 - s.epsilon) & (a < 0) & s.clipped
        past_delta = (rho > s.delta) & (a < 0) & (s.delta > 0 and s.clipped)
        stats = {"tokens": float(m.sum()), "ratio_sum": float(rho[m].sum()),
                 "clip_low_sum": float(low[m].sum()), "clip_high_sum": float(high[m].sum()),
                 "clip_delta_sum": float(past_delta[m].sum()), "kl_sum": float(kl[m].sum())}
    return aggregate(loss_tok, mask, norm) - (  # entropy_bonus adds its sums to stats
        0.0 if entropy is None else entropy_bonus(*entropy, mask, keep, norm, stats)), stats


# ------------------------------------------- the entropy bonus (TRL's entropy_coef, Skywork-OR1)


def entropy_bonus(entropy: Tensor, coef: float, mask: Tensor, keep: Tensor | None, norm: LossNorm,
                  stats: dict) -> Tensor:
    """coef * H, subtracted from the loss: H = sum_t e_t H_t / sum_t e_t / M, the mean entropy of
    the training forward's tempered distributions over the micro-batch's tokens in the policy term
    (e = the mask, times keep under top_entropy_quantile), divided by M, the step's micro-batches:
    TRL's definition, the same for every loss_type; a token mean of the step when its
    micro-batches hold as many tokens each. It raises the entropy of every position it covers,
    sampled token or not. Adds entropy_sum and entropy_tokens to stats (control_entropy reads them,
    and the step logs their ratio as entropy_bonus/entropy, with entropy_coef).
    entropy, mask, keep: (n, C) -> scalar."""
    e = mask if keep is None else mask * keep  # (n, C)
    h = (entropy * e).sum()
    stats |= {"entropy_sum": float(h.detach()), "entropy_tokens": float(e.sum()),
              "entropy_coef_sum": coef * float(e.sum())}  # the coefficient, weighted by tokens
    return coef * h / e.sum().clamp(min=1) / max(norm.num_micro_batches, 1)


def entropy_metrics(sums: dict) -> dict:
    """The entropy bonus's metrics over a step's sums: entropy_coef, the coefficient applied
    (weighted by tokens), and entropy_bonus/entropy, the training forward's mean entropy."""
    return {"entropy_coef": sums["entropy_coef_sum"] / sums["entropy_tokens"],
            "entropy_bonus/entropy": sums["entropy_sum"] / sums["entropy_tokens"]}


def entropy_coef_now(s: LossSettings, state: dict) -> float:
    """The coefficient the next update applies: s.entropy_coef, or under adaptive control
    (Skywork-OR1, arXiv 2505.22312; TRL's use_adaptive_entropy) the running coefficient in `state`,
    applied only while the last update's entropy was at or below the target (none yet: not).
    `state`: the optimizer's first param group, where control_entropy keeps the controller (a
    checkpoint saves it with the optimizer, so a resumed run goes on from it)."""
    if s.adaptive_entropy is None:
        return s.entropy_coef
    coef = state.setdefault("entropy_coef", s.entropy_coef)
    return coef if state.setdefault("entropy_last", math.inf) <= s.adaptive_entropy[3] else 0.0


def control_entropy(s: LossSettings, state: dict, sums: dict) -> None:
    """After an update, adaptive control (TRL's rule): H = the update's entropy_sum /
    entropy_tokens; coef += delta (up to max) when H <= target, else coef -= delta (down to min).
    An update with no token measures nothing and changes nothing."""
    if s.adaptive_entropy is None or not sums.get("entropy_tokens"):
        return
    low, high, delta, target = s.adaptive_entropy
    h = sums["entropy_sum"] / sums["entropy_tokens"]  # the update's mean entropy
    coef = state.get("entropy_coef", s.entropy_coef)
    state["entropy_coef"] = min(coef + delta, high) if h <= target else max(coef - delta, low)
    state["entropy_last"] = h


# ------------------------------------------- importance weights: a sampler that records log-probs
# vLLM, or HF generate merged or compiled, samples from a slightly different distribution than the
# trainer's forward computes; with grpo.tis_cap each token's term is weighted by pi_old / pi_sampler
# (truncated importance sampling, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
# Off-Policy RL Training").

TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # as in TRL


def sampler_weight(old: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float,
                   sums: dict | None, mode: str = "token_truncate",
                   floor: float = 0.0) -> Tensor | None:
    """Importance weight of the trainer's policy against the sampler's (None when cap is 0: off),
    old, sampler_logp, mask (n, C) -> (n, C), the ratio rho = pi_old / pi_sampler taken per token
    (token_*) or per completion, the product over its tokens (sequence_*, same for each of them):

        *_truncate   clip(rho, floor, cap)         TIS: a ratio outside counts as the bound
        *_mask       rho in [floor, cap], else 0   MIS: tokens (completions) outside leave the loss

    floor: grpo.tis_min (TRL's vllm_importance_sampling_clip_min), 0 for none.
    `sums` given (the first iteration, for the step's metrics): adds to it "tokens" and "abs_diff"
    (the masked tokens' |log pi_old - log pi_sampler|) and, with a cap, "units" (tokens, or in
    sequence modes completions, as TRL counts them), "weight" (their weights) and "capped" (those
    capped, floored or masked)."""
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
        weight = (torch.clamp(rho, min=floor, max=cap) if mode.endswith("truncate")
                  else torch.where((rho > cap) | (rho < floor), 0.0, rho))
        past = (rho >= cap if mode.endswith("truncate") else rho > cap) | (rho < floor)  # (n, C)
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
