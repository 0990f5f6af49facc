"""A/B a setting through train.py itself: alternating fresh processes, step time and peak memory.

    .venv/bin/python bench/speed_levers/ab.py --config bench/speed_levers/cpu_step.yaml \\
        --a grpo.share_prompt=false --b grpo.share_prompt=true
    .venv/bin/python bench/speed_levers/ab.py --config configs/quickstart.yaml \\
        --a optim.micro_batch_size=8 --b optim.micro_batch_size=16 --reps 3
    .venv/bin/python bench/speed_levers/ab.py --config bench/speed_levers/judge_step.yaml \\
        --judge-delay 2 --a rollout.overlap_rewards=false ...

Each rep runs A then B, each a fresh `train.py --config CONFIG --SET ...` process into its own
temporary run directory. Reported per run: step_time, rollout_time and peak_memory_mb of every step
(metrics.jsonl: on CPU the process's peak RSS so far, loading included; on a GPU the step's
max_memory_allocated); then the medians over steps 2..n of all runs of a side (memory: each run's
largest), and B / A. --judge-delay S starts tests/fake_openai_server.py's judge, which answers every
request after S seconds, and points judge.base_url at it (a config with a judge reward, e.g.
bench/speed_levers/judge_step.yaml). Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(config: str, sets: list[str], out_dir: Path) -> list[dict]:
    """One train.py process -> its metrics records."""
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", config,
           f"--run.out_dir={out_dir}"] + [f"--{s}" for s in sets]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    _, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"train.py {' '.join(sets)} failed ({proc.returncode}): "
                         f"{err.strip().splitlines()[-1:]}")
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()
               if x.strip()]
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--a", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="setting of side A (repeatable)")
    ap.add_argument("--b", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="setting of side B (repeatable)")
    ap.add_argument("--reps", type=int, default=2, help="alternations (A, B) to run")
    ap.add_argument("--judge-delay", type=float, default=None, metavar="S",
                    help="serve a fake judge that answers after S seconds, as judge.base_url")
    args = ap.parse_args()
    if args.judge_delay is not None:
        sys.path.insert(0, str(ROOT / "tests"))
        from fake_openai_server import FakeOpenAIServer, length_score, ok
        judge = FakeOpenAIServer(reply=length_score,
                                 default=ok(delay_s=args.judge_delay)).start()
        args.a.insert(0, f"judge.base_url={judge.url}")
        args.b.insert(0, f"judge.base_url={judge.url}")
    sides = {"A": args.a, "B": args.b}
    steps: dict[str, list[float]] = {"A": [], "B": []}
    rollouts: dict[str, list[float]] = {"A": [], "B": []}
    peaks: dict[str, list[float]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for side, sets in sides.items():
                records = run(args.config, sets, Path(tmp) / f"{side}{rep}")
                peak = max(r["peak_memory_mb"] for r in records)
                times = [r["step_time"] for r in records]
                steps[side] += times[1:] if len(times) > 1 else times
                rollout = [r.get("rollout_time", 0.0) for r in records]  # SFT, DPO sample nothing
                rollouts[side] += rollout[1:] if len(rollout) > 1 else rollout
                peaks[side].append(peak)
                print(f"{side} {' '.join(sets) or '(config as is)'} run {rep + 1}: step_time "
                      f"{' '.join(f'{t:.2f}' for t in times)} s "
                      f"(rollout {' '.join(f'{t:.2f}' for t in rollout)} s); peak memory by step "
                      f"{' '.join(str(round(r['peak_memory_mb'])) for r in records)} MB",
                      flush=True)
    med = {s: (statistics.median(steps[s]), statistics.median(peaks[s]),
               statistics.median(rollouts[s])) for s in sides}
    print(f"medians (steps 2..n of every run; peak memory per run): A {med['A'][0]:.2f} s / "
          f"{med['A'][1]:.0f} MB, B {med['B'][0]:.2f} s / {med['B'][1]:.0f} MB; B / A: step time "
          f"{med['B'][0] / med['A'][0]:.3f}, peak memory {med['B'][1] / med['A'][1]:.3f}"
          + (f"; rollout time {med['B'][2] / med['A'][2]:.3f} "
             f"({med['A'][2]:.2f} / {med['B'][2]:.2f} s)" if med["A"][2] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
