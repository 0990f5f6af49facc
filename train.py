"""Train a policy with GRPO. The loop: sample B prompts x G completions, score them, turn rewards
into group advantages, and take num_iterations clipped-surrogate updates on the LoRA weights.

    python train.py --config configs/quickstart.yaml
    python train.py --config configs/quickstart.yaml --grpo.beta=0.04 --run.out_dir=runs/quickstart_kl
    python train.py --config configs/quickstart.yaml --resume      # continue from the last checkpoint
    python train.py --config configs/quickstart.yaml --dry-run     # check everything, show the first prompt

A run directory (run.out_dir) receives config.yaml, metrics.jsonl (one line per step),
samples.jsonl (completions with their rewards) and checkpoints/step_NNNNNN/ (adapter, optimizer,
scheduler, RNG states, data position; written to a .tmp directory and renamed, so a kill never
leaves a half checkpoint). Bad input exits with code 2 and one line saying what to fix.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import math
import random
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import grpo
import jsonl
import logprobs
import rollout
import vllm_engine
from config import Config, ConfigError, config_to_dict, load_config, redacted, save_config
from data import PromptSampler, load_sources
from model import (PROVENANCE, is_peft, load_policy, merged_for_sampling, mixed_precision, pick_device, pick_dtype,
                   reference_mode, resolve_model_path, same_base, trainable_parameters)
from checkpoint import checkpoints, keep_lines_up_to, load_checkpoint, save_checkpoint
from judge import Judge, judges_stats
from scoring import (RewardResult, compute_rewards, in_background, join_results, open_scoring, reward_context,
                     reward_means)


# ----------------------------------------------------------------------------- one step


def lr_lambda(cfg: Config, total_updates: int):
    """Linear warmup for warmup_steps updates, then cosine from lr down to lr * min_lr_ratio."""
    w, floor = cfg.optim.warmup_steps, cfg.optim.min_lr_ratio

    def f(u: int) -> float:
        if u < w:
            return (u + 1) / (w + 1)
        progress = min(1.0, (u - w) / max(1, total_updates - w))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


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

    def rewards_of(texts: list[str], num_tokens: list[int], first: int) -> RewardResult:  # rows first, first + 1, ...
        return compute_rewards(texts, samples[first:first + len(texts)], cfg.rewards, num_tokens=num_tokens,
                               context=reward_context(cfg.data.assistant_prefix, judges))

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
                                    ro.ignore_eos, cfg.grpo.share_prompt is not False, ro.compile,
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


def take_group(p: Scored, g: int, G: int) -> Scored:
    rows = list(range(g * G, (g + 1) * G))
    return Scored(rollout.select_rows(p.rollout, rows), p.samples[g * G:(g + 1) * G], p.total[g * G:(g + 1) * G],
                  {k: v[g * G:(g + 1) * G] for k, v in p.per_reward.items()}, {})


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


def sampler_weight(old: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cap: float,
                   sums: dict | None) -> torch.Tensor | None:
    """Truncated importance weight min(pi_old / pi_sampler, cap) per token (None when cap is 0: off),
    old, sampler_logp, mask (n, C). Adds the masked tokens' |log pi_old - log pi_sampler|, weights and
    capped count to `sums` when given (the first iteration's metrics)."""
    diff = old - sampler_logp  # (n, C)
    weight = torch.clamp(torch.exp(diff), max=cap) if cap else None
    if sums is not None:
        m = mask.bool()
        sums["tokens"] += float(m.sum())
        sums["abs_diff"] += float(diff.abs()[m].sum())
        if weight is not None:
            sums["weight"] += float(weight[m].sum())
            sums["capped"] += float((weight[m] >= cap).sum())
    return weight


def micro_batches(batch: rollout.Rollout, size: int, max_tokens: int = 0) -> list[slice]:
    """Consecutive rows, at most `size` a micro-batch and, with max_tokens > 0 (optim.micro_batch_tokens),
    at most that many padded tokens: rows x (longest prompt + longest completion) of the micro-batch,
    what its forward pays for after trimming. A row over the budget on its own gets its own
    micro-batch. Consecutive rows keep a group's rows together (grpo.share_prompt)."""
    n = batch.completion_ids.shape[0]
    if not max_tokens:
        return [slice(s, min(s + size, n)) for s in range(0, n, size)]
    p_len, c_len = batch.prompt_mask.sum(1).tolist(), batch.completion_mask.sum(1).tolist()
    out, start = [], 0
    for i in range(1, n):  # does row i still fit in the micro-batch [start, i]?
        padded = (i - start + 1) * (max(p_len[start:i + 1]) + max(c_len[start:i + 1]))
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
def batch_log_probs(model, batch: rollout.Rollout, cfg: Config) -> torch.Tensor:
    """(N, C) log-probs of the sampled tokens (old or reference policy): zero past each micro-batch's longest
    completion; between a row's end and that, the log-probs of padding, which the loss masks out."""
    out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32, device=batch.completion_ids.device)
    ids, attn = batch.input_ids, batch.attention_mask
    for mb in micro_batches(batch, cfg.optim.micro_batch_size, cfg.optim.micro_batch_tokens):
        logp, C = micro_batch_log_probs(model, batch, ids, attn, mb, cfg)
        out[mb, :C] = logp
    return out


