"""The report of an ablation (tools/ablate.py): report.md, report.json and plots/ in its folder.

Per run, from its metrics.jsonl: the final window (the last 20% of its steps, at least one) gives
`reward` and each `rewards/NAME/mean` as their means over it; `reward_all_steps` is the mean
reward over every step (how fast a run learned: the final window cannot tell two arms apart once
both reach the reward's ceiling); `step_time` is the mean over all steps, `peak_memory_mb` the
largest; --eval adds eval.py's held-out metrics as `heldout/NAME`.
Per arm, over its finished seeds: the mean and the 95% t interval (scipy.stats.t.interval with
scipy.stats.sem). Per other arm, against the first, over the seeds both finished: the paired
difference, its 95% interval (scipy.stats.ttest_rel(...).confidence_interval()) and a sentence:
"none - group: +0.07 (95% CI -0.02 to +0.16) on held-out accuracy: not resolved at 4 seeds".
Curves: per metric, each arm's mean over seeds at each step with its 95% interval as a band
(matplotlib; without it, a note in the report). Equal compute: each run's cumulative generated
tokens (rollout_tokens_per_s x rollout_time, step by step) put `reward` on a token axis, drawn
beside reward by step, and `reward_at_equal_tokens` is each run's mean reward over the last 20% of
the tokens every finished run reached (interpolated), compared like any metric. --plan adds the
seeds each difference needs (tools/ablate_plan.py).
"""
from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import numpy as np
from scipy import stats

from run import health
from tools import ablate_plan
from tools.plots import is_number, pyplot, read_metrics, save

FINAL_WINDOW = 0.2  # the last share of steps (or of tokens) the final-window metrics average
TOKEN_GRID = 50  # points of the generated-tokens axis the seeds are interpolated onto
CONFIDENCE = 0.95
NOT_METRICS = re.compile(r"(^|/)(n|n_\w+|seconds)$")  # eval.py's counts and times


def last_step(run_dir: Path) -> int:
    """The last step in run_dir/metrics.jsonl (0: none)."""
    try:
        recs, _ = read_metrics(str(run_dir))
    except ValueError:
        return 0
    return int(recs[-1]["step"]) if recs else 0


def run_metrics(run_dir: Path) -> dict[str, float]:
    """A finished run's numbers, as the module docstring defines them."""
    recs, _ = read_metrics(str(run_dir))
    window = recs[-max(1, math.ceil(FINAL_WINDOW * len(recs))):]
    keys = ["reward", *sorted({k for r in recs for k in r if re.fullmatch(r"rewards/.+/mean", k)})]
    out = {k: float(np.mean(v)) for k in keys
           if (v := [r[k] for r in window if is_number(r.get(k))])}
    if rewards := [r["reward"] for r in recs if is_number(r.get("reward"))]:
        out["reward_all_steps"] = float(np.mean(rewards))
    if times := [r["step_time"] for r in recs if is_number(r.get("step_time"))]:
        out["step_time"] = float(np.mean(times))
    if peaks := [r["peak_memory_mb"] for r in recs if is_number(r.get("peak_memory_mb"))]:
        out["peak_memory_mb"] = float(max(peaks))
    try:
        models = json.loads((run_dir / "eval" / "results.json").read_text())["models"]
    except (OSError, ValueError, KeyError):
        return out
    for model in models.values():
        out |= {f"heldout/{k}": float(v) for k, v in model.get("metrics", {}).items()
                if is_number(v) and not NOT_METRICS.search(k)}
    return out


def interval(values) -> dict:
    """Mean and 95% t interval over seeds; no interval from one value, a point from equal ones."""
    x = np.asarray(values, dtype=float)
    out = {"mean": float(x.mean()), "n": len(x), "ci": None}
    if len(x) > 1:
        sem = stats.sem(x)
        lo, hi = (out["mean"], out["mean"]) if sem == 0 else stats.t.interval(
            CONFIDENCE, len(x) - 1, loc=x.mean(), scale=sem)
        out["ci"] = [float(lo), float(hi)]
    return out


