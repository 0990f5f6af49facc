"""Train a policy with GRPO. The loop: sample B prompts x G completions, score them, turn rewards
into group advantages, and take num_iterations clipped-surrogate updates on the LoRA weights.

    python train.py --config configs/quickstart.yaml
    python train.py --config configs/quickstart.yaml --grpo.beta=0.04 --rollout.num_generations=8
    python train.py --config configs/quickstart.yaml --resume      # continue from the last checkpoint

A run directory (run.out_dir) receives config.yaml, metrics.jsonl (one line per step),
samples.jsonl (completions with their rewards) and checkpoints/step_NNNNNN/ (adapter, optimizer,
scheduler, RNG states, data position; written to a .tmp directory and renamed, so a kill never
leaves a half checkpoint). Bad input exits with code 2 and one line saying what to fix.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

import grpo
from config import Config, ConfigError, config_to_dict, load_config, save_config
from data import PromptSampler, load_rows
from model import load_policy, pick_device, pick_dtype, is_peft, reference_mode, trainable_parameters
from judge import Judge
from rewards import check_specs, compute_rewards, resolve, reward_means


# ----------------------------------------------------------------------------- run directory


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a .tmp directory is an interrupted write)."""
    d = run_dir / "checkpoints"
    return sorted(p for p in d.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")) if d.is_dir() else []


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, scaler, sampler: PromptSampler,
                    cfg: Config) -> Path:
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / ("adapter" if is_peft(model) else "model"))
    torch.save({
        "step": step, "data_position": sampler.position,
        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler else None,
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }, tmp / "trainer_state.pt")
    save_config(cfg, tmp / "config.yaml")
    shutil.rmtree(final, ignore_errors=True)
    tmp.replace(final)
    for old in checkpoints(run_dir)[: -cfg.run.keep_checkpoints or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(ckpt: Path, model, optimizer, scheduler, scaler) -> dict:
    from safetensors.torch import load_file
    if is_peft(model):
        from peft import set_peft_model_state_dict
        set_peft_model_state_dict(model, load_file(ckpt / "adapter" / "adapter_model.safetensors"))
    else:
        state = {}
        for f in sorted((ckpt / "model").glob("*.safetensors")):
            state.update(load_file(f))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(k for k in missing if "lm_head" not in k):
            raise ConfigError(f"checkpoint {ckpt} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def keep_lines_up_to(path: Path, step: int) -> None:
    """On resume, drop log lines of steps after the checkpoint (they will be redone). Atomic rewrite."""
    if not path.exists():
        return
    kept = [ln for ln in path.read_text().splitlines() if ln.strip() and _step_of(ln) is not None and _step_of(ln) <= step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    tmp.replace(path)


def _step_of(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None  # a line torn by a kill


def append_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


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


def collect(cfg: Config, model, tokenizer, rows: list[dict], sampler: PromptSampler, judge: Judge | None):
    """Sample and score B groups. With rollout.resample_zero_std, groups whose rewards are all equal
    are set aside and more prompts drawn until B groups carry signal or the cap is reached
    (set-aside groups then fill the batch). Reward statistics cover every group drawn."""
    ro, B, G = cfg.rollout, cfg.rollout.prompts_per_step, cfg.rollout.num_generations
    cap = ro.max_prompts_per_step or 4 * B
    kept, spare, drawn_parts, drawn = [], [], [], 0
    while True:
        idx = sampler.draw(B - len(kept) if ro.resample_zero_std else B)
        drawn += len(idx)
        samples = [rows[i] for i in idx for _ in range(G)]
        prompts = [grpo.render_prompt(tokenizer, rows[i]["prompt"], cfg.data.system_prompt, cfg.data.assistant_prefix) for i in idx]
        r = grpo.generate_rollout(model, tokenizer, prompts, G, ro.max_new_tokens, ro.temperature, ro.top_p, ro.top_k,
                                  ro.stop_strings, ro.max_prompt_tokens)
        res = compute_rewards(r.texts, samples, cfg.rewards, num_tokens=r.completion_mask.sum(1).long().tolist(),
                              context={"assistant_prefix": cfg.data.assistant_prefix, "judge": judge})
        total = torch.tensor(res.total, dtype=torch.float32)  # (n,)
        zero = grpo.zero_std_groups(total, G, cfg.grpo.zero_std_tol)  # (n / G,)
        drawn_parts.append((r, samples, res, total, zero))
        groups = [(r, samples, total, g) for g in range(len(idx))]
        if not ro.resample_zero_std:
            kept = groups
            break
        kept += [x for x, z in zip(groups, zero.tolist()) if not z]
        spare += [x for x, z in zip(groups, zero.tolist()) if z]
        if len(kept) >= B or drawn >= cap:
            kept = (kept + spare)[:B]
            break
    rollouts = []
    for r, samples, total, g in kept:
        rollouts.append((grpo.select_rows(r, list(range(g * G, (g + 1) * G))), samples[g * G:(g + 1) * G], total[g * G:(g + 1) * G]))
    batch = grpo.concat_rollouts([x[0] for x in rollouts], tokenizer.pad_token_id)
    return batch, [s for x in rollouts for s in x[1]], torch.cat([x[2] for x in rollouts]), drawn_parts, drawn


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


@torch.no_grad()
def batch_log_probs(model, batch: grpo.Rollout, cfg: Config) -> torch.Tensor:
    """(N, C) log-probs of the sampled tokens, micro-batch by micro-batch, zero-padded past each row's end."""
    out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32, device=batch.completion_ids.device)
    ids, attn = batch.input_ids, batch.attention_mask
    for mb in micro_batches(ids.shape[0], cfg.optim.micro_batch_size):
        i, a, C = grpo.trim(ids[mb], attn[mb], batch.completion_mask[mb])
        out[mb, :C] = grpo.sequence_log_probs(model, i, a, C, cfg.rollout.temperature, cfg.grpo.logprob_chunk)
    return out


def train_step(cfg, model, ref_copy, tokenizer, rows, sampler, optimizer, scheduler, scaler, params,
               judge: Judge | None = None) -> tuple[dict, list[dict]]:
    t0 = time.time()
    G, g = cfg.rollout.num_generations, cfg.grpo
    batch, samples, rewards, drawn_parts, drawn = collect(cfg, model, tokenizer, rows, sampler, judge)
    t_rollout = time.time() - t0
    adv = grpo.group_advantages(rewards, G, g.scale_rewards, zero_std_tol=g.zero_std_tol).to(batch.completion_ids.device)  # (N,)
    mask = batch.completion_mask.clone()  # (N, C)
    if g.mask_truncated_completions:
        mask[batch.truncated] = 0
    old_logp = batch_log_probs(model, batch, cfg) if g.num_iterations > 1 else None  # (N, C) or on-policy
    ref_logp = None
    if g.beta > 0:
        with reference_mode(model, ref_copy) as ref:
            ref_logp = batch_log_probs(ref, batch, cfg)  # (N, C)
    N = batch.completion_ids.shape[0]
    mbs = micro_batches(N, cfg.optim.micro_batch_size)
    norm = grpo.LossNorm(g.loss_type, N, int(mask.sum()), cfg.rollout.max_new_tokens, len(mbs))
    ids, attn = batch.input_ids, batch.attention_mask
    sums = {k: 0.0 for k in ("loss", "tokens", "kl_sum", "ratio_sum", "clip_low_sum", "clip_high_sum", "grad_norm")}
    model.train()
    for _ in range(g.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        for mb in mbs:
            i, a, C = grpo.trim(ids[mb], attn[mb], batch.completion_mask[mb])
            logp = grpo.sequence_log_probs(model, i, a, C, cfg.rollout.temperature, g.logprob_chunk)  # (n, C)
            loss, stats = grpo.grpo_loss(
                logp, None if old_logp is None else old_logp[mb, :C], None if ref_logp is None else ref_logp[mb, :C],
                adv[mb], mask[mb, :C], norm, g.epsilon, g.epsilon_high, g.beta)
            (scaler.scale(loss) if scaler else loss).backward()
            sums["loss"] += float(loss.detach())
            for k, v in stats.items():
                sums[k] += v
        if scaler:
            scaler.unscale_(optimizer)
        gn = torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf"))
        sums["grad_norm"] += float(gn)
        lr = scheduler.get_last_lr()[0]
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
    mu, tok = g.num_iterations, max(sums["tokens"], 1.0)
    # reward statistics over every drawn completion (what the policy produced), not only the kept ones
    all_total = torch.cat([p[3] for p in drawn_parts])
    all_zero = torch.cat([p[4] for p in drawn_parts])
    lengths = torch.cat([p[0].completion_mask.sum(1) for p in drawn_parts])
    truncated = torch.cat([p[0].truncated for p in drawn_parts])
    per_reward = {}
    for p in drawn_parts:
        for name, vals in p[2].per_reward.items():
            per_reward.setdefault(name, []).extend(vals)
    errors = {}
    for p in drawn_parts:
        for name, n in p[2].errors.items():
            errors[name] = errors.get(name, 0) + n
    dt = time.time() - t0
    metrics = {
        "loss": sums["loss"] / mu,
        "reward": float(all_total.mean()), "reward_std": float(all_total.std()) if len(all_total) > 1 else 0.0,
        **{f"rewards/{k}/mean": v for k, v in reward_means(per_reward).items()},
        **{f"reward_errors/{k}": v for k, v in errors.items()},
        "frac_reward_zero_std": float(all_zero.float().mean()),
        "kl": sums["kl_sum"] / tok, "ratio_mean": sums["ratio_sum"] / tok,
        "clip_ratio/low_mean": sums["clip_low_sum"] / tok, "clip_ratio/high_mean": sums["clip_high_sum"] / tok,
        "clip_ratio/region_mean": (sums["clip_low_sum"] + sums["clip_high_sum"]) / tok,
        "completions/mean_length": float(lengths.float().mean()), "completions/max_length": int(lengths.max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
        "learning_rate": lr, "grad_norm": sums["grad_norm"] / mu,
        "prompts_drawn": drawn, "step_time": dt, "rollout_time": t_rollout,
        "rollout_tokens_per_s": float(lengths.sum()) / max(t_rollout, 1e-9),
        "peak_memory_mb": peak_memory_mb(batch.completion_ids.device),
        **(judge.pop_step_stats() if judge else {}),
    }
    shown = [{"prompt": s["prompt"], "completion": t, "reward": float(r), "advantage": float(a)}
             for s, t, r, a in zip(samples, batch.texts, rewards, adv)]
    return metrics, shown


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ----------------------------------------------------------------------------- CLI and loop


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Any config field: --section.key=value")
    ap.add_argument("--config", required=True, help="YAML config file")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in run.out_dir")
    return ap.parse_known_args(argv)


def format_line(step: int, total: int, m: dict) -> str:
    return (f"step {step}/{total} | reward {m['reward']:.3f} ± {m['reward_std']:.3f} | loss {m['loss']:+.4f} | "
            f"kl {m['kl']:.4f} | len {m['completions/mean_length']:.1f} | zero_std {m['frac_reward_zero_std']:.2f} | "
            f"lr {m['learning_rate']:.2e} | {m['step_time']:.1f}s")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(args, overrides: list[str]):
    """Everything that can fail on bad input, before the run directory is touched."""
    cfg = load_config(args.config, overrides)
    try:
        check_specs(cfg.rewards)
    except ValueError as e:
        raise ConfigError(f"rewards: {e}") from None
    needs_judge = [s.name for s in cfg.rewards if "judge" in inspect.signature(resolve(s)[0]).parameters]
    if needs_judge and cfg.judge is None:
        raise ConfigError(f"reward {needs_judge[0]} needs a judge: add a `judge:` section (base_url, model, api_key_env)")
    run_dir = Path(cfg.run.out_dir)
    if not args.resume and run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run.out_dir={run_dir} already holds a run; pass --resume to continue it or set another run.out_dir")
    rows = load_rows(cfg.data)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    device = pick_device(cfg.run.device)
    model, tokenizer = load_policy(cfg.model, cfg.lora, device)
    return cfg, run_dir, rows, device, model, tokenizer


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg, run_dir, rows, device, model, tokenizer = setup(args, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ref_copy = None
    if cfg.grpo.beta > 0 and not is_peft(model):  # full fine-tuning: the reference needs its own weights
        ref_copy = copy.deepcopy(model).eval().requires_grad_(False)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, cfg.run.steps * cfg.grpo.num_iterations))
    fp16 = device.type == "cuda" and pick_dtype(cfg.model.dtype, device) == torch.float16
    scaler = torch.amp.GradScaler("cuda") if fp16 else None  # fp16 gradients underflow without loss scaling
    sampler = PromptSampler(len(rows), cfg.data.shuffle_seed)
    judge = Judge(cfg.judge) if cfg.judge else None
    start = 0
    ckpts = checkpoints(run_dir) if args.resume else []
    if ckpts:
        state = load_checkpoint(ckpts[-1], model, optimizer, scheduler, scaler)
        start, sampler.position = state["step"], state["data_position"]
        print(f"[minigrpo] resumed from {ckpts[-1]} (step {start})", file=sys.stderr)
    elif args.resume:
        print(f"[minigrpo] no checkpoint in {run_dir}; starting from step 0", file=sys.stderr)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    metrics_path, samples_path = run_dir / "metrics.jsonl", run_dir / "samples.jsonl"
    for p in (metrics_path, samples_path):
        keep_lines_up_to(p, start) if start else p.unlink(missing_ok=True)
    n_train = sum(p.numel() for p in params)
    print(f"[minigrpo] {cfg.model.name} on {device} ({pick_dtype(cfg.model.dtype, device)}), "
          f"{n_train / 1e6:.2f}M trainable params, {len(rows)} prompts, steps {start}->{cfg.run.steps}", file=sys.stderr)
    with progress_display(cfg.run.steps, start) as show:
        for step in range(start + 1, cfg.run.steps + 1):
            metrics, shown = train_step(cfg, model, ref_copy, tokenizer, rows, sampler, optimizer, scheduler, scaler, params, judge)
            metrics = {"step": step, **metrics}
            append_jsonl(metrics_path, [metrics])
            if cfg.run.sample_every and step % cfg.run.sample_every == 0:
                append_jsonl(samples_path, [{"step": step, **s} for s in shown[: cfg.run.samples_per_log]])
            if step == cfg.run.steps or (cfg.run.save_every and step % cfg.run.save_every == 0):
                save_checkpoint(run_dir, step, model, optimizer, scheduler, scaler, sampler, cfg)
            show(step, metrics)
    if judge:
        judge.close()
    print(f"[minigrpo] done: {run_dir}", file=sys.stderr)
    return 0


class progress_display:
    """A rich progress bar with ETA and a live metrics line on a terminal; plain lines otherwise."""

    def __init__(self, total: int, start: int):
        self.total, self.start = total, start
        self.progress = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(), TimeElapsedColumn(),
                                     TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.description}"))

    def __enter__(self):
        if self.progress:
            self.progress.start()
            self.task = self.progress.add_task("", total=self.total, completed=self.start)
        return self.show

    def show(self, step: int, m: dict) -> None:
        if self.progress:
            self.progress.update(self.task, completed=step, description=format_line(step, self.total, m).split(" | ", 1)[1])
        else:
            print(format_line(step, self.total, m), flush=True)

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()


if __name__ == "__main__":
    sys.exit(main())