def train_step(r: Run) -> tuple[dict, list[dict]]:
    """One rollout batch and its num_iterations optimizer updates -> (metrics, sampled completions)."""
    cfg, model, optimizer, scaler = r.cfg, r.model, r.optimizer, r.scaler
    t0 = time.time()
    G, g = cfg.rollout.num_generations, cfg.grpo
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    kept, drawn, n_prompts = collect(cfg, model, r.tokenizer, r.rows, r.sampler, r.judges, r.engine)
    t_rollout = time.time() - t0
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
    old_logp = batch_log_probs(model, batch, cfg) if g.num_iterations > 1 else None  # (N, C); None: on-policy
    ref_logp = None
    if g.beta > 0:
        with reference_mode(model, r.ref_copy) as ref:
            ref_logp = batch_log_probs(ref, batch, cfg)  # (N, C)
    N = batch.completion_ids.shape[0]
    mbs = micro_batches(batch, cfg.optim.micro_batch_size, cfg.optim.micro_batch_tokens)
    # whole-step counts; skipped completions are not counted (truncated ones are, as in TRL)
    norm = grpo.LossNorm(g.loss_type, max(N - int(skipped.sum()), 1), int(mask.sum()), cfg.rollout.max_new_tokens,
                         max(sum(bool((~skipped[mb]).any()) for mb in mbs), 1))
    ids, attn = batch.input_ids, batch.attention_mask
    sums = dict.fromkeys(("loss", "tokens", "kl_sum", "ratio_sum", "clip_low_sum", "clip_high_sum", "grad_norm"), 0.0)
    sampler = dict.fromkeys(("tokens", "abs_diff", "weight", "capped"), 0.0)  # vLLM's samples, first iteration
    model.train()
    for it in range(g.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        for mb in mbs:
            logp, C = micro_batch_log_probs(model, batch, ids, attn, mb, cfg)  # (n, C)
            old = None if old_logp is None else old_logp[mb, :C]
            weight = None
            if batch.sampler_logp is not None:  # another engine sampled: how far is it from the trainer's policy?
                weight = sampler_weight(logp.detach() if old is None else old, batch.sampler_logp[mb, :C],
                                        mask[mb, :C], g.tis_cap, sampler if it == 0 else None)
            loss, stats = grpo.grpo_loss(
                logp, old, None if ref_logp is None else ref_logp[mb, :C],
                adv[mb], mask[mb, :C], norm, g.epsilon, g.epsilon_high, g.beta, weight)
            (scaler.scale(loss) if scaler else loss).backward()
            sums["loss"] += float(loss.detach())
            for k, v in stats.items():
                sums[k] += v
        gn, lr = optimizer_step(r)
        sums["grad_norm"] += gn
    if r.engine:
        r.engine.sync(model)  # the next rollout samples from the updated policy
    tis = {}
    if batch.sampler_logp is not None:
        n = max(sampler["tokens"], 1.0)
        tis = {"sampler_logp_abs_diff": sampler["abs_diff"] / n}
        if g.tis_cap:
            tis |= {"tis/weight_mean": sampler["weight"] / n, "tis/capped_frac": sampler["capped"] / n}
    metrics = step_metrics(drawn, G, sums, g.num_iterations, g.zero_std_tol) | source_shares(r) | tis | {
        "learning_rate": lr, "prompts_drawn": n_prompts, "step_time": time.time() - t0, "rollout_time": t_rollout,
        "rollout_tokens_per_s": float(drawn.rollout.completion_mask.sum()) / max(t_rollout, 1e-9),
        "peak_memory_mb": peak_memory_mb(device), **judges_stats(r.judges)}
    shown = [{"prompt": s["prompt"], "completion": t, "reward": None if r.isnan() else float(r), "advantage": float(a)}
             for s, t, r, a in zip(kept.samples, batch.texts, kept.total, adv)]
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
    elif math.isfinite(grad_norm):
        r.optimizer.step()
    else:
        print(f"[minigrpo] warning: the gradient norm is {grad_norm}; this update is skipped", file=sys.stderr)
        with warnings.catch_warnings():  # torch warns when no optimizer.step came first; LambdaLR reads only the count
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            r.scheduler.step()
        return grad_norm, lr
    r.scheduler.step()
    return grad_norm, lr


def step_metrics(drawn: Scored, G: int, sums: dict, mu: int, zero_std_tol: float) -> dict:
    """Rewards over every completion drawn (what the policy produced); loss terms over the trained tokens.
    reward_std is the mean of the groups' stds, as in TRL."""
    tok, r = max(sums["tokens"], 1.0), drawn.total
    lengths, truncated = drawn.rollout.completion_mask.sum(1), drawn.rollout.truncated
    scored = r[~torch.isnan(r)]  # NaN: skipped (fallback: skip)
    _, std, n = grpo.group_stats(r, G)  # (B,) each
    return {
        "loss": sums["loss"] / mu, **({"reward": float(scored.mean())} if len(scored) else {}),  # none scored: no value
        "reward_std": float(std[n >= 2].mean()) if (n >= 2).any() else 0.0, "frac_reward_skipped": 1 - len(scored) / len(r),
        **{f"rewards/{k}/mean": v for k, v in reward_means(drawn.per_reward).items()},
        **{f"reward_errors/{k}": v for k, v in drawn.errors.items()},
        "frac_reward_zero_std": float(grpo.zero_std_groups(r, G, zero_std_tol).float().mean()),
        "kl": sums["kl_sum"] / tok, "ratio_mean": sums["ratio_sum"] / tok,
        "clip_ratio/low_mean": sums["clip_low_sum"] / tok, "clip_ratio/high_mean": sums["clip_high_sum"] / tok,
        "clip_ratio/region_mean": (sums["clip_low_sum"] + sums["clip_high_sum"]) / tok,
        "completions/mean_length": float(lengths.float().mean()), "completions/max_length": int(lengths.max()),
        "completions/clipped_ratio": float(truncated.float().mean()), "grad_norm": sums["grad_norm"] / mu,
    }


def source_shares(r: Run) -> dict:
    """data/<label>: the share of this step's prompts drawn from each source of a mixture."""
    counts = r.sampler.pop_counts()
    if len(counts) < 2:
        return {}
    return {f"data/{label}": n / max(1, sum(counts)) for label, n in zip(r.source_labels, counts)}


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ----------------------------------------------------------------------------- CLI and loop


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Any config field: --section.key=value")
    ap.add_argument("--config", required=True, help="YAML config file")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in run.out_dir")
    ap.add_argument("--dry-run", action="store_true", help="check config, data, model and judges, show the first "
                    "prompt as the model sees it, and exit without training or writing anything")
    return ap.parse_known_args(argv)


SHOWN = [("reward", "reward {:.3f}"), ("reward_std", "± {:.3f}"), ("eval/reward", "eval {:.3f}"),
         ("loss", "loss {:+.4f}"), ("kl", "kl {:.4f}"),
         ("completions/mean_length", "len {:.1f}"), ("frac_reward_zero_std", "zero_std {:.2f}"), ("epoch", "epoch {:.2f}"),
         ("learning_rate", "lr {:.2e}"), ("step_time", "{:.1f}s")]


def format_line(step: int, total: int, m: dict, keys: tuple = ()) -> str:
    """One plain line per step; with `keys`, only those metrics (the progress bar's short form)."""
    parts = [f"step {step}/{total}"] + [fmt.format(m[k]) for k, fmt in SHOWN if k in m and (not keys or k in keys)]
    return " | ".join(parts).replace(" | ±", " ±")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
    ref_copy: torch.nn.Module | None  # full fine-tuning with beta > 0 only
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


def flat(d: dict, prefix: str = "") -> dict:
    return {k2: v2 for k, v in d.items() for k2, v2 in
            (flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(f"{prefix}{k}", v)])}