def paired(arm_values, base_values) -> dict:
    """arm - base over paired seeds: the mean difference, its 95% interval (paired t) and the
    per-seed differences (the planner's spread)."""
    a, b = np.asarray(arm_values, dtype=float), np.asarray(base_values, dtype=float)
    d = a - b
    out = {"mean": float(d.mean()), "n": len(d), "ci": None, "values": d.tolist()}
    if len(d) > 1:
        if np.ptp(d) == 0:  # scipy's t is undefined without spread: the difference is exact
            out["ci"] = [out["mean"], out["mean"]]
        else:
            ci = stats.ttest_rel(a, b).confidence_interval(CONFIDENCE)
            out["ci"] = [float(ci.low), float(ci.high)]
    return out


LABELS = {"reward": "final-window train reward", "reward_all_steps": "train reward over all steps",
          "reward_at_equal_tokens": "train reward at equal generated tokens",
          "step_time": "step time (s)", "peak_memory_mb": "peak memory (MB)"}


def label(metric: str) -> str:
    """How a sentence names a metric."""
    if m := re.fullmatch(r"rewards/(.+)/mean", metric):
        return f"final-window {m.group(1)}"
    if metric.startswith("heldout/"):
        return "held-out " + metric.removeprefix("heldout/")
    return LABELS.get(metric, metric)


def num(v: float) -> str:
    return f"{v:+.2f}" if 0.01 <= abs(v) < 1000 else f"{v:+.3g}"


def sentence(arm: str, base: str, metric: str, diff: dict) -> str:
    """The paired difference said plainly; 'not resolved' when its interval holds 0.

    >>> sentence("none", "group", "heldout/accuracy", {"mean": .07, "n": 4, "ci": [-.02, .16]})
    'none - group: +0.07 (95% CI -0.02 to +0.16) on held-out accuracy: not resolved at 4 seeds'
    """
    head = f"{arm} - {base}: {num(diff['mean'])}"
    if diff["ci"] is None:
        return f"{head} on {label(metric)}: one paired seed, no interval"
    lo, hi = diff["ci"]
    verdict = ("the same" if lo == hi == 0 else "not resolved" if lo <= 0 <= hi
               else f"{arm} {'higher' if diff['mean'] > 0 else 'lower'}")
    return (f"{head} (95% CI {num(lo)} to {num(hi)}) on {label(metric)}: "
            f"{verdict} at {diff['n']} seeds")


def summarize(runs) -> tuple[dict, list[dict], dict]:
    """-> (per arm {metric: interval}, paired differences from the first arm, per run metrics)."""
    arms = list(dict.fromkeys(r.arm.name for r in runs))
    per_run = {(r.arm.name, r.seed): run_metrics(r.dir) for r in runs if r.status == "finished"}
    add_equal_tokens(per_run, runs)
    metrics = list(dict.fromkeys(k for m in per_run.values() for k in m))
    table = {arm: {k: interval(v) for k in metrics
                   if (v := [m[k] for (a, _), m in per_run.items() if a == arm and k in m])}
             for arm in arms}
    diffs = []
    for arm in arms[1:]:
        for k in metrics:
            seeds = sorted(s for (a, s), m in per_run.items() if a == arm and k in m
                           and k in per_run.get((arms[0], s), {}))
            if seeds:
                d = paired([per_run[arm, s][k] for s in seeds],
                           [per_run[arms[0], s][k] for s in seeds])
                diffs.append({"arm": arm, "baseline": arms[0], "metric": k, **d,
                              "sentence": sentence(arm, arms[0], k, d)})
    return table, diffs, per_run


def add_equal_tokens(per_run: dict, runs) -> None:
    """reward_at_equal_tokens into each finished run's metrics: its mean reward over the last
    FINAL_WINDOW of the tokens every finished run generated (none when a run does not log them)."""
    by_tokens = {(r.arm.name, r.seed): token_curve(r.dir) for r in runs if r.status == "finished"}
    if not by_tokens or any(c is None for c in by_tokens.values()):
        return
    budget = min(float(c[0][-1]) for c in by_tokens.values())  # what every run generated
    grid = np.linspace((1 - FINAL_WINDOW) * budget, budget, TOKEN_GRID)
    for key, (x, y) in by_tokens.items():
        per_run[key]["reward_at_equal_tokens"] = float(np.interp(grid, x, y).mean())


