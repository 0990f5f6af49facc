"""One GRPO step, in the order of the paper's algorithm box (train.py runs the loop around it):

    metrics, batch = train_step(run)   # run: a run/state.Run, built and prepared by run/lifecycle

  1. sample G completions for each of B prompts        collect -> score -> run.sample
  2. score each: the weighted sum of the rewards       run.rewards (rewards.Rewards)
  3. group advantages A_i = (r_i - mean) / std         grpo.group_advantages
  4. per mini-batch, per micro-batch: the log-probs    logprobs.micro_batch_log_probs
     of the sampled tokens, the clipped loss, backward grpo.grpo_loss, loss.backward()
  5. the optimizer step: clip, AdamW, schedule         optimizer_step
  6. the step's metrics                                step_metrics

What depends only on the run is prepared once, before the first step (run/lifecycle.prepare): the
rewards with their functions, arguments and keys, the reply prefix they see, the sampler with its
EOS ids, the loss settings. The speed levers (prompt sharing, the hand-written log-softmax; rollout
compile and merged sampling) are chosen then too (gpu/auto.py) and named on the "chosen for this
machine" line; with them off a step runs the plain code below. On a CPU auto turns prompt sharing
and the hand-written log-softmax on (they pay there: bench/RESULTS.md); `--grpo.share_prompt=false
--grpo.logprob_kernel=false` runs the plain path.

What differs from the paper (GRPO, arXiv 2402.03300; grpo.py lists the loss's own departures):
- the reward is a weighted sum of rules, LLM judges or people's ratings, not a trained reward
  model (graders/reward_model.py offers one);
- one optimizer update per batch by default (grpo.num_iterations 1, num_mini_batches 1), so the
  policy that sampled is the one trained: the ratio is exactly 1 and the clip never acts (the
  paper's inner iterations are grpo.num_iterations > 1);
- the loss of a step is the sum of its micro-batches' shares (grpo.aggregate), so the gradient does
  not depend on how it is cut (except under loss_type bnpo, a per-micro-batch mean by definition);
- the optimizer is AdamW with warmup and a cosine schedule, gradients clipped at max_grad_norm;
  LoRA by default (the reference is the base with the adapter off: no copy);
- a completion cut at max_new_tokens stays in the loss unless grpo.mask_truncated_completions.

Every feature enters the step through one named seam, owned by its module. `lines`: how many lines
of the path files (train.py, step.py, rollout.py, rewards.py, answers.py, grpo.py, logprobs.py,
data.py) name the seam, import lines included; tests/test_layout.py fails above it.
  seam (its names)                     lines  what and where
  run.sample                               1  the sampler chosen at setup: HF generate
                                              (rollout.Sampler), merged or compiled HF
                                              (model.MergedSampler, gpu/auto.py), vLLM
                                              (engines/vllm_engine.py)
  run.sample_and_score                     2  multi-turn episodes (engines/episodes.py), or the
                                              reward overlap: a slice scored while the next one
                                              samples (scoring/pipelined.py)
  run.engine                               2  vLLM: the new weights after the updates
  run.world, distributed                  16  torchrun: counts, gradients and metrics summed over
                                              the processes (parallel/distributed.py); train.py:
                                              rank 0 writes the run's files
  run.resample                             1  DAPO dynamic sampling: draw until B groups carry
                                              signal (scoring/dynamic_sampling.py)
  run.judges, outage                       6  a step its judge mostly failed is not trained on,
                                              a reward that failed on every completion stops the
                                              run; train.py waits for a judge that is down
                                              (scoring/outage.py)
  sampler_weight, tis_metrics, TIS_SUMS    6  importance weights against a sampler that records
                                              its log-probs (vLLM, merged or compiled HF; grpo.py)
  reward_aggregation, advantage_rewards    4  GDPO: each reward normalised in its group before the
                                              sum (rewards.py, grpo.normalize_then_sum)
  top_entropy_quantile, high_entropy_mask  3  only high-entropy tokens in the policy-gradient term
  episodes.episode_metrics                 1  multi-turn episodes' metrics (engines/episodes.py)
  source_metrics                           2  a mixture's per-source metrics (scoring/metrics.py)
  run.scaler, scaled_step                  8  fp16: the GradScaler scales the loss and steps
  entropy_coef_now, control_entropy        4  the entropy bonus (grpo.entropy_coef): the training
                                              entropy (logprobs.log_probs_and_entropy) into the
                                              loss, its adaptive coefficient after each update
  reference, sync_ref_model                3  TR-DPO: the reference moves towards the policy
The step's own flags, each a line here: grpo.num_mini_batches (whole groups shuffled into
mini-batches), num_iterations > 1 and beta > 0 (the old and reference log-probs, taken once),
mask_truncated_completions, delta (its metric), skip_flat_updates (no optimizer step on a zero
gradient: update). The objectives beyond the clip (policy_loss, the KL's bias correction, the
off-policy mask, tis_min) are settings of grpo.LossSettings: no line here.
"""
from __future__ import annotations

