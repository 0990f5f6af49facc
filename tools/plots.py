"""Training curves and eval bar charts as PNG files, one per metric.

    python -m tools.plots runs/a runs/b  # plots/reward.png, kl.png (beta > 0), ...: a line per run
    python -m tools.plots runs/a --metrics reward entropy --smooth 0.9 --out plots/a
    python -m tools.plots --eval runs/eval/results.json
        # plots/heldout_<metric>.png: a bar per model (not eval_: eval_every's are eval/<metric>)

Curves: each run's metrics.jsonl against `step`, labelled with the run directory's name. Default
metrics: reward, every rewards/<name>/mean, eval/reward and eval/accuracy (run.eval_every), kl,
entropy, completions/mean_length, clip_ratio (low_mean solid, high_mean dashed), DPO's
rewards/margins and rewards/accuracies (and their eval/ values), eval/loss (SFT, DPO),
learning_rate, loss, each skipped where no run logged it; a --metrics key that no run logged is an
error. Unparsable lines (the last one of a killed run) are skipped and counted; a step logged twice
keeps its last line. --smooth A draws the EMA s_t = A s_{t-1} + (1 - A) x_t, s_1 = x_1, over the
faint raw curve. Eval: the shape eval.py writes, {"models": {model: {"metrics": {metric: number}}}},
or flat {"models": {model: {metric: number}}}; non-numbers are skipped, and so are the counts n, n_*
and seconds unless --metrics names them.
matplotlib is an optional extra: without it, the pip command, exit 2. Bad input: one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from files import command
from settings.typed_config import ConfigError, check_writable

INSTALL_HINT = "plots need matplotlib: pip install matplotlib"
# drawn together, one line style each
GROUPS = {"clip_ratio": ("clip_ratio/low_mean", "clip_ratio/high_mean")}
STYLES = ("-", "--", ":", "-.")


class PlotError(ValueError):  # input the user must fix: one line, says what and where
    pass


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # no display needed, works over ssh and in CI
    import matplotlib.pyplot as plt
    return plt


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_metrics(path: str) -> tuple[list[dict], int]:
    """-> (one record per step in step order, number of lines skipped as unparsable)."""
    p = Path(path)
    f = p / "metrics.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise PlotError(f"{path}: no metrics.jsonl there; give a run directory or its "
                        "metrics.jsonl")
    by_step, skipped = {}, 0
    for i, line in enumerate(f.read_text(errors="replace").splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            skipped += bool(line.strip())
            continue
        step = rec.get("step", i + 1) if isinstance(rec, dict) else None
        if not is_number(step):
            skipped += 1
            continue
        by_step[step] = {**rec, "step": step}
    return [by_step[s] for s in sorted(by_step)], skipped


def run_labels(paths: list[str]) -> list[str]:
    """The run directory's name; the paths as given where two names collide."""
    names = [(Path(p).resolve() if Path(p).is_dir() else Path(p).resolve().parent).name
             for p in paths]
    return names if len(set(names)) == len(names) else paths


def ema(ys: list[float], alpha: float) -> list[float]:
    out, s = [], None
    for y in ys:
        s = y if s is None or not math.isfinite(s) else alpha * s + (1 - alpha) * y
        out.append(s)
    return out