def check_lengths(cfg: Config, rows: list[dict], tokenizer, what: str = "row") -> str:
    """Every prompt fits rollout.max_prompt_tokens (GRPO), every prompt + reply sft.max_length (SFT);
    -> which row is the longest, for --dry-run."""
    texts = [p + (r["target"] + tokenizer.eos_token if cfg.mode == "sft" else "")
             for p, r in zip(rollout.render_rows(tokenizer, rows, cfg.data), rows)]
    lengths = [len(x) for x in tokenizer(texts, add_special_tokens=False).input_ids]
    longest = max(range(len(rows)), key=lengths.__getitem__)
    key, limit = ("sft.max_length", cfg.sft.max_length) if cfg.mode == "sft" else ("rollout.max_prompt_tokens", cfg.rollout.max_prompt_tokens)
    if lengths[longest] > limit:
        raise ConfigError(f"{what} {longest} renders to {lengths[longest]} tokens > {key}={limit}; raise the limit or shorten it")
    return f"{what} {longest}, {lengths[longest]} tokens ({key} {limit})"


def setup(args, overrides: list[str]) -> Run:
    """Everything that can fail on bad input, as ConfigError, before the run directory is touched."""
    cfg = load_config(args.config, overrides)
    vllm_engine.check_config(cfg)
    judges = open_scoring(cfg, check_rewards=bool(cfg.rewards) or cfg.mode == "grpo")
    run_dir = Path(cfg.run.out_dir)
    if not args.resume and not args.dry_run and run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run.out_dir={run_dir} already holds a run; pass --resume to continue it or set another run.out_dir")
    ckpts = checkpoints(run_dir) if args.resume else []
    if ckpts:
        before = flat(config_to_dict(load_config(ckpts[-1] / "config.yaml")))
        changed = sorted(k for k, v in flat(config_to_dict(cfg)).items() if before.get(k) != v)
        if any(k.startswith(("model.", "lora.")) for k in changed):
            raise ConfigError(f"--resume with a different model or LoRA setup than {ckpts[-1]} ({', '.join(changed)}); "
                              "resume with the run's own config.yaml")
        if changed:
            print(f"[minigrpo] resuming with changed settings: {', '.join(changed)}", file=sys.stderr)
    sources = load_sources(cfg.data)
    rows = [row for s in sources for row in s.rows]
    if cfg.run.report_to != "none" and importlib.util.find_spec(cfg.run.report_to) is None:
        raise ConfigError(f"run.report_to: {cfg.run.report_to} is not installed; pip install {cfg.run.report_to}")
    eval_rows = None
    if cfg.run.eval_every:
        if cfg.eval.select is None and not cfg.eval.name:
            raise ConfigError("run.eval_every needs eval.select (the held-out rows to score, e.g. [1500, 1700]) or eval.name")
        import eval as ev
        ev.check_eval_config(cfg)
        eval_rows = ev.held_out_rows(cfg)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    device = pick_device(cfg.run.device)
    model, tokenizer = load_policy(cfg.model, cfg.lora, device, beta=cfg.grpo.beta if cfg.mode == "grpo" else 0.0)
    if ckpts and (ckpts[-1] / "adapter" / PROVENANCE).is_file():
        saved = json.loads((ckpts[-1] / "adapter" / PROVENANCE).read_text())
        if not same_base(saved, model.minigrpo_base):  # e.g. init_adapter names a run whose newest checkpoint has changed since
            raise ConfigError(f"--resume: the base now built ({model.minigrpo_base}) differs from the one {ckpts[-1]} "
                              f"was trained on ({saved}); point model.init_adapter at the checkpoint it used")
    check_lengths(cfg, rows, tokenizer)
    if eval_rows and cfg.mode == "sft":  # eval/loss runs them through the same batches
        check_lengths(cfg, eval_rows, tokenizer, "held-out row")
    ref_copy = None
    if cfg.grpo.beta > 0 and not is_peft(model):  # full fine-tuning: the reference needs its own weights
        ref_copy = copy.deepcopy(model).eval().requires_grad_(False)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay)
    updates = cfg.run.steps * (cfg.grpo.num_iterations if cfg.mode == "grpo" else 1)
    fp16 = device.type == "cuda" and pick_dtype(cfg.model.dtype, device) == torch.float16
    scaler = torch.amp.GradScaler("cuda") if fp16 else None  # fp16 gradients underflow without loss scaling
    sampler = PromptSampler([len(s.rows) for s in sources], cfg.data.shuffle_seed, [(s.weight, s.weight_end) for s in sources])
    start, updates_done = 0, 0
    if ckpts:
        state = load_checkpoint(ckpts[-1], model, optimizer, scaler)
        start = state["step"]
        updates_done = start * (cfg.grpo.num_iterations if cfg.mode == "grpo" else 1)  # as far along as the steps are
        for group in optimizer.param_groups:  # Adam's moments from the checkpoint, its settings from the config
            group.update(lr=cfg.optim.lr, initial_lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                         weight_decay=cfg.optim.weight_decay)
        sampler.load_state(state["data_position"])
        print(f"[minigrpo] resumed from {ckpts[-1]} (step {start})", file=sys.stderr)
    elif args.resume:
        print(f"[minigrpo] no checkpoint in {run_dir}; starting from step 0", file=sys.stderr)
    # resumed: the schedule continues from the updates done, on the config's peak lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, updates), last_epoch=updates_done - 1)
    engine = None
    if cfg.rollout.engine == "vllm" and cfg.mode == "grpo" and not args.dry_run:  # a dry run checks, starts nothing
        engine = vllm_engine.VllmEngine(cfg, resolve_model_path(cfg.model), run_dir, pick_dtype(cfg.model.dtype, device),
                                        lora_rank=model.peft_config["default"].r, start=start)
    return Run(cfg, run_dir, rows, [s.label for s in sources], device, model, tokenizer, ref_copy, params, optimizer,
               scheduler, scaler, sampler, judges, start, engine, eval_rows)