import math
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

import grpo
import logprobs
import rollout
from config import Config
from engines import episodes
from model import reference_mode
from parallel import distributed
from rewards import RewardResult, advantage_rewards, join_results, reward_means
from scoring import outage
from scoring.metrics import source_metrics


@dataclass
class Scored:
    """Completions with their rewards; rows i*G .. i*G+G-1 form group i."""
    rollout: rollout.Rollout
    samples: list[dict]  # (n,) the data row behind each completion
    total: torch.Tensor  # (n,) weighted reward; NaN: skipped (fallback: skip)
    per_reward: dict[str, list]  # name -> (n,) values (None: does not apply)
    errors: dict[str, int]  # name -> failures counted


@dataclass
class Batch:
    """What the updates train on: the completions, their advantages and the tokens in the loss."""
    kept: Scored  # the B groups trained on, with their rewards
    advantages: torch.Tensor  # (N,)
    mask: torch.Tensor  # (N, C) the tokens in the loss
    keep: torch.Tensor | None  # (N, C) the tokens in the policy-gradient term (entropy mask)
    minis: list[tuple[list[slice], grpo.LossNorm]]  # mini-batches: micro-batches, normaliser
    old_logp: torch.Tensor | None = None  # (N, C) off-policy only; None: the ratio is exactly 1
    ref_logp: torch.Tensor | None = None  # (N, C) with a KL term (beta > 0) only

    @property
    def mbs(self) -> list[slice]:
        """Every micro-batch, mini-batch after mini-batch."""
        return [mb for part, _ in self.minis for mb in part]


@dataclass
class Updates:
    """What a step's optimizer updates add up to, for its metrics."""
    sums: dict  # the loss terms' sums over the updates whose loss was finite
    tis: dict  # a sampler's log-probs: the importance weights' sums (first iteration)
    grad_norms: list[float] = field(default_factory=list)  # one per update
    applied: int = 0  # updates whose loss was finite
    empty: int = 0  # updates with no token in their loss, so no optimizer step (empty_updates)
    flat: int = 0  # grpo.skip_flat_updates: updates whose every A was 0, not made (flat_updates)
    lr: float = 0.0


