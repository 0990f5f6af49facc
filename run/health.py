"""Run health: one line for what looks wrong in a run's metrics and what to try, said in training
when a check first fires (with the step where it began) and again in a summary at the end; and the
run stopped, in one line, when a step shows what no later step fixes (STOPS).

    monitor = Monitor(cfg.health, cfg.run.steps, metrics_path)  # the logged steps, when resumed
    say(monitor.after_step(metrics))   # each step: the lines of checks that fired at this step
    if monitor.stop: ...               # a STOPS check fired at this step: train.py stops the run
    say(monitor.summary())             # at the end: every check that fired, or nothing

Each check is a plain function of the metrics so far (one dict per step, as in metrics.jsonl), the
thresholds (config.HealthConfig, the `health:` section) and run.steps -> (the step where the
problem began, its line) or None. All groups flat is train.py's own warning (run/display.py).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from config import HealthConfig
from files import jsonl


def streak(history: list[dict], holds) -> list[dict]:
    """The steps at the end of history for which holds(step's metrics) is true, in a row."""
    out = []
    for m in reversed(history):
        if not holds(m):
            break
        out.append(m)
    return out[::-1]


def truncated(history: list[dict], h: HealthConfig, steps: int):
    share = lambda m: m.get("completions/clipped_ratio", 0.0)  # noqa: E731
    run = streak(history, lambda m: share(m) >= h.truncated_share)
    if len(run) >= h.patience:
        return run[0]["step"], (
            f"most completions truncated since step {run[0]['step']} (completions/clipped_ratio "
            f"{share(run[-1]):.2f} >= health.truncated_share {h.truncated_share:g}): raise "
            "rollout.max_new_tokens, or reward ending sooner")


def entropy_collapsed(history: list[dict], h: HealthConfig, steps: int):
    m = history[-1]
    early = m["step"] <= h.early_share * steps
    if early and "entropy" in m and m["entropy"] < h.entropy_floor:
        return m["step"], (
            f"entropy collapsed early: {m['entropy']:.3f} at step {m['step']} of {steps} "
            f"(< health.entropy_floor {h.entropy_floor:g} in the first {h.early_share:.0%}): the "
            "policy stopped exploring; lower optim.lr, raise rollout.temperature or grpo.beta")


def length_without_reward(history: list[dict], h: HealthConfig, steps: int):
    w = h.window
    recent, before = history[-w:], history[-2 * w:-w]
    if len(before) < w:
        return None
    mean = lambda ms, k: sum(m.get(k, 0.0) for m in ms) / len(ms)  # noqa: E731
    grew = mean(recent, "completions/mean_length") / max(mean(before, "completions/mean_length"),
                                                         1e-9)
    gained = mean(recent, "reward") - mean(before, "reward")
    if grew >= h.length_growth and gained <= h.reward_gain:
        return before[0]["step"], (
            f"length growing without reward since step {before[0]['step']}: mean length x{grew:.2f}"
            f" over {w} steps (>= health.length_growth {h.length_growth:g}), reward "
            f"{gained:+.3f}: a reward pays for length, or the run drifts; check the rewards, "
            "try grpo.loss_type dr_grpo or a length_penalty")


def clip_or_kl(history: list[dict], h: HealthConfig, steps: int):
    m = history[-1]
    clip, kl = m.get("clip_ratio/region_mean", 0.0), m.get("kl", 0.0)
    if clip > h.clip_max:
        return m["step"], (
            f"clip fraction {clip:.3f} at step {m['step']} (> health.clip_max {h.clip_max:g}): "
            "each update moves the policy past the clip; lower optim.lr, or fewer "
            "grpo.num_iterations / num_mini_batches")
    if kl > h.kl_max:
        return m["step"], (
            f"KL to the reference {kl:.3f} at step {m['step']} (> health.kl_max {h.kl_max:g}): "
            "the policy drifts far from the base; raise grpo.beta or lower optim.lr")


def not_finite(history: list[dict], h: HealthConfig, steps: int):
    m = history[-1]
    bad = sorted(k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v))
    if m.get("skipped_updates") or bad:
        what = (f"{m['skipped_updates']} update(s) skipped on a non-finite gradient"
                if m.get("skipped_updates") else f"non-finite {', '.join(bad)}")
        return m["step"], (
            f"{what} at step {m['step']}: lower optim.lr, use bf16 rather than fp16, and check "
            "the rewards for NaN")


def judge_failing(history: list[dict], h: HealthConfig, steps: int):
    recent = history[-h.window:]
    if len(recent) < h.window:
        return None
    for key in sorted(k for k in history[-1] if k == "judge_failures"
                      or k.startswith("judges/") and k.endswith("/failures")):
        prefix = key[:-len("failures")]  # judge_ (the judge: section) or judges/<name>/
        failed = sum(m.get(key, 0.0) for m in recent)
        calls = sum(m.get(f"{prefix}calls", 0.0) for m in recent)
        if calls and failed / calls > h.judge_failure_share:
            began = next(m["step"] for m in recent if m.get(key, 0.0) > h.judge_failure_share
                         * m.get(f"{prefix}calls", 0.0))
            name = "the judge" if prefix == "judge_" else f"judge {prefix[7:-1]}"
            what = (f"{failed:g} of {calls:g} calls over the last {h.window} steps ({key}, > "
                    f"health.judge_failure_share {h.judge_failure_share:g})")
            return began, (f"{name} failing since step {began}: {what}; rewards fall back: check "
                           "its endpoint, key and rate limits (reward_errors/*), or lower "
                           "judge.max_concurrent")


