"""One GRPO step, as the algorithm box reads: sample, score, advantages, old and reference
log-probs, clipped-surrogate updates, metrics (train_step). train.py runs the loop around it; the
math is grpo.py, the sampling rollout.py, the log-probs logprobs.py.

    metrics, shown = train_step(run)      # run: a Run (below), built by train.setup

What a first read can skip is named and kept elsewhere: micro-batching and the optimizer update
(plumbing/updates.py), the metrics (scoring/metrics.py), running the rewards (scoring/batch.py),
vLLM's importance weights (engines/vllm_engine.py). The loss of a step is the sum of its
micro-batches' shares (grpo.aggregate), so the gradient does not depend on how it is split (except
under loss_type: bnpo, whose token mean is per micro-batch by definition). Under torchrun each
process runs this step on its share of the B prompts, and what crosses processes (the normalisers'
counts, the gradients, the metrics' inputs) is summed or gathered by parallel/distributed.py.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import grpo
import rollout
from api.client import Judge
from config import Config
from engines import episodes, vllm_engine
from engines.vllm_engine import sampler_weight
from model import merged_for_sampling, reference_mode
from parallel.distributed import all_sum, gather, gather_drawn, share, sum_norms
from plumbing.sampler import PromptSampler
from plumbing.updates import (
    batch_log_probs,
    micro_batch_log_probs,
    micro_batches,
    norm_metrics,
    optimizer_step,
    peak_memory_mb,
)
from scoring.batch import (
    RewardResult,
    compute_rewards,
    in_background,
    join_results,
    reward_context,
)
from scoring.metrics import source_metrics, step_metrics


@dataclass
class Run:
    """Everything the loop needs, built (and checked) before the run directory is touched."""
    cfg: Config
    run_dir: Path
    rows: list[dict]
    source_labels: list[str]  # one per data source (a mixture has several)
    device: torch.device
    model: torch.nn.Module
    tokenizer: object
    ref_copy: torch.nn.Module | None  # full fine-tuning with a reference (GRPO beta > 0, DPO) only
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object  # a GradScaler for fp16, else None
    sampler: PromptSampler
    judges: dict[str, Judge]  # by name: "judge" (the judge: section) and the judges: section's
    start: int  # last completed step (0 for a new run)
    engine: vllm_engine.VllmEngine | None = None  # rollout.engine: vllm
    eval_rows: list[dict] | None = None  # run.eval_every: the held-out rows
    warned_all_truncated: bool = False  # the all-truncated warning is given once a run
    phase: str = "training"  # what the step is doing (sampling, training, scoring the held-out
    #   rows, syncing to vLLM): out of GPU memory, out_of_memory's advice fits it
    ref_logps: dict = field(default_factory=dict)  # DPO: by reply, dpo.cache_reference's log-probs
    changed: list[str] = field(default_factory=list)  # --resume: settings unlike the checkpoint's
    step: int = 0  # the step under way (what an interrupted run reports)


def train_step(r: Run) -> tuple[dict, list[dict]]:
    """One rollout batch and its updates -> (metrics, the completions sampled for samples.jsonl)."""
    cfg, g, G = r.cfg, r.cfg.grpo, r.cfg.rollout.num_generations
    t0, device = time.time(), next(r.model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    r.phase = "sampling"  # 1. B prompts x G completions, scored
    kept, drawn, n_drawn = collect(cfg, r.model, r.tokenizer, r.rows, r.sampler, r.judges, r.engine)
    r.phase, t_rollout = "training", time.time() - t0
    if g.num_mini_batches > 1:  # no mini-batch all flat groups (resample_zero_std puts those last)
        kept = shuffle_groups(kept, G)
    batch = kept.rollout
    # 2. group advantages, A_i = (r_i - mean) / std over each group of G
    adv = grpo.group_advantages(kept.total, G, g.scale_rewards, zero_std_tol=g.zero_std_tol)  # (N,)
    mask = loss_mask(r, batch, kept.total)  # (N, C) the tokens in the loss
    keep = None  # (N, C) the tokens in the policy-gradient term: all, or the high-entropy ones
    if g.top_entropy_quantile < 1:
        keep = grpo.high_entropy_mask(batch.entropy, mask, g.top_entropy_quantile)
    # [(micro-batches, LossNorm)], the norms counting every rank's share (torchrun)
    minis = sum_norms(mini_batches(cfg, batch, mask, kept.total))
    # 3. old and reference log-probs, once, before any update
    mbs = [mb for part, _ in minis for mb in part]
    off_policy = g.num_iterations > 1 or g.num_mini_batches > 1  # else the ratio is exactly 1
    old_logp = batch_log_probs(r.model, batch, cfg, mbs) if off_policy else None  # (N, C)
    ref_logp = None
    if g.beta > 0:
        with reference_mode(r.model, r.ref_copy) as ref:
            ref_logp = batch_log_probs(ref, batch, cfg, mbs)  # (N, C)
    # 4. num_iterations passes, an optimizer update per mini-batch
    sums, tis, norms, logged, lr = update(r, batch, adv.to(device), mask, keep, minis, old_logp,
                                          ref_logp)
    if r.engine:
        r.phase = "syncing the weights to vLLM"
        r.engine.sync(r.model)  # the next rollout samples from the updated policy
    # 5. metrics over everything drawn (by every rank: torchrun), and the completions shown
    drawn = concat(gather_drawn(r, drawn), r.tokenizer.pad_token_id)
    sums, tis, n_drawn = all_sum(sums), all_sum(tis), all_sum({"n": n_drawn})["n"]
    metrics = step_metrics(drawn, G, sums, logged, g.zero_std_tol, g.beta > 0) \
        | norm_metrics(norms) | source_metrics(r, drawn) | extra_metrics(r, batch, sums, tis) | {
        "learning_rate": lr, "prompts_drawn": n_drawn, "step_time": time.time() - t0,
        "rollout_time": t_rollout, "peak_memory_mb": peak_memory_mb(device),
        "rollout_tokens_per_s": float(drawn.rollout.completion_mask.sum()) / max(t_rollout, 1e-9)}
    shown = [{"prompt": s["prompt"], "completion": t, "reward": None if rw.isnan() else float(rw),
              "advantage": float(a)}
             for s, t, rw, a in zip(kept.samples, batch.texts, kept.total, adv)]
    return metrics, [s for part in gather(shown) for s in part]


def update(r: Run, batch: rollout.Rollout, adv, mask, keep, minis, old_logp, ref_logp):
    """num_iterations passes over the batch, each an optimizer update per mini-batch, whose loss is
    the sum of its micro-batches' shares -> (the loss terms' sums over the updates whose loss was
    finite, vLLM's importance-weight sums, each update's gradient norm, those updates, the lr)."""
    g, settings = r.cfg.grpo, grpo.LossSettings.of(r.cfg.grpo)
    sums = dict.fromkeys(("loss", "tokens", "kl_sum", "ratio_sum", "clip_low_sum", "clip_high_sum",
                          "clip_delta_sum"), 0.0)
    tis = dict.fromkeys(("tokens", "abs_diff", "units", "weight", "capped"), 0.0)  # 1st iteration
    norms, logged, lr = [], 0, 0.0
    r.model.train()
    for it in range(g.num_iterations):
        for mbs, norm in minis:
            r.optimizer.zero_grad(set_to_none=True)
            upd = dict.fromkeys(sums, 0.0)  # this update's sums: into the step's only when finite
            for mb in mbs:
                logp, C = micro_batch_log_probs(r.model, batch, batch.input_ids,
                                                batch.attention_mask, mb, r.cfg)  # (n, C)
                old = None if old_logp is None else old_logp[mb, :C]  # None: on-policy
                weight = None  # vLLM sampled: pi_old / pi_sampler, corrects for its sampler
                if batch.sampler_logp is not None:
                    weight = sampler_weight(logp.detach() if old is None else old,
                                            batch.sampler_logp[mb, :C], mask[mb, :C], g.tis_cap,
                                            tis if it == 0 else None, g.tis_mode)
                loss, stats = grpo.grpo_loss(
                    logp, old, None if ref_logp is None else ref_logp[mb, :C], adv[mb],
                    mask[mb, :C], norm, settings, weight, None if keep is None else keep[mb, :C])
                (r.scaler.scale(loss) if r.scaler else loss).backward()
                upd["loss"] += float(loss.detach())
                for key, v in stats.items():
                    upd[key] += v
            gn, lr = optimizer_step(r)
            norms.append(gn)
            if all(math.isfinite(v) for v in upd.values()):
                logged += 1
                for key, v in upd.items():
                    sums[key] += v
    return sums, tis, norms, logged, lr


def loss_mask(r: Run, batch: rollout.Rollout, total: torch.Tensor) -> torch.Tensor:
    """(N, C): each completion's tokens up to its EOS, without the completions whose reward was
    skipped (fallback: skip; NaN) or, with grpo.mask_truncated_completions, that never ended."""
    mask = batch.completion_mask.clone()  # (N, C)
    if r.cfg.grpo.mask_truncated_completions:
        mask[batch.truncated] = 0
        if bool(batch.truncated.all()) and not r.warned_all_truncated:
            r.warned_all_truncated = True
            print(f"[minigrpo] warning: every completion hit rollout.max_new_tokens="
                  f"{r.cfg.rollout.max_new_tokens} and grpo.mask_truncated_completions masks them "
                  "all out: this step trains nothing. Raise max_new_tokens (or set "
                  "mask_truncated_completions: false).", file=sys.stderr)
    mask[torch.isnan(total)] = 0
    return mask


def mini_batches(cfg: Config, batch: rollout.Rollout, mask,
                 total) -> list[tuple[list[slice], grpo.LossNorm]]:
    """grpo.num_mini_batches mini-batches of whole groups, each its micro-batches and the counts its
    loss is divided by: unskipped sequences (truncated ones count, as in TRL), mask tokens."""
    N, k, skipped = batch.completion_ids.shape[0], cfg.grpo.num_mini_batches, torch.isnan(total)
    minis = []
    for lo in range(0, N, N // k):
        rows = slice(lo, lo + N // k)
        part = rollout.select_rows(batch, list(range(N))[rows])
        mbs = [slice(lo + m.start, lo + m.stop) for m in micro_batches(
            part, cfg.optim.micro_batch_size, cfg.optim.micro_batch_tokens)]
        scored_mbs = sum(bool((~skipped[mb]).any()) for mb in mbs)
        minis.append((mbs, grpo.LossNorm(cfg.grpo.loss_type, int((~skipped[rows]).sum()),
            int(mask[rows].sum()), cfg.rollout.max_new_tokens, scored_mbs)))
    return minis


def extra_metrics(r: Run, batch: rollout.Rollout, sums: dict, tis: dict) -> dict:
    """The optional metrics: vLLM's distance to the trainer's policy and its importance weights,
    the two-sided clip's share, the episodes'."""
    out = episodes.episode_metrics(batch.episodes)  # multi-turn: turns, tool calls, ...
    if batch.sampler_logp is not None:
        out["sampler_logp_abs_diff"] = tis["abs_diff"] / max(tis["tokens"], 1.0)
        if r.cfg.grpo.tis_cap:
            units = max(tis["units"], 1.0)
            out |= {"tis/weight_mean": tis["weight"] / units,
                    "tis/capped_frac": tis["capped"] / units}
    if r.cfg.grpo.delta:  # tokens with A < 0 whose ratio passed delta
        out["clip_ratio/delta_mean"] = sums["clip_delta_sum"] / max(sums["tokens"], 1.0)
    return out


# ---------------------------------------------------------------- sampling and scoring


@dataclass
class Scored:
    """Completions with their rewards; rows i*G .. i*G+G-1 form group i."""
    rollout: rollout.Rollout
    samples: list[dict]  # (n,) the data row behind each completion
    total: torch.Tensor  # (n,) weighted reward
    per_reward: dict[str, list]  # name -> (n,) values (None: does not apply)
    errors: dict[str, int]  # name -> failures counted


def score(cfg: Config, model, tokenizer, rows: list[dict], idx: list[int], judges: dict[str, Judge],
          engine: vllm_engine.VllmEngine | None = None) -> Scored:
    """Sample G completions for each of the rows `idx` (HF generate, or vLLM) and score them."""
    ro, G = cfg.rollout, cfg.rollout.num_generations
    prompts = rollout.render_rows(tokenizer, [rows[i] for i in idx], cfg.data)
    samples = [rows[i] for i in idx for _ in range(G)]
    context = reward_context(rollout.reply_prefix(tokenizer, cfg.data), judges,
                             cfg.data.assistant_prefix)

    def rewards_of(texts: list[str], num_tokens: list[int], first: int) -> RewardResult:
        return compute_rewards(texts, samples[first:first + len(texts)], cfg.rewards,
                               num_tokens=num_tokens, context=context)  # rows first, first + 1, ...

    def lengths(r: rollout.Rollout) -> list[int]:  # read here: no GPU sync on the rewards' thread
        return r.completion_mask.sum(1).long().tolist()
    if cfg.env or cfg.tools:  # multi-turn: G episodes a prompt, the rewards see each whole
        r = episodes.run_episodes(cfg, model, tokenizer, [rows[i] for i in idx])
        return scored(r, samples, compute_rewards([e.reply for e in r.episodes], samples,
            cfg.rewards, num_tokens=lengths(r), episodes=r.episodes, context=context))
    if engine is not None:
        r = engine.generate(tokenizer, prompts, rollout.eos_token_ids(tokenizer, model),
                            next(model.parameters()).device)
        return scored(r, samples, rewards_of(r.texts, lengths(r), 0))
    # With slices, each slice's rewards (judge requests, people's ratings: mostly waiting) are
    # computed in the background while the next slice samples; the results are joined in order.
    overlap = ro.overlap_rewards and 0 < ro.prompts_per_generate < len(prompts)
    pending: list[concurrent.futures.Future] = []

    def start_rewards(i: int, part: rollout.Rollout) -> None:
        pending.append(in_background(functools.partial(
            rewards_of, part.texts, lengths(part), i * G), after=pending[-1] if pending else None))
    with merged_for_sampling(model) if ro.merged_sampling else contextlib.nullcontext():
        r = rollout.generate_in_slices(model, tokenizer, prompts, ro.prompts_per_generate, G,
            ro.max_new_tokens, ro.temperature, ro.top_p, ro.top_k, ro.stop_strings,
            ro.max_prompt_tokens, ro.ignore_eos, cfg.grpo.share_prompt is not False, ro.compile,
            entropy=True, on_slice=start_rewards if overlap else None)
    res = join_results([f.result() for f in pending]) if overlap \
        else rewards_of(r.texts, lengths(r), 0)
    return scored(r, samples, res)


def scored(r: rollout.Rollout, samples: list[dict], res: RewardResult) -> Scored:
    return Scored(r, samples, torch.tensor(res.total).float(), res.per_reward, res.errors)


def concat(parts: list[Scored], pad_id: int) -> Scored:
    if len(parts) == 1:
        return parts[0]
    res = join_results([RewardResult(p.total.tolist(), p.per_reward, p.errors) for p in parts])
    return scored(rollout.concat_rollouts([p.rollout for p in parts], pad_id),
                  [s for p in parts for s in p.samples], res)


def take_rows(p: Scored, rows: list[int]) -> Scored:
    """The completions `rows` of p, in that order (their reward failures are not carried)."""
    return Scored(rollout.select_rows(p.rollout, rows), [p.samples[i] for i in rows], p.total[rows],
                  {k: [v[i] for i in rows] for k, v in p.per_reward.items()}, {})


def take_group(p: Scored, g: int, G: int) -> Scored:
    return take_rows(p, list(range(g * G, (g + 1) * G)))


def shuffle_groups(p: Scored, G: int) -> Scored:
    """p's groups in a random order (torch's generator), each group's rows kept together."""
    order = torch.randperm(len(p.samples) // G).tolist()
    return take_rows(p, [grp * G + j for grp in order for j in range(G)])


def collect(cfg: Config, model, tokenizer, rows: list[dict], sampler: PromptSampler,
            judges: dict[str, Judge],
            engine: vllm_engine.VllmEngine | None = None) -> tuple[Scored, Scored, int]:
    """-> (the B groups to train on, everything drawn, prompts drawn).

    With rollout.resample_zero_std (DAPO dynamic sampling), groups whose rewards are all equal are
    set aside and more prompts drawn until B groups carry signal or max_prompts_per_step is
    reached; set-aside groups then fill the batch. Metrics are taken over everything drawn."""
    G, tol = cfg.rollout.num_generations, cfg.grpo.zero_std_tol
    B = share(cfg.rollout.prompts_per_step)  # this process's share of B (all of it, one process)
    parts = [score(cfg, model, tokenizer, rows, sampler.draw(B), judges, engine)]
    if not cfg.rollout.resample_zero_std:
        return parts[0], parts[0], B
    cap, drawn = max(share(cfg.rollout.max_prompts_per_step) or 4 * B, B), B
    zero = [grpo.zero_std_groups(parts[0].total, G, tol).tolist()]
    while sum(z.count(False) for z in zero) < B and drawn < cap:
        k = min(B - sum(z.count(False) for z in zero), cap - drawn)
        parts.append(score(cfg, model, tokenizer, rows, sampler.draw(k), judges, engine))
        zero.append(grpo.zero_std_groups(parts[-1].total, G, tol).tolist())
        drawn += k
    signal = [(p, g) for p, z in zip(parts, zero) for g, flat in enumerate(z) if not flat]
    flat = [(p, g) for p, z in zip(parts, zero) for g, f in enumerate(z) if f]
    kept = [take_group(p, g, G) for p, g in (signal + flat)[:B]]
    pad = tokenizer.pad_token_id
    return concat(kept, pad), concat(parts, pad), drawn