def open_tracker(cfg: Config, run_dir: Path, resumed: bool):
    """run.report_to: the wandb or trackio module, initialised (the same run again on --resume), or
    None. Both take init(project, name, config, resume) and log(metrics, step); the config sent is
    the one saved to config.yaml, with extra_headers masked (keys live in env vars, never in it)."""
    if cfg.run.report_to == "none":
        return None
    tracker = importlib.import_module(cfg.run.report_to)
    options = {"project": cfg.run.project, "name": run_dir.name, "config": redacted(config_to_dict(cfg)),
               "resume": "allow" if resumed else "never"}
    if cfg.run.report_to == "wandb":  # wandb resumes by id: one per run directory
        options["id"] = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        options["resume"] = "allow"
    tracker.init(**options)
    return tracker


def held_out_metrics(r: Run) -> dict:
    """eval/* metrics: the held-out rows decoded as eval.py decodes them (eval.temperature, eval.num_samples)
    by the policy now, scored with the rewards (SFT: eval/loss, and these when it has rewards). The
    random state is set aside and restored, so a run with run.eval_every trains exactly as one without."""
    import eval as ev
    from sft import held_out_loss
    cfg, t0 = r.cfg, time.time()
    loss = {"eval/loss": held_out_loss(r)} if cfg.mode == "sft" else {}
    if not cfg.rewards:
        return loss | {"eval/seconds": time.time() - t0}
    was_training = r.model.training
    r.model.eval()
    with torch.random.fork_rng(devices=[r.device] if r.device.type == "cuda" else []):
        gen = ev.generate_rows(r.model, r.tokenizer, r.eval_rows, cfg)
    r.model.train(was_training)
    _, _, m = ev.score_rows(gen, r.eval_rows, cfg.eval.num_samples, cfg, cfg.data.assistant_prefix, r.judges)
    return loss | {f"eval/{k}": v for k, v in m.items() if isinstance(v, (int, float))} | {"eval/seconds": time.time() - t0}


