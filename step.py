"""One GRPO step: sample B prompts x G completions, score them, turn the rewards into group
advantages, and take num_iterations x num_mini_batches clipped-surrogate updates (train_step). train.py runs the loop
around it; the math is grpo.py, the sampling rollout.py, the log-probs logprobs.py.

    metrics, shown = train_step(run)      # run: a Run (below), built by train.setup

Rewards are computed while the next slice samples (rollout.prompts_per_generate with
rollout.overlap_rewards); the log-prob forward runs in micro-batches sized by
optim.micro_batch_size and optim.micro_batch_tokens, and the loss of a step is the sum of its
micro-batches' shares (grpo.aggregate), so the gradient does not depend on how it is split
(except under loss_type: bnpo, whose token mean is per micro-batch by definition).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import resource
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path


import torch

import grpo
import logprobs
import rollout
from plumbing import vllm_engine
from config import Config
from plumbing.sampler import PromptSampler
from api.client import Judge
from model import merged_for_sampling, mixed_precision, reference_mode
from scoring import RewardResult, compute_rewards, in_background, join_results, reward_context, reward_means

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
    ref_copy: torch.nn.Module | None  # full fine-tuning with a reference (GRPO with beta > 0, DPO) only
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
    phase: str = "training"  # what the step is doing (sampling, training, scoring the held-out rows, syncing to
    #   vLLM): out of GPU memory, out_of_memory's advice fits it
    ref_logps: dict = field(default_factory=dict)  # DPO: reference log-probs by reply (dpo.cache_reference)
    changed: list[str] = field(default_factory=list)  # --resume: the settings that differ from the last checkpoint's
    step: int = 0  # the step under way (what an interrupted run reports)


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
    context = reward_context(rollout.reply_prefix(tokenizer, cfg.data), judges, cfg.data.assistant_prefix)

    def rewards_of(texts: list[str], num_tokens: list[int], first: int) -> RewardResult:  # rows first, first + 1, ...
        return compute_rewards(texts, samples[first:first + len(texts)], cfg.rewards, num_tokens=num_tokens,
                               context=context)

    def lengths(r: rollout.Rollout) -> list[int]:  # read on this thread: a GPU sync stays out of the rewards' thread
        return r.completion_mask.sum(1).long().tolist()
    if engine is not None:
        r = engine.generate(tokenizer, prompts, rollout.eos_token_ids(tokenizer, model), next(model.parameters()).device)
        return scored(r, samples, rewards_of(r.texts, lengths(r), 0))
    # With slices, each slice's rewards (judge requests, people's ratings: mostly waiting) are
    # computed in the background while the next slice samples; the results are joined in order.
    overlap = ro.overlap_rewards and 0 < ro.prompts_per_generate < len(prompts)
    pending: list[concurrent.futures.Future] = []

    def start_rewards(i: int, part: rollout.Rollout) -> None:
        pending.append(in_background(functools.partial(rewards_of, part.texts, lengths(part), i * G),
                                     after=pending[-1] if pending else None))
    with merged_for_sampling(model) if ro.merged_sampling else contextlib.nullcontext():
        r = rollout.generate_in_slices(model, tokenizer, prompts, ro.prompts_per_generate, G, ro.max_new_tokens,
                                    ro.temperature, ro.top_p, ro.top_k, ro.stop_strings, ro.max_prompt_tokens,
                                    ro.ignore_eos, cfg.grpo.share_prompt is not False, ro.compile, entropy=True,
                                    on_slice=start_rewards if overlap else None)
    res = join_results([f.result() for f in pending]) if overlap else rewards_of(r.texts, lengths(r), 0)
    return scored(r, samples, res)


def scored(r: rollout.Rollout, samples: list[dict], res: RewardResult) -> Scored:
    return Scored(r, samples, torch.tensor(res.total, dtype=torch.float32), res.per_reward, res.errors)


def concat(parts: list[Scored], pad_id: int) -> Scored:
    if len(parts) == 1:
        return parts[0]
    res = join_results([RewardResult(p.total.tolist(), p.per_reward, p.errors) for p in parts])
    return scored(rollout.concat_rollouts([p.rollout for p in parts], pad_id), [s for p in parts for s in p.samples], res)


def take_rows(p: Scored, rows: list[int]) -> Scored:
    """The completions `rows` of p, in that order (their reward failures are not carried)."""
    return Scored(rollout.select_rows(p.rollout, rows), [p.samples[i] for i in rows], p.total[rows],
                  {k: [v[i] for i in rows] for k, v in p.per_reward.items()}, {})


def take_group(p: Scored, g: int, G: int) -> Scored:
    return take_rows(p, list(range(g * G, (g + 1) * G)))


def collect(cfg: Config, model, tokenizer, rows: list[dict], sampler: PromptSampler, judges: dict[str, Judge],
            engine: vllm_engine.VllmEngine | None = None) -> tuple[Scored, Scored, int]:
    """-> (the B groups to train on, everything drawn, prompts drawn).

    With rollout.resample_zero_std (DAPO dynamic sampling), groups whose rewards are all equal are
    set aside and more prompts drawn until B groups carry signal or max_prompts_per_step is
    reached; set-aside groups then fill the batch. Metrics are taken over everything drawn."""
    B, G, tol = cfg.rollout.prompts_per_step, cfg.rollout.num_generations, cfg.grpo.zero_std_tol
    parts = [score(cfg, model, tokenizer, rows, sampler.draw(B), judges, engine)]
    if not cfg.rollout.resample_zero_std:
        return parts[0], parts[0], B
    cap, drawn = max(cfg.rollout.max_prompts_per_step or 4 * B, B), B
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


TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's names


def sampler_weight(old: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cap: float,
                   sums: dict | None, mode: str = "token_truncate") -> torch.Tensor | None:
    """Importance weight of the trainer's policy against the sampler's (None when cap is 0: off),
    old, sampler_logp, mask (n, C) -> (n, C), the ratio rho = pi_old / pi_sampler taken per token
    (token_*) or per completion, the product over its tokens (sequence_*, the same for each of them):

        *_truncate   min(rho, cap)                 TIS: a large ratio counts as cap
        *_mask       rho where rho <= cap, else 0  MIS: tokens (completions) past the cap leave the loss

    `sums` given (the first iteration, for the step's metrics): adds to it "tokens" and "abs_diff"
    (the masked tokens' |log pi_old - log pi_sampler|) and, with a cap, "units" (tokens, or in sequence
    modes completions, as TRL counts them), "weight" (their weights) and "capped" (those capped or
    masked)."""
    if mode not in TIS_MODES:
        raise ValueError(f"grpo.tis_mode must be one of {', '.join(TIS_MODES)}, got {mode!r}")
    diff = torch.nan_to_num(old - sampler_logp, nan=0.0)  # (n, C) a log-prob vLLM did not give: ratio 1, as TRL
    weight = None
    if cap:
        log_rho = torch.where(mask.bool(), diff, 0.0)  # (n, C) padding leaves a completion's product alone
        if mode.startswith("sequence"):
            log_rho = log_rho.sum(1, keepdim=True).expand_as(diff)  # (n, C) one ratio per completion
        rho = torch.exp(log_rho)
        weight = torch.clamp(rho, max=cap) if mode.endswith("truncate") else torch.where(rho > cap, 0.0, rho)
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


def micro_batches(batch: rollout.Rollout, size: int, max_tokens: int = 0, group: int = 1) -> list[slice]:
    """Consecutive rows, at most `size` a micro-batch and, with max_tokens > 0 (optim.micro_batch_tokens),
    at most that many padded tokens: rows x (longest prompt + longest completion) of the micro-batch,
    what its forward pays for after trimming. A row over the budget on its own gets its own
    micro-batch. Consecutive rows keep a group's rows together (grpo.share_prompt) when `size` is a
    multiple of G; other sizes split groups (the same gradient, less prompt sharing). group: cut only
    between whole groups of that many rows (a DPO pair's two replies, which one loss term joins)."""
    n = batch.completion_ids.shape[0]
    size = max(size // group, 1) * group
    if not max_tokens:
        return [slice(s, min(s + size, n)) for s in range(0, n, size)]
    p_len, c_len = batch.prompt_mask.sum(1).tolist(), batch.completion_mask.sum(1).tolist()
    out, start = [], 0
    for i in range(group, n, group):  # do rows i .. i + group - 1 still fit in the micro-batch that starts at `start`?
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
    with mixed_precision(model):  # bf16/fp16 matmuls over a half-precision base; nothing on an fp32 model
        return logprobs.sequence_log_probs(model, i, a, C, T, cfg.grpo.logprob_chunk, cfg.grpo.fused_lm_head, share), C


@torch.no_grad()
def batch_log_probs(model, batch: rollout.Rollout, cfg: Config, mbs: list[slice] | None = None) -> torch.Tensor:
    """(N, C) log-probs of the sampled tokens (old or reference policy): zero past each micro-batch's longest
    completion; between a row's end and that, the log-probs of padding, which the loss masks out."""
    out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32, device=batch.completion_ids.device)
    ids, attn = batch.input_ids, batch.attention_mask
    for mb in mbs or micro_batches(batch, cfg.optim.micro_batch_size, cfg.optim.micro_batch_tokens):
        logp, C = micro_batch_log_probs(model, batch, ids, attn, mb, cfg)
        out[mb, :C] = logp
    return out


def train_step(r: Run) -> tuple[dict, list[dict]]:
    """One rollout batch and its updates -> (metrics, sampled completions): num_iterations passes over
    it, each pass an optimizer step on each of its num_mini_batches mini-batches of whole groups,
    whose loss is normalised over that mini-batch (grpo.LossNorm)."""
    cfg, model, optimizer, scaler = r.cfg, r.model, r.optimizer, r.scaler
    t0 = time.time()
    G, g = cfg.rollout.num_generations, cfg.grpo
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    r.phase = "sampling"
    kept, drawn, n_prompts = collect(cfg, model, r.tokenizer, r.rows, r.sampler, r.judges, r.engine)
    r.phase = "training"
    t_rollout = time.time() - t0
    k = g.num_mini_batches
    if k > 1:  # groups shuffled, so that no mini-batch is all flat groups (resample_zero_std puts those last)
        kept = take_rows(kept, [grp * G + j for grp in torch.randperm(len(kept.samples) // G).tolist() for j in range(G)])
    batch = kept.rollout
    adv = grpo.group_advantages(kept.total, G, g.scale_rewards, zero_std_tol=g.zero_std_tol).to(device)  # (N,)
    mask = batch.completion_mask.clone()  # (N, C)
    if g.mask_truncated_completions:
        mask[batch.truncated] = 0
        if bool(batch.truncated.all()) and not r.warned_all_truncated:
            r.warned_all_truncated = True
            print(f"[minigrpo] warning: every completion hit rollout.max_new_tokens={cfg.rollout.max_new_tokens} and "
                  "grpo.mask_truncated_completions masks them all out: this step trains nothing. Raise "
                  "max_new_tokens (or set mask_truncated_completions: false).", file=sys.stderr)
    skipped = torch.isnan(kept.total)  # (N,) a reward with fallback: skip failed: no advantage, no part in the loss
    mask[skipped] = 0
    keep = None  # (N, C) the tokens in the policy-gradient term: all, or the step's high-entropy ones
    if g.top_entropy_quantile < 1:  # chosen once over the whole step, by the sampling policy's entropy
        keep = grpo.high_entropy_mask(batch.entropy, mask, g.top_entropy_quantile)
    N = batch.completion_ids.shape[0]
    minis = []  # (its micro-batches, its LossNorm) for each mini-batch of N / k rows, whole groups
    for lo in range(0, N, N // k):
        rows = slice(lo, lo + N // k)
        mbs = [slice(lo + m.start, lo + m.stop) for m in micro_batches(
            rollout.select_rows(batch, list(range(N))[rows]), cfg.optim.micro_batch_size, cfg.optim.micro_batch_tokens)]
        # the mini-batch's counts: sequences leave out skipped completions (truncated ones count, as in TRL);
        # tokens are the mask's, without those of truncated completions under mask_truncated_completions
        minis.append((mbs, grpo.LossNorm(g.loss_type, max(int((~skipped[rows]).sum()), 1), int(mask[rows].sum()),
                                         cfg.rollout.max_new_tokens, max(sum(bool((~skipped[mb]).any()) for mb in mbs), 1))))
    train_mbs = [mb for mbs, _ in minis for mb in mbs]  # old and reference log-probs in the loss's micro-batches
    off_policy = g.num_iterations > 1 or k > 1  # an update before some loss: compare with the sampling policy
    old_logp = batch_log_probs(model, batch, cfg, train_mbs) if off_policy else None  # (N, C); None: on-policy
    ref_logp = None
    if g.beta > 0:
        with reference_mode(model, r.ref_copy) as ref:
            ref_logp = batch_log_probs(ref, batch, cfg, train_mbs)  # (N, C)
    ids, attn = batch.input_ids, batch.attention_mask
    sums = dict.fromkeys(("loss", "tokens", "kl_sum", "ratio_sum", "clip_low_sum", "clip_high_sum", "clip_delta_sum"), 0.0)
    norms = []  # each update's gradient norm
    engine_sums = dict.fromkeys(("tokens", "abs_diff", "units", "weight", "capped"), 0.0)  # vLLM's samples, first iteration
    model.train()
    logged = 0  # updates whose loss and stats were finite
    for it in range(g.num_iterations):
        for mbs, norm in minis:
            optimizer.zero_grad(set_to_none=True)
            upd = dict.fromkeys(sums, 0.0)  # this update's sums: into the step's only when finite
            for mb in mbs:
                logp, C = micro_batch_log_probs(model, batch, ids, attn, mb, cfg)  # (n, C)
                old = None if old_logp is None else old_logp[mb, :C]
                weight = None
                if batch.sampler_logp is not None:  # another engine sampled: how far is it from the trainer's policy?
                    weight = sampler_weight(logp.detach() if old is None else old, batch.sampler_logp[mb, :C],
                                            mask[mb, :C], g.tis_cap, engine_sums if it == 0 else None, g.tis_mode)
                loss, stats = grpo.grpo_loss(
                    logp, old, None if ref_logp is None else ref_logp[mb, :C], adv[mb], mask[mb, :C], norm,
                    g.epsilon, g.epsilon_high, g.beta, weight, g.importance_sampling_level,
                    None if keep is None else keep[mb, :C], g.delta, g.cispo_cap if g.policy_loss == "cispo" else None)
                (scaler.scale(loss) if scaler else loss).backward()
                upd["loss"] += float(loss.detach())
                for key, v in stats.items():
                    upd[key] += v
            gn, lr = optimizer_step(r)
            norms.append(gn)
            if all(math.isfinite(v) for v in upd.values()):
                logged += 1
                for key, v in upd.items():
                    sums[key] += v
    if r.engine:
        r.phase = "syncing the weights to vLLM"
        r.engine.sync(model)  # the next rollout samples from the updated policy
    extra = {}  # the optional metrics: vLLM's mismatch and importance weights, the two-sided clip
    if batch.sampler_logp is not None:
        n = max(engine_sums["tokens"], 1.0)
        extra = {"sampler_logp_abs_diff": engine_sums["abs_diff"] / n}
        if g.tis_cap:
            units = max(engine_sums["units"], 1.0)
            extra |= {"tis/weight_mean": engine_sums["weight"] / units, "tis/capped_frac": engine_sums["capped"] / units}
    if g.delta:  # tokens with A < 0 whose ratio passed delta (two-sided clip)
        extra["clip_ratio/delta_mean"] = sums["clip_delta_sum"] / max(sums["tokens"], 1.0)
    metrics = step_metrics(drawn, G, sums, logged, g.zero_std_tol, g.beta > 0) | norm_metrics(norms) | source_metrics(r, drawn) | extra | {
        "learning_rate": lr, "prompts_drawn": n_prompts, "step_time": time.time() - t0, "rollout_time": t_rollout,
        "rollout_tokens_per_s": float(drawn.rollout.completion_mask.sum()) / max(t_rollout, 1e-9),
        "peak_memory_mb": peak_memory_mb(device)}  # judge_*: train.py adds them, the held-out scoring's calls counted
    shown = [{"prompt": s["prompt"], "completion": t, "reward": None if rw.isnan() else float(rw), "advantage": float(a)}
             for s, t, rw, a in zip(kept.samples, batch.texts, kept.total, adv)]
    return metrics, shown


def optimizer_step(r: Run) -> tuple[float, float]:
    """Unscale (fp16), clip, step the optimizer and the schedule -> (grad norm, lr used).
    A non-finite gradient skips the update (the schedule still advances): one AdamW step on it
    would write NaN into every trained weight for the rest of the run."""
    if r.scaler:
        r.scaler.unscale_(r.optimizer)
    max_norm = r.cfg.optim.max_grad_norm if r.cfg.optim.max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(r.params, max_norm))
    lr = r.scheduler.get_last_lr()[0]
    if r.scaler:
        r.scaler.step(r.optimizer)  # skips non-finite gradients itself, and lowers the loss scale
        r.scaler.update()
        if r.scaler.get_scale() < 1.0:  # halved 17 times from 65536: not a scale still to find, a pass that overflows
            raise rollout.NonFiniteLogits("float16 loss scaling has halved its scale below 1, skipping update after "
                                          "update: the training pass gives inf or NaN; " + rollout.NON_FINITE)
    elif math.isfinite(grad_norm):
        r.optimizer.step()
    else:
        print(f"[minigrpo] warning: the gradient norm is {grad_norm}; this update is skipped", file=sys.stderr)
    if math.isfinite(grad_norm):
        r.scheduler.step()
    else:  # skipped: torch warns that no optimizer.step came first (LambdaLR reads only the count). Only here, as
        with warnings.catch_warnings():  # catch_warnings resets which warnings were shown: others would repeat
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            r.scheduler.step()
    return grad_norm, lr


def norm_metrics(norms: list[float]) -> dict:
    """grad_norm: the mean over the step's updates that were applied; skipped_updates: how many had a
    non-finite gradient (fp16's GradScaler skips those as it finds its scale; see optimizer_step), only
    when some did. A step with no update applied logs no grad_norm (not inf or NaN, which JSON lacks).

    >>> norm_metrics([1.0, 3.0]), norm_metrics([2.0, float("inf")]), norm_metrics([float("nan")])
    ({'grad_norm': 2.0}, {'grad_norm': 2.0, 'skipped_updates': 1}, {'skipped_updates': 1})
    """
    applied = [n for n in norms if math.isfinite(n)]
    skipped = len(norms) - len(applied)
    return ({"grad_norm": sum(applied) / len(applied)} if applied else {}) | ({"skipped_updates": skipped} if skipped else {})


def step_metrics(drawn: Scored, G: int, sums: dict, updates: int, zero_std_tol: float, kl: bool = True) -> dict:
    """Rewards over every completion drawn (what the policy produced); loss terms over the trained tokens
    of the `updates` optimizer updates whose loss was finite, loss their mean (grad_norm: norm_metrics).
    reward_std is the mean of the groups' stds, as in TRL; entropy the mean over the drawn completions'
    tokens of their sampling distributions' entropy (HF generate only); kl only with a reference (kl)."""
    tok, r = max(sums["tokens"], 1.0), drawn.total
    lengths, truncated, h = drawn.rollout.completion_mask.sum(1), drawn.rollout.truncated, drawn.rollout.entropy
    scored = r[~torch.isnan(r)]  # NaN: skipped (fallback: skip)
    _, std, n = grpo.group_stats(r, G)  # (B,) each
    return {
        **({"loss": sums["loss"] / updates} if updates else {}),  # over the updates whose loss was finite (none: no value)
        **({"reward": float(scored.mean())} if len(scored) else {}),  # none scored: no value
        "reward_std": float(std[n >= 2].mean()) if (n >= 2).any() else 0.0, "frac_reward_skipped": 1 - len(scored) / len(r),
        **{f"rewards/{k}/mean": v for k, v in reward_means(drawn.per_reward).items()},
        **{f"reward_errors/{k}": v for k, v in drawn.errors.items()},
        "frac_reward_zero_std": float(grpo.zero_std_groups(r, G, zero_std_tol).float().mean()),
        **({"kl": sums["kl_sum"] / tok} if kl and sums["tokens"] else {}),  # as TRL: only with a reference (beta > 0)
        **({"ratio_mean": sums["ratio_sum"] / tok,  # none without a trained token
            "clip_ratio/low_mean": sums["clip_low_sum"] / tok, "clip_ratio/high_mean": sums["clip_high_sum"] / tok,
            "clip_ratio/region_mean": (sums["clip_low_sum"] + sums["clip_high_sum"]) / tok} if sums["tokens"] else {}),
        "completions/mean_length": float(lengths.float().mean()), "completions/max_length": int(lengths.max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
        **({"entropy": float((h * drawn.rollout.completion_mask).sum() / lengths.sum().clamp(min=1))} if h is not None else {}),
    }


def source_shares(r: Run) -> dict:
    """For a mixture: data/<label>, the share of the rows drawn since the last call (this step's) from
    each source, and data/<label>/weight, the share the mixture (its curriculum, now) draws with."""
    counts = r.sampler.pop_counts()
    if len(counts) < 2:
        return {}
    return {f"data/{label}": n / max(1, sum(counts)) for label, n in zip(r.source_labels, counts)} | {
        f"data/{label}/weight": w for label, w in zip(r.source_labels, r.sampler.shares())}


def source_metrics(r: Run, drawn: Scored) -> dict:
    """For a mixture: data/<label> (source_shares), and data/<label>/reward, the mean reward of each
    source's completions (skipped ones left out)."""
    out = source_shares(r)
    if not out:
        return {}
    label_of, start = {}, 0  # a sample is one of r.rows itself: its source by identity
    for label, size in zip(r.source_labels, r.sampler.sizes):
        label_of.update((id(row), label) for row in r.rows[start:start + size])
        start += size
    rewards: dict[str, list[float]] = {}
    for sample, total in zip(drawn.samples, drawn.total.tolist()):
        if not math.isnan(total) and id(sample) in label_of:
            rewards.setdefault(label_of[id(sample)], []).append(total)
    return out | {f"data/{label}/reward": sum(v) / len(v) for label, v in rewards.items()}


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