def held_out_falling(history: list[dict], h: HealthConfig, steps: int):
    m = history[-1]
    key = next((k for k in ("eval/reward", "eval/accuracy") if k in m), None)
    n = max(2, h.eval_points)
    points = [e for e in history if key in e][-n:] if key else []
    if len(points) < n:
        return None
    held = [e[key] for e in points]
    fell = held[0] - held[-1]
    mean = lambda ms: sum(x.get("reward", 0.0) for x in ms) / len(ms)  # noqa: E731
    upto = lambda e: [x for x in history if x["step"] <= e["step"]][-h.window:]  # noqa: E731
    rose = mean(upto(points[-1])) - mean(upto(points[0]))
    if fell > h.eval_drop and all(b <= a for a, b in zip(held, held[1:])) and rose > 0:
        return points[0]["step"], (
            f"train reward rising while held-out falls since step {points[0]['step']}: {key} "
            f"{held[0]:.3f} -> {held[-1]:.3f} over {len(points)} evaluations (fell > "
            f"health.eval_drop {h.eval_drop:g}), reward {rose:+.3f}: overfitting or reward "
            "hacking; read samples.jsonl, keep an earlier checkpoint, lower optim.lr or run.steps")


def sampler_gap(history: list[dict], h: HealthConfig, steps: int):
    """The sampler's log-probs far from the trainer's (sampler_logp_abs_diff, logged by every
    sampler that records them: vLLM, HF generate merged or compiled): it samples another policy
    than the one trained, e.g. a vLLM that lost the LoRA adapter after waking from sleep (vLLM
    issue 53888) serving the bare base. Precision alone gives ~0.015 nats a token in bf16
    (docs/gpu.md); vLLM's log-probs after a top-p filter add up to -log(top_p) a token."""
    m = history[-1]
    gap = m.get("sampler_logp_abs_diff")
    if h.sampler_gap_max and gap is not None and gap > h.sampler_gap_max:
        return m["step"], (
            f"the sampler is not sampling the policy being trained: sampler_logp_abs_diff "
            f"{gap:.3f} nats a token at step {m['step']} (> health.sampler_gap_max "
            f"{h.sampler_gap_max:g}; bf16 alone gives ~0.015): a vLLM that lost its LoRA adapter "
            "(try rollout.vllm_sleep: false); with rollout.top_p < 1 or top_k, vLLM's log-probs "
            "are taken after the filter: raise health.sampler_gap_max")


STOPS = {"sampler_gap": sampler_gap}  # what no later step fixes: each step, the run stops

CHECKS = {"truncated": truncated, "entropy": entropy_collapsed, "length": length_without_reward,
          "clip_kl": clip_or_kl, "not_finite": not_finite, "judge": judge_failing,
          "held_out": held_out_falling}


class Monitor:
    """The checks over a run's steps; each says its line once, the first time it fires."""

    def __init__(self, h: HealthConfig, steps: int, metrics_path: Path | None = None):
        self.h, self.steps, self.stop = h, steps, None
        self.history = [rec for _, _, rec in (jsonl.read(metrics_path) if metrics_path else [])
                        if rec and "step" in rec]
        self.fired: dict[str, str] = {}
        for i in range(len(self.history)):  # a resumed run's earlier steps, silently
            self.check(self.history[:i + 1])

    def check(self, history: list[dict]) -> list[str]:
        new = []
        for name, fn in CHECKS.items():
            if self.h.enabled and name not in self.fired and (found := fn(history, self.h,
                                                                          self.steps)):
                self.fired[name] = found[1]
                new.append(found[1])
        return new

    def after_step(self, metrics: dict) -> list[str]:
        """The lines of the checks that fire first at this step; self.stop: the line of a STOPS
        check that fires at it (each step, a resumed run's too), else None."""
        self.history.append(metrics)
        found = [f(self.history, self.h, self.steps) for f in STOPS.values()] if self.h.enabled \
            else []
        self.stop = next((hit[1] for hit in found if hit), None)
        return self.check(self.history)

    def summary(self) -> list[str]:
        return [f"health: {line}" for line in self.fired.values()]


def say(lines: list[str]) -> None:
    for line in lines:
        print(f"[minigrpo] {line}", file=sys.stderr)


def run_config(run_dir: Path) -> Path:
    """The config a run last ran with: its newest config_resumed_step_*.yaml, else config.yaml."""
    return max(run_dir.glob("config_resumed_step_*.yaml"), default=run_dir / "config.yaml")


def summary_of(run_dir: Path) -> list[str]:
    """A run's health lines from its folder (metrics.jsonl, its config): the ablation report's."""
    from config import load_config
    try:
        cfg = load_config(run_config(run_dir))
        h, steps = cfg.health, cfg.run.steps
    except (OSError, ValueError):
        h, steps = HealthConfig(), 0
    monitor = Monitor(h, steps, run_dir / "metrics.jsonl")
    return list(monitor.fired.values())