NO_SIGNAL_WARN_AFTER = 5
NO_SIGNAL = ("[minigrpo] warning: in the last {n} steps no group's rewards differed (frac_reward_zero_std = 1), "
             "so every advantage was 0 and nothing was learned. Usually the model never earns the reward (a format it "
             "does not produce, say): give partial credit (a graded reward), force the reply's start "
             "(data.assistant_prefix), raise rollout.num_generations or temperature, or set rollout.resample_zero_std. "
             "run.stop_without_signal: N stops such a run.")


def flat_steps_at_end(metrics_path: Path) -> int:
    """How many of the logged steps, counted back from the last, had no learning signal (frac_reward_zero_std = 1)."""
    flags = [rec.get("frac_reward_zero_std") == 1.0 for _, _, rec in jsonl.read(metrics_path) if rec]
    return next((i for i, flat in enumerate(reversed(flags)) if not flat), len(flags))


def dry_run_report(r: Run) -> str:
    """What --dry-run prints: the data as loaded and the first row exactly as the model will see it."""
    cfg, row = r.cfg, r.rows[0]
    sources = ", ".join(f"{label} {n}" for label, n in zip(r.source_labels, r.sampler.sizes))
    shown = rollout.render_rows(r.tokenizer, [row], cfg.data)[0] + (row["target"] + r.tokenizer.eos_token if cfg.mode == "sft" else "")
    lines = [f"[dry-run] config, data, model and judges check out ({cfg.mode}); nothing was trained or written",
             f"  rows: {len(r.rows)} ({sources})", f"  longest: {check_lengths(cfg, r.rows, r.tokenizer)}",
             f"  trainable parameters: {sum(p.numel() for p in r.params) / 1e6:.2f}M on {r.device}"]
    lines += [f"  rewards: {', '.join(f'{s.name} x {s.weight:g}' for s in cfg.rewards)}"] if cfg.rewards else []
    lines += [f"  judges: {', '.join(r.judges)} (not called)"] if r.judges else []
    lines += [f"  held-out rows for run.eval_every: {len(r.eval_rows)}"] if r.eval_rows else []
    lines += [f"  gold ({cfg.data.answer_key}): {row.get(cfg.data.answer_key)!r}"] if cfg.data.answer_key and cfg.mode == "grpo" else []
    return "\n".join(lines + ["  row 0 as the model sees it" + (" (prompt, then the reply trained on):" if cfg.mode == "sft"
                                                                  else " (the completion follows):"), shown])


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        r = setup(args, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dry_run_report(r))
        return 0
    cfg, run_dir, start = r.cfg, r.run_dir, r.start
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    metrics_path, samples_path = run_dir / "metrics.jsonl", run_dir / "samples.jsonl"
    for p in (metrics_path, samples_path):
        keep_lines_up_to(p, start) if start else p.unlink(missing_ok=True)
    n_train = sum(p.numel() for p in r.params)
    print(f"[minigrpo] {cfg.model.name} on {r.device} ({pick_dtype(cfg.model.dtype, r.device)}), "
          f"{n_train / 1e6:.2f}M trainable params, {len(r.rows)} prompts, steps {start}->{cfg.run.steps}", file=sys.stderr)
    if r.engine:
        r.engine.sync(r.model)  # vLLM starts from the policy as loaded (or resumed)
    from sft import sft_step  # sft.py imports from this module: import it late
    step_fn = sft_step if cfg.mode == "sft" else train_step
    flat_steps = flat_steps_at_end(metrics_path)  # steps in a row without a learning signal (a resumed run's too)
    tracker = open_tracker(cfg, run_dir, resumed=start > 0)
    with progress_display(cfg.run.steps, start) as show:
        for step in range(start + 1, cfg.run.steps + 1):
            r.sampler.progress = (step - 1) / max(1, cfg.run.steps - 1)  # a mixture's curriculum clock
            metrics, shown = step_fn(r)
            metrics = {"step": step, **metrics}
            if r.eval_rows and step % cfg.run.eval_every == 0:
                metrics |= held_out_metrics(r)
            jsonl.append(metrics_path, [metrics])
            if tracker:
                tracker.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
            if cfg.run.sample_every and step % cfg.run.sample_every == 0:
                jsonl.append(samples_path, [{"step": step, **s} for s in shown[: cfg.run.samples_per_log]])
            flat_steps = flat_steps + 1 if metrics.get("frac_reward_zero_std") == 1.0 else 0
            stop = cfg.run.stop_without_signal and flat_steps >= cfg.run.stop_without_signal
            if stop or step == cfg.run.steps or (cfg.run.save_every and step % cfg.run.save_every == 0):
                save_checkpoint(r, step)
            show(step, metrics)
            if flat_steps == NO_SIGNAL_WARN_AFTER or (stop and flat_steps < NO_SIGNAL_WARN_AFTER):
                skipped = metrics.get("frac_reward_skipped", 0.0)
                print(NO_SIGNAL.format(n=flat_steps) + (f" This step {skipped:.0%} of the completions had no reward "
                      "(fallback: skip): a judge or rating outage? See reward_errors/* and judge_failures." if skipped
                      else ""), file=sys.stderr)
            if stop:
                print(f"[minigrpo] stopped at step {step} (run.stop_without_signal={cfg.run.stop_without_signal}); "
                      f"checkpoint saved in {run_dir}", file=sys.stderr)
                if tracker:
                    tracker.finish()
                return 3
    if tracker:
        tracker.finish()
    print(f"[minigrpo] done: {run_dir}", file=sys.stderr)
    return 0


class progress_display:
    """A rich progress bar with ETA and a live metrics line on a terminal; plain lines otherwise."""

    def __init__(self, total: int, start: int):
        self.total, self.start = total, start
        self.progress = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(bar_width=20),
                                     TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.description}"))

    def __enter__(self):
        if self.progress:
            self.progress.start()
            self.task = self.progress.add_task("", total=self.total, completed=self.start)
        return self.show

    def show(self, step: int, m: dict) -> None:
        if self.progress:
            keys = ("reward", "reward_std", "eval/reward", "kl", "completions/mean_length") if "reward_std" in m else ("loss", "epoch")
            short = format_line(step, self.total, m, keys).split(" | ", 1)[1].replace(" | ", "  ")
            self.progress.update(self.task, completed=step, description=short)
        else:
            print(format_line(step, self.total, m), flush=True)

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()


if __name__ == "__main__":
    sys.exit(main())