def train_step(run) -> tuple[dict, Batch]:
    """One rollout batch and its updates -> (metrics, the batch trained on: train.py shows some)."""
    G, t0 = run.cfg.rollout.num_generations, time.time()
    run.phase = "sampling"
    kept, drawn = collect(run)  # 1-2. B prompts x G completions, scored
    run.phase, t_rollout = "training", time.time() - t0
    if run.cfg.grpo.num_mini_batches > 1:  # no mini-batch of flat groups alone (resampling: last)
        kept = shuffle_groups(kept, G)
    batch = make_batch(run, kept)  # 3. advantages, the loss mask, the mini-batches
    # a step its judges mostly failed is not trained on; one a reward wholly failed stops the run
    if run.judges or run.world > 1 or any(drawn.errors.values()):
        batch.minis = outage.minis_to_train(run, batch.minis, drawn.errors, len(drawn.samples))
    updates = update(run, batch)  # 4-5. num_iterations passes, an optimizer update per mini-batch
    if run.engine:
        run.phase = "syncing the weights to vLLM"
        run.engine.sync(run.model)  # the next rollout samples from the updated policy
    if run.world > 1:  # 6. metrics over every process's completions
        drawn = distributed.whole_step(run, drawn, updates, concat)
    metrics = step_metrics(run, drawn, batch.kept.rollout, updates) | {
        "learning_rate": updates.lr, "prompts_drawn": len(drawn.samples) // G,
        "rollout_time": t_rollout,
        "rollout_tokens_per_s": float(drawn.rollout.completion_mask.sum()) / max(t_rollout, 1e-9)}
    return metrics, batch


# ---------------------------------------------------------------- 1-2. sample and score


def collect(run) -> tuple[Scored, Scored]:
    """-> (the B groups to train on, everything drawn); B: run.prompts_per_step, under torchrun this
    process's share of rollout.prompts_per_step. run.resample: DAPO dynamic sampling draws more."""
    first = score(run, run.sampler.draw(run.prompts_per_step))
    return run.resample(run, first, score, concat, take_group) if run.resample else (first, first)


def score(run, idx: list[int]) -> Scored:
    """G completions for each of the rows `idx` and their rewards:
    total_i = sum_k weight_k * r_k(completion_i, row_i)."""
    rows = [run.rows[i] for i in idx]
    samples = [row for row in rows for _ in range(run.cfg.rollout.num_generations)]
    if run.sample_and_score:  # multi-turn episodes, or rewards scored while the next slice samples
        return scored(*run.sample_and_score(rows, samples), samples)
    batch = run.sample(rollout.render_rows(run.tokenizer, rows, run.cfg.data))
    return scored(batch, run.rewards(batch.texts, samples, num_tokens=batch.num_tokens()), samples)


def scored(batch: rollout.Rollout, res: RewardResult, samples: list[dict]) -> Scored:
    return Scored(batch, samples, torch.tensor(res.total).float(), res.per_reward, res.errors)


def concat(parts: list[Scored], pad_id: int) -> Scored:
    if len(parts) == 1:
        return parts[0]
    res = join_results([RewardResult(p.total.tolist(), p.per_reward, p.errors) for p in parts])
    return scored(rollout.concat_rollouts([p.rollout for p in parts], pad_id), res,
                  [s for p in parts for s in p.samples])


def take_rows(p: Scored, rows: list[int]) -> Scored:
    """The completions `rows` of p, in that order (their reward failures are not carried)."""
    return Scored(rollout.select_rows(p.rollout, rows), [p.samples[i] for i in rows], p.total[rows],
                  {k: [v[i] for i in rows] for k, v in p.per_reward.items()}, {})


def take_group(p: Scored, group: int, G: int) -> Scored:
    return take_rows(p, list(range(group * G, (group + 1) * G)))