def token_curve(run_dir: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(cumulative generated tokens, reward) at each step of a run, or None when its metrics do
    not give the tokens (rollout_tokens_per_s x rollout_time, the completion tokens sampled)."""
    recs, _ = read_metrics(str(run_dir))
    rows = [(r["rollout_tokens_per_s"] * r["rollout_time"], r["reward"]) for r in recs
            if all(is_number(r.get(k)) for k in ("rollout_tokens_per_s", "rollout_time", "reward"))]
    if len(rows) < len(recs) or not rows:
        return None
    tokens, reward = np.array(rows).T  # (steps,) each
    return np.cumsum(tokens), reward


def token_plot(out: Path, runs) -> Path | None:
    """reward against generated tokens: each arm's mean over its finished seeds, interpolated onto
    one token axis up to what every run reached, with its 95% band."""
    plt = pyplot()
    logs = {}
    for r in runs:
        if r.status == "finished" and (c := token_curve(r.dir)) is not None:
            logs.setdefault(r.arm.name, []).append(c)
    if plt is None or not logs:
        return None
    grid = np.linspace(0, min(float(x[-1]) for seeds in logs.values() for x, _ in seeds),
                       TOKEN_GRID)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (arm, seeds) in enumerate(logs.items()):
        y = np.array([np.interp(grid, x, r) for x, r in seeds])  # (seeds, grid)
        ax.plot(grid, y.mean(0), color=f"C{i % 10}", label=f"{arm} (n={len(y)})")
        if len(y) > 1:
            half = stats.sem(y, axis=0) * stats.t.ppf(0.5 + CONFIDENCE / 2, len(y) - 1)
            ax.fill_between(grid, y.mean(0) - half, y.mean(0) + half, color=f"C{i % 10}",
                            alpha=0.2, lw=0)
    ax.set(title="reward by generated tokens (equal compute): mean over seeds, 95% CI band",
           xlabel="completion tokens generated", ylabel="reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    (out / "plots").mkdir(parents=True, exist_ok=True)
    return save(plt, fig, out / "plots", "reward_by_tokens")


def curves(out: Path, runs, metrics: list[str]) -> tuple[list[Path], str]:
    """One PNG per metric: each arm's mean over its finished seeds per step, a 95% band."""
    plt = pyplot()
    if plt is None:
        return [], "no curves: matplotlib is not installed (pip install matplotlib)"
    logs = {}
    for r in runs:
        if r.status == "finished":
            logs.setdefault(r.arm.name, []).append(read_metrics(str(r.dir))[0])
    written = []
    (out / "plots").mkdir(parents=True, exist_ok=True)
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for i, (arm, seeds) in enumerate(logs.items()):
            by_step = [{r["step"]: r[metric] for r in recs if is_number(r.get(metric))}
                       for recs in seeds]
            steps = sorted(set.intersection(*(set(s) for s in by_step)))
            if not steps:
                continue
            y = np.array([[s[t] for t in steps] for s in by_step])  # (seeds, steps)
            ax.plot(steps, y.mean(0), color=f"C{i % 10}", label=f"{arm} (n={len(y)})")
            if len(y) > 1:
                half = stats.sem(y, axis=0) * stats.t.ppf(0.5 + CONFIDENCE / 2, len(y) - 1)
                ax.fill_between(steps, y.mean(0) - half, y.mean(0) + half, color=f"C{i % 10}",
                                alpha=0.2, lw=0)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set(title=f"{metric}: mean over seeds, 95% CI band", xlabel="step", ylabel=metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        written.append(save(plt, fig, out / "plots", metric))
    return written, ""


def cell(iv: dict | None) -> str:
    if iv is None:
        return ""
    lo_hi = f" ({iv['ci'][0]:.3g} to {iv['ci'][1]:.3g})" if iv["ci"] else ""
    return f"{iv['mean']:.3g}{lo_hi}"


def write(out: Path, runs, args, wall_seconds: float, pace: tuple[float, int] = (0.0, 1)) -> Path:
    """report.md, report.json and plots/ in `out` -> report.md's path. pace: (a run's mean wall
    seconds, runs at a time), for --plan's hours."""
    table, diffs, per_run = summarize(runs)
    arms = list(table)
    plot_metrics = args.plot or ["reward", *sorted(
        {k for m in per_run.values() for k in m if re.fullmatch(r"rewards/.+/mean", k)})]
    pngs, note = curves(out, runs, plot_metrics)
    by_tokens = None if note else token_plot(out, runs)
    plan = None if getattr(args, "plan", None) is None else ablate_plan.plan(
        diffs, dict(args.plan), pace[0], len(arms), pace[1])
    health_lines = {(r.arm.name, r.seed): health.summary_of(r.dir) for r in runs
                    if (r.dir / "metrics.jsonl").is_file()}
    rows = [{"arm": r.arm.name, "seed": r.seed, "dir": str(r.dir), "status": r.status,
             "exit_code": r.exit_code, "eval_exit_code": r.eval_exit,
             "metrics": per_run.get((r.arm.name, r.seed)),
             "health": health_lines.get((r.arm.name, r.seed), [])} for r in runs]
    pngs += [by_tokens] if by_tokens else []
    report = {"config": args.config, "seeds": args.seeds, "vary_data": args.vary_data,
              "arms": {r.arm.name: r.arm.overrides for r in runs},
              "wall_seconds": round(wall_seconds, 1), "final_window": FINAL_WINDOW,
              "confidence": CONFIDENCE, "runs": rows, "arms_summary": table, "paired": diffs,
              "plots": [str(p.relative_to(out)) for p in pngs],
              **({} if plan is None else {"plan": plan})}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(report, args, wall_seconds) + plan_lines(plan) + (
        [note, ""] if note else image_lines(out, pngs) + [""])
    (out / "report.md").write_text("\n".join(md))
    return out / "report.md"


def markdown(report: dict, args, wall_seconds: float) -> list[str]:
    """report.md's lines up to the plan: the command, the arms, the runs, each arm's intervals,
    the paired differences."""
    table, rows, arms = report["arms_summary"], report["runs"], list(report["arms_summary"])
    metrics = list(dict.fromkeys(k for arm in arms for k in table[arm]))
    return [f"# Ablation of {args.config}: {len(arms)} arms x {args.seeds} seeds", "",
            f"`python -m tools.ablate {shlex.join(args.argv)}`", "",
            *[f"- **{a}**: `{' '.join(o) or '(the config as is)'}`"
              for a, o in report["arms"].items()],
            "", f"Wall time {wall_seconds / 60:.1f} min. Data order: "
            + ("data.shuffle_seed = the seed." if args.vary_data else "the same for every seed."),
            "", "## Runs", "", "| arm | seed | status | exit | health |", "|---|---|---|---|---|",
            *[f"| {r['arm']} | {r['seed']} | {r['status']} | {r['exit_code']} | "
              f"{'; '.join(r['health']) or ('ok' if r['metrics'] else '')} |" for r in rows],
            "", f"## Each arm: mean over seeds ({CONFIDENCE:.0%} CI)", "",
            "Over the finished runs only. Final window: the last 20% of each run's steps.", "",
            "| metric | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms),
            *[f"| {label(k)} | " + " | ".join(cell(table[a].get(k)) for a in arms) + " |"
              for k in metrics],
            "", f"## Paired against {arms[0] if arms else '-'}", "",
            *[f"- {d['sentence']}" for d in report["paired"]], ""]


def plan_lines(plan: list[dict] | None) -> list[str]:
    """The "Seeds needed" section (--plan), or nothing."""
    if plan is None:
        return []
    said = [f"- {line}" for line in ablate_plan.lines(plan, label)]
    return ["## Seeds needed (--plan)", "",
            *(said or ["- no paired metric with two or more seeds to plan from"]), ""]


def image_lines(out: Path, pngs: list[Path]) -> list[str]:
    """One image a line; reward by generated tokens on reward by step's line (side by side)."""
    lines = [f"![{p.stem}]({p.relative_to(out)})" for p in pngs if p.stem != "reward_by_tokens"]
    pair = [f"![reward by generated tokens]({p.relative_to(out)})" for p in pngs
            if p.stem == "reward_by_tokens"]
    if pair and "![reward](plots/reward.png)" in lines:
        return [f"{line} {pair[0]}" if line == "![reward](plots/reward.png)" else line
                for line in lines]
    return lines + pair
