"""Two runs on one CPU at once: what torch's threads cost when they outnumber the cores.

    python bench/two_runs_one_cpu/cpu_threads.py   # ~7 min on 2 cores; writes only to a temp folder

Each case starts one or two short quickstart trainings (4 steps, 2 prompts x 8 completions, 16
new tokens) as separate processes, at the same time, and reports the median step time:
  alone            one run, torch's default threads (one per core)
  alone PASSIVE    one run, OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep instead of spinning)
  pair             two runs, default threads: 2 x 2 threads spinning on 2 cores
  pair threads=1   two runs, run.threads=1 each: one core each
  pair PASSIVE     two runs, OMP_WAIT_POLICY=PASSIVE
The cases alternate once through in one process, so they share the machine's state.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = [("alone", 1, {}, []), ("alone PASSIVE", 1, {"OMP_WAIT_POLICY": "PASSIVE"}, []),
         ("pair", 2, {}, []), ("pair threads=1", 2, {}, ["--run.threads=1"]),
         ("pair PASSIVE", 2, {"OMP_WAIT_POLICY": "PASSIVE"}, [])]


def run_case(tmp: Path, name: str, n: int, env: dict, extra: list[str]) -> list[float]:
    """n runs started together -> every step time of every run."""
    procs, dirs = [], []
    for i in range(n):
        out = tmp / f"{name.replace(' ', '_')}_{i}"
        dirs.append(out)
        cmd = [sys.executable, "train.py", "--config", "configs/quickstart.yaml", "--run.steps=4",
               "--rollout.prompts_per_step=2", "--rollout.max_new_tokens=16", "--run.save_every=0",
               f"--run.out_dir={out}", *extra]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    if any(p.wait() for p in procs):
        raise SystemExit(f"{name}: a run failed")
    return [json.loads(line)["step_time"]
            for d in dirs for line in (d / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help only
    with tempfile.TemporaryDirectory() as tmp:
        medians = {}
        for name, n, env, extra in CASES:
            times = run_case(Path(tmp), name, n, env, extra)
            medians[name] = statistics.median(times)
            print(f"{name:16s} median step {medians[name]:6.2f} s   "
                  f"steps {[round(t, 1) for t in times]}", flush=True)
    print(f"alone PASSIVE / alone:      {medians['alone PASSIVE'] / medians['alone']:.2f}x")
    print(f"pair / alone:               {medians['pair'] / medians['alone']:.2f}x")
    print(f"pair threads=1 / pair:      {medians['pair threads=1'] / medians['pair']:.2f}x")
    print(f"pair PASSIVE / pair:        {medians['pair PASSIVE'] / medians['pair']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