def shuffle_groups(p: Scored, G: int) -> Scored:
    """p's groups in a random order (torch's generator), each group's rows kept together."""
    order = torch.randperm(len(p.samples) // G).tolist()
    return take_rows(p, [grp * G + j for grp in order for j in range(G)])


# ---------------------------------------------------------------- 3. advantages and the loss mask


def make_batch(run, kept: Scored) -> Batch:
    """The advantages, the tokens in the loss, the mini-batches, and the log-probs of the policy
    before any update (off-policy) and of the reference (beta > 0), each taken once."""
    g, G, ro = run.cfg.grpo, run.cfg.rollout.num_generations, kept.rollout
    signal = kept.total if g.reward_aggregation == "sum" else advantage_rewards(  # (N,) GDPO
        kept.total, kept.per_reward, run.cfg.rewards, g, G)
    adv = grpo.group_advantages(signal, G, g.scale_rewards, zero_std_tol=g.zero_std_tol)  # (N,)
    mask = loss_mask(run, ro, kept.total)  # (N, C)
    keep = grpo.high_entropy_mask(ro.entropy, mask, g.top_entropy_quantile) \
        if g.top_entropy_quantile < 1 else None  # (N, C)
    minis = mini_batches(run.cfg, ro, mask, kept.total, adv)
    if run.world > 1:  # the normalisers count every process's tokens
        minis = distributed.sum_norms(minis)
    batch = Batch(kept, adv.to(ro.completion_ids.device), mask, keep, minis)
    if g.num_iterations > 1 or g.num_mini_batches > 1:  # else the ratio is exactly 1
        batch.old_logp = logprobs.batch_log_probs(run.model, ro, run.cfg, batch.mbs)  # (N, C)
    if g.beta > 0:  # the reference (TR-DPO's, grpo.sync_ref_model: moved towards the policy)
        with reference_mode(run.model, reference(run)) as ref:
            batch.ref_logp = logprobs.batch_log_probs(ref, ro, run.cfg, batch.mbs)  # (N, C)
    return batch


@torch.no_grad()
def reference(run) -> torch.nn.Module | None:
    """The step's reference copy (full fine-tuning; None with LoRA: the base, adapter off). With
    grpo.sync_ref_model (TR-DPO, arXiv 2404.09656; TRL's sync_ref_model), after every
    ref_model_sync_steps steps it moves towards the policy, weight by weight,

        pi_ref <- alpha pi_theta + (1 - alpha) pi_ref        (alpha: ref_model_mixup_alpha)

    so the KL term holds the policy near where it was lately, not where it began. The sync after
    step k runs here, as step k + 1 takes its reference log-probs (a checkpoint keeps the moved
    reference: run/checkpoint.py). TRL counts optimizer updates, this counts steps: the same at one
    update a step (the default)."""
    ref, g = run.ref_copy, run.cfg.grpo
    if not g.sync_ref_model or getattr(ref, "minigrpo_step", None) == run.step:
        return ref
    if run.step > 1 and (run.step - 1) % g.ref_model_sync_steps == 0:
        for r, p in zip(ref.parameters(), run.model.parameters(), strict=True):
            r.mul_(1 - g.ref_model_mixup_alpha).add_(p, alpha=g.ref_model_mixup_alpha)
    ref.minigrpo_step = run.step  # synced (or restored) for this step
    return ref


def loss_mask(run, batch: rollout.Rollout, total: torch.Tensor) -> torch.Tensor:
    """(N, C): each completion's tokens up to its EOS, less those whose reward was skipped (NaN)
    or, with grpo.mask_truncated_completions, that never ended."""
    mask = batch.completion_mask.clone()  # (N, C)
    if run.cfg.grpo.mask_truncated_completions:
        mask[batch.truncated] = 0
        warn_all_truncated(run, batch)
    mask[torch.isnan(total)] = 0
    return mask


def warn_all_truncated(run, batch: rollout.Rollout) -> None:
    """Once a run: every completion was cut, so mask_truncated_completions trains on nothing."""
    if bool(batch.truncated.all()) and not run.warned_all_truncated:
        run.warned_all_truncated = True
        print(f"[minigrpo] warning: every completion hit rollout.max_new_tokens="
              f"{run.cfg.rollout.max_new_tokens} and grpo.mask_truncated_completions masks "
              "them all out: this step trains nothing. Raise max_new_tokens (or set "
              "mask_truncated_completions: false).", file=sys.stderr)


def mini_batches(cfg: Config, batch: rollout.Rollout, mask, total,
                 adv) -> list[tuple[list[slice], grpo.LossNorm]]:
    """grpo.num_mini_batches mini-batches of whole groups, each its micro-batches and the counts its
    loss is divided by: unskipped sequences (truncated ones count, as in TRL), mask tokens; and
    those with a token in the loss and A != 0 (none: a flat update)."""
    N, k, skipped = batch.completion_ids.shape[0], cfg.grpo.num_mini_batches, torch.isnan(total)
    minis = []
    for rows in (slice(lo, lo + N // k) for lo in range(0, N, N // k)):
        mbs = [slice(rows.start + m.start, rows.start + m.stop) for m in logprobs.micro_batches(
            rollout.select_rows(batch, list(range(N))[rows]), cfg.optim.micro_batch_size,
            cfg.optim.micro_batch_tokens)]  # rows of the batch, whole groups a mini-batch
        minis.append((mbs, grpo.LossNorm(  # micro-batches that hold a scored completion: bnpo's M
            cfg.grpo.loss_type, int((~skipped[rows]).sum()), int(mask[rows].sum()),
            cfg.rollout.max_new_tokens, sum(bool((~skipped[mb]).any()) for mb in mbs),
            int(((adv[rows].to(mask.device) != 0) & mask[rows].any(1)).sum()))))
    return minis


# ---------------------------------------------------------------- 4-5. the updates


LOSS_TERMS = ("loss", "tokens", "kl_sum", "ratio_sum", "clip_low_sum", "clip_high_sum",
              "clip_delta_sum")


def update(run, batch: Batch) -> Updates:
    """num_iterations passes over the batch, each an optimizer update per mini-batch, whose loss is
    the sum of its micro-batches' shares."""
    out = Updates(Counter(dict.fromkeys(LOSS_TERMS, 0.0)), dict.fromkeys(grpo.TIS_SUMS, 0.0))
    run.model.train()
    for it in range(run.cfg.grpo.num_iterations):
        for mbs, norm in batch.minis:
            run.optimizer.zero_grad(set_to_none=True)
            sums = Counter(dict.fromkeys(LOSS_TERMS, 0.0))  # this update's; update() adds
            for mb in mbs:  # the first pass adds up the importance weights (out.tis)
                sums.update(backward(run, batch, mb, norm, out.tis if it == 0 else None)[0])
            made = norm.num_tokens and (norm.num_signal or run.loss.beta > 0  # else the gradient
                                        or not run.cfg.grpo.skip_flat_updates)  # is 0: loss.md
            grad_norm, out.lr = optimizer_step(run) if made else empty_update(run, out, norm)
            if run.loss.adaptive_entropy:  # the entropy bonus's coefficient for the next update
                grpo.control_entropy(run.loss, run.optimizer.param_groups[0], sums)
            out.grad_norms.append(grad_norm)
            if all(math.isfinite(v) for v in sums.values()):  # into the step's sums
                out.applied += 1
                out.sums.update(sums)
    return out


def backward(run, batch: Batch, mb: slice, norm: grpo.LossNorm, tis: dict | None) -> tuple:
    """Micro-batch mb's share of its update's loss, backward -> (its terms' sums and the loss, the
    log-probs (n, C), the importance weight (n, C) or None: tools/explain.py shows them)."""
    s, ro = run.loss, batch.kept.rollout  # ent: the training entropy, for the entropy bonus only
    logp, C, *ent = logprobs.micro_batch_log_probs(run.model, ro, ro.input_ids, ro.attention_mask,
                                                   mb, run.cfg, entropy=s.entropy_bonus)  # (n, C)
    old = None if batch.old_logp is None else batch.old_logp[mb, :C]  # None: on-policy
    weight = None if ro.sampler_logp is None else grpo.sampler_weight(
        logp.detach() if old is None else old, ro.sampler_logp[mb, :C], batch.mask[mb, :C],
        s.tis_cap, tis, s.tis_mode, s.tis_min)  # (n, C) pi_old / pi_sampler
    loss, stats = grpo.grpo_loss(
        logp, old_logp=old, adv=batch.advantages[mb], mask=batch.mask[mb, :C], norm=norm, s=s,
        is_weight=weight, ref_logp=None if batch.ref_logp is None else batch.ref_logp[mb, :C],
        keep=None if batch.keep is None else batch.keep[mb, :C], entropy=(ent[0], (
            grpo.entropy_coef_now(s, run.optimizer.param_groups[0]))) if ent else None)
    (run.scaler.scale(loss) if run.scaler else loss).backward()
    return stats | {"loss": float(loss.detach())}, logp.detach(), weight


def optimizer_step(run) -> tuple[float, float]:
    """Clip, step the optimizer and schedule of `run` -> (grad norm, lr). A non-finite gradient
    skips the update (the schedule still advances): one AdamW step on it would write NaN into every
    trained weight for the rest of the run. Under torchrun the gradients are first summed over the
    processes (each loss is its share of the global one); fp16's GradScaler steps in scaled_step.
    Every mode's update ends here (modes/sft.py, modes/dpo.py)."""
    if getattr(run, "world", 1) > 1:
        distributed.sum_gradients(run.params)
    if run.scaler:  # fp16
        return scaled_step(run)
    grad_norm, lr = clip_gradients(run), run.scheduler.get_last_lr()[0]
    if math.isfinite(grad_norm):
        run.optimizer.step()
        run.scheduler.step()
        return grad_norm, lr
    print(f"[minigrpo] warning: the gradient norm is {grad_norm}; this update is skipped",
          file=sys.stderr)
    skip_schedule_step(run)
    return grad_norm, lr


def empty_update(run, out: Updates, norm: grpo.LossNorm) -> tuple[float, float]:
    """An update not made (no token in its loss, or all flat with grpo.skip_flat_updates: a zero
    gradient, on which AdamW's momentum and decay would still move the weights): the schedule
    advances (a resume counts it) -> (0, lr). Under torchrun all processes decide alike."""
    out.empty, out.flat = out.empty + (not norm.num_tokens), out.flat + bool(norm.num_tokens)
    lr = run.scheduler.get_last_lr()[0]
    skip_schedule_step(run)
    return 0.0, lr


def clip_gradients(run) -> float:
    """The gradients' norm, clipped to optim.max_grad_norm (0: not clipped)."""
    return float(torch.nn.utils.clip_grad_norm_(run.params,
                                                run.cfg.optim.max_grad_norm or float("inf")))


def skip_schedule_step(run) -> None:
    """The schedule advances over a skipped update: torch warns that no optimizer.step came first
    (LambdaLR reads only the count); only here, as catch_warnings resets which warnings were shown:
    others would repeat."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        run.scheduler.step()


def scaled_step(run) -> tuple[float, float]:
    """fp16: GradScaler unscales, clips and steps (it skips non-finite gradients itself, and lowers
    the loss scale) -> (grad norm, lr)."""
    run.scaler.unscale_(run.optimizer)
    grad_norm, lr = clip_gradients(run), run.scheduler.get_last_lr()[0]
    run.scaler.step(run.optimizer)
    run.scaler.update()
    # halved 17 times from 65536: not a scale still to find, a pass that overflows
    if run.scaler.get_scale() < 1.0:
        raise rollout.NonFiniteLogits("float16 loss scaling has halved its scale below 1, "
                                      "skipping update after update: the training pass gives "
                                      "inf or NaN; " + rollout.NON_FINITE)
    if math.isfinite(grad_norm):
        run.scheduler.step()
    else:
        skip_schedule_step(run)
    return grad_norm, lr


def lr_lambda(cfg: Config, total_updates: int):
    """Linear warmup for warmup_steps updates (or warmup_ratio x total_updates), then cosine from lr
    down to lr * min_lr_ratio."""
    w = cfg.optim.warmup_steps or math.ceil(cfg.optim.warmup_ratio * total_updates)  # TRL's
    floor = cfg.optim.min_lr_ratio

    def f(u: int) -> float:
        if u < w:
            return (u + 1) / (w + 1)
        progress = min(1.0, (u - w) / max(1, total_updates - w))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


# ---------------------------------------------------------------- 6. metrics


def step_metrics(run, drawn: Scored, trained: rollout.Rollout, updates: Updates) -> dict:
    """Rewards over every completion drawn (what the policy produced); loss terms over the trained
    tokens of the updates whose loss was finite, loss their mean. reward_std is the mean of the
    groups' stds, as in TRL; entropy the mean over the drawn completions' tokens of their sampling
    distributions' entropy (HF generate only); kl only with a reference (beta > 0, as TRL)."""
    G, sums, total, ro = run.cfg.rollout.num_generations, updates.sums, drawn.total, drawn.rollout
    tok, n_tokens = max(sums["tokens"], 1.0), ro.completion_mask.sum(1)
    scored = total[~torch.isnan(total)]  # NaN: skipped (fallback: skip)
    _, std, n = grpo.group_stats(total, G)  # (B,) each
    zero_std = grpo.zero_std_groups(total, G, run.cfg.grpo.zero_std_tol)
    out = {**({"loss": sums["loss"] / updates.applied} if updates.applied else {}),
           **({"reward": float(scored.mean())} if len(scored) else {}),  # none scored: no value
           "reward_std": float(std[n >= 2].mean()) if (n >= 2).any() else 0.0,
           "frac_reward_skipped": 1 - len(scored) / len(total),
           **{f"rewards/{k}/mean": v for k, v in reward_means(drawn.per_reward).items()},
           **{f"reward_errors/{k}": v for k, v in drawn.errors.items()},
           "frac_reward_zero_std": float(zero_std.float().mean())}
    if run.cfg.grpo.beta > 0 and sums["tokens"]:
        out["kl"] = sums["kl_sum"] / tok
    if sums["tokens"]:  # none without a trained token
        out |= {"ratio_mean": sums["ratio_sum"] / tok,
                "clip_ratio/low_mean": sums["clip_low_sum"] / tok,
                "clip_ratio/high_mean": sums["clip_high_sum"] / tok,
                "clip_ratio/region_mean": (sums["clip_low_sum"] + sums["clip_high_sum"]) / tok}
    out |= {"completions/mean_length": float(n_tokens.float().mean()),
            "completions/max_length": int(n_tokens.max()),
            "completions/clipped_ratio": float(ro.truncated.float().mean()),
            **({} if ro.entropy is None else {"entropy": float(  # HF generate's
                (ro.entropy * ro.completion_mask).sum() / n_tokens.sum().clamp(min=1))}),
            **grad_norm_metrics(updates.grad_norms),
            **(grpo.entropy_metrics(sums) if sums.get("entropy_tokens") else {}),
            **({"empty_updates": updates.empty} if updates.empty else {}),
            **({"clip_ratio/delta_mean": sums["clip_delta_sum"] / tok}  # A < 0 past delta
               if run.cfg.grpo.delta else {}),
            **({"flat_updates": updates.flat} if updates.flat else {})}
    if len(run.source_labels) > 1:  # a mixture: each source's share and reward
        out |= source_metrics(run, drawn)
    if trained.episodes:  # the trained batch's (resampling: not all drawn)
        out |= episodes.episode_metrics(trained.episodes)
    if trained.sampler_logp is not None:
        out |= grpo.tis_metrics(updates.tis, run.cfg.grpo.tis_cap)
    return out


def grad_norm_metrics(norms: list[float]) -> dict:
    """grad_norm: the mean over the step's applied updates; skipped_updates: how many had a
    non-finite gradient (fp16's GradScaler skips those as it finds its scale; see optimizer_step),
    only when some did. A step with no update applied logs no grad_norm (JSON has no inf or NaN).

    >>> grad_norm_metrics([1.0, 3.0]), grad_norm_metrics([2.0, float("inf")])
    ({'grad_norm': 2.0}, {'grad_norm': 2.0, 'skipped_updates': 1})
    """
    applied = [n for n in norms if math.isfinite(n)]
    skipped = len(norms) - len(applied)
    return (({"grad_norm": sum(applied) / len(applied)} if applied else {})
            | ({"skipped_updates": skipped} if skipped else {}))