def save(plt, fig, out: Path, metric: str, prefix: str = "") -> Path:
    # rewards/x/mean -> rewards_x_mean.png
    path = out / (prefix + re.sub(r"[^\w.-]+", "_", metric).strip("_") + ".png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(plt, runs: list[tuple[str, list[dict]]], metrics: list[str], out: Path,
                smooth: float) -> list[Path]:
    written = []
    for metric in metrics:
        keys = GROUPS.get(metric, (metric,))
        if not any(k in r for _, recs in runs for r in recs for k in keys):
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (label, recs) in enumerate(runs):
            for key, style in zip(keys, STYLES):
                points = [(r["step"], r[key]) for r in recs if is_number(r.get(key))]
                if not points:
                    continue
                xs, ys = zip(*points)
                name = (label if len(keys) == 1
                        else f"{label} {key.split('/')[-1].removesuffix('_mean')}")
                if smooth:
                    ax.plot(xs, ys, style, color=f"C{i % 10}", alpha=0.25, lw=1)
                    ys = ema(list(ys), smooth)
                ax.plot(xs, ys, style, color=f"C{i % 10}", label=name, lw=1.5)
        ax.set(title=metric + (f" (EMA {smooth:g})" if smooth else ""), xlabel="step",
               ylabel=metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        written.append(save(plt, fig, out, metric))
    return written


def read_eval(path: str) -> dict[str, dict[str, float]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlotError(f"--eval {path}: {e}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not models:
        raise PlotError(f'--eval {path}: expected {{"models": {{model: {{metric: number}}}}}}')
    # eval.py nests a model's numbers under "metrics" (beside kind and source); a flat one works too
    flat = {name: m.get("metrics", m) for name, m in models.items() if isinstance(m, dict)}
    return {name: {k: v for k, v in m.items() if is_number(v)}
            for name, m in flat.items() if isinstance(m, dict)}


def plot_eval(plt, models: dict[str, dict[str, float]], metrics: list[str],
              out: Path) -> list[Path]:
    written = []
    for metric in metrics:
        bars = [(name, m[metric]) for name, m in models.items() if metric in m]
        if not bars:
            continue
        fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(bars) + 2), 4))
        drawn = ax.bar([n for n, _ in bars], [v for _, v in bars],
                       color=[f"C{i % 10}" for i in range(len(bars))])
        ax.bar_label(drawn, fmt="%.3g")
        ax.set(title=metric, ylabel=metric)
        ax.tick_params(axis="x", labelrotation=20 if len(bars) > 3 else 0)
        ax.grid(axis="y", alpha=0.3)
        written.append(save(plt, fig, out, metric, "heldout_"))
    return written


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.plots", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="run directories (or their metrics.jsonl)")
    ap.add_argument("--eval", metavar="RESULTS_JSON", help="eval results: a bar chart per metric")
    ap.add_argument("--out", default="plots", help="directory for the PNG files")
    ap.add_argument("--metrics", nargs="+",
                    help="metric keys to draw (default: the curves listed above)")
    ap.add_argument("--smooth", type=float, default=0.0,
                    help="EMA weight A in [0, 1) for the curves (0: raw)")
    return ap.parse_args(sys.argv[1:] if argv is None else argv)


def read_runs(paths: list[str]) -> list[tuple[str, list[dict]]]:
    """(label, its records) per run, saying how many unparsable lines each skipped."""
    runs = []
    for path, label in zip(paths, run_labels(paths)):
        recs, skipped = read_metrics(path)
        if skipped:
            print(f"[minigrpo] {path}: skipped {skipped} unparsable line(s)", file=sys.stderr)
        runs.append((label, recs))
    return runs


def read_inputs(args: argparse.Namespace) -> tuple[list[tuple[str, list[dict]]], dict]:
    """-> (the runs' curves, the eval's numbers per model), every input checked before anything is
    drawn: PlotError (or ConfigError for --out) naming what to fix."""
    if not args.runs and not args.eval:
        raise PlotError("nothing to plot: give run directories and/or --eval results.json")
    if not 0 <= args.smooth < 1:
        raise PlotError(f"--smooth must be in [0, 1), got {args.smooth}")
    runs = read_runs(args.runs)
    models = read_eval(args.eval) if args.eval else {}
    logged = ({k for _, recs in runs for r in recs for k in r}
              | {k for m in models.values() for k in m})
    for m in args.metrics or []:
        if not set(GROUPS.get(m, (m,))) & logged:
            raise PlotError(f"no input logged metric {m!r}; "
                            f"logged: {', '.join(sorted(logged - {'step'}))}")
    for (_, recs), path in zip(runs, args.runs):
        if not recs:
            raise PlotError(f"{path}: no metrics lines to draw (a run killed before its first "
                            "step?)")
    if args.eval and not any(models.values()):
        raise PlotError(f"{args.eval}: no model has a numeric metric to draw")
    check_writable(args.out, "--out")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise PlotError(f"--out {args.out} is a file; give a directory for the PNG files")
    return runs, models


def default_curves(runs: list[tuple[str, list[dict]]]) -> list[str]:
    """The curves drawn without --metrics (the module docstring's list), in that order."""
    rewards = sorted({k for _, recs in runs for r in recs for k in r
                      if re.fullmatch(r"rewards/.+/mean", k)})
    return ["reward", *rewards, "eval/reward", "eval/accuracy", "kl", "entropy",
            "completions/mean_length", "clip_ratio", "rewards/margins", "rewards/accuracies",
            "eval/rewards/margins", "eval/rewards/accuracies", "eval/loss", "learning_rate", "loss"]


def is_count(key: str) -> bool:
    """n, n_*, seconds (and .../n, .../seconds): counts in eval results, not metrics to draw."""
    return key in ("n", "seconds") or key.startswith("n_") or key.endswith(("/n", "/seconds"))


@command.one_line(PlotError, ConfigError, stopped="before every plot was drawn (those written "
                  "are kept)")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plt = pyplot()
    if plt is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    runs, models = read_inputs(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = (plot_curves(plt, runs, args.metrics or default_curves(runs), out, args.smooth)
               if runs else [])
    if models:
        written += plot_eval(plt, models, args.metrics or list(dict.fromkeys(
            k for m in models.values() for k in m if not is_count(k))), out)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
