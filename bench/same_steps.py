"""The same steps, bit for bit: a change that only moves code must not change what is trained.
Runs four reference runs and writes every step's metrics (times and memory left out) to one JSON
file; run it before and after the change, then compare.

    python bench/same_steps.py --out /tmp/before.json              # on the old commit
    python bench/same_steps.py --out /tmp/after.json               # on the new one
    python bench/same_steps.py --compare /tmp/before.json /tmp/after.json
    python bench/same_steps.py --out /tmp/q.json --only quickstart     # one of them
    python bench/same_steps.py --out /tmp/q3.json --steps 3 --threads 1   # shorter, on a shared box

The runs (about 6 minutes on 2 CPU cores): the quickstart's 30 steps; 3 steps of it under torchrun
with 2 processes; the multi-turn calculator demo's first 3 steps; 3 steps of vLLM rollouts against
the tests' fake vLLM on a tiny model.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMED = ("time", "seconds", "per_s", "memory")  # keys that measure the machine, not the run
EXTRA: list[str] = []  # --steps, --threads: overrides given to every train.py run


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not any(t in k for t in TIMED)} for m in rows]


def train(out: Path, *args: str, torchrun: bool = False) -> list[dict]:
    exe = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=2"] if torchrun \
        else [sys.executable]
    subprocess.run([*exe, "train.py", *args, *EXTRA, f"--run.out_dir={out}"], cwd=ROOT, check=True,
                   env=os.environ | {"PYTHONHASHSEED": "0"})
    return metrics(out)


def fake_vllm_run(tmp: Path) -> list[dict]:
    """In this process: the tests' fake vllm package in sys.modules, a tiny model, 3 steps."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT))
    import test_vllm_engine as fake
    from conftest import write_tiny_model
    from fake_vllm import fake_vllm_modules
    sys.modules |= fake_vllm_modules()
    run = {"out_dir": str(tmp / "vllm_run"), "steps": 3, "save_every": 0}
    cfg = fake.write_vllm_config(tmp, write_tiny_model(tmp / "tiny"),
                                 grpo={"num_iterations": 2, "tis_cap": 2.0}, run=run)
    import train as train_module
    assert train_module.main(["--config", str(cfg)]) == 0
    return metrics(tmp / "vllm_run")


RUNS = {"quickstart": lambda tmp: train(tmp / "q", "--config", "configs/quickstart.yaml"),
        "torchrun": lambda tmp: train(tmp / "t", "--config", "configs/quickstart.yaml",
                                      "--run.steps=3", "--run.threads=1", torchrun=True),
        "multi_turn": lambda tmp: train(tmp / "m", "--config", "configs/tools_calculator.yaml",
                                        "--run.steps=3"),
        "vllm_fake": fake_vllm_run}


def capture(out: Path, only: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        runs = {name: run(Path(d)) for name, run in RUNS.items() if name in (only or RUNS)}
    out.write_text(json.dumps(runs, indent=1))
    print(f"wrote {out}: " + ", ".join(f"{k} {len(v)} steps" for k, v in runs.items()))


def compare(a: Path, b: Path) -> int:
    before, after = json.loads(a.read_text()), json.loads(b.read_text())
    differ = 0
    for name in before:
        for old, new in zip(before[name], after.get(name, []), strict=False):
            diff = {k: (old.get(k), new.get(k)) for k in old.keys() | new.keys()
                    if old.get(k) != new.get(k) and not (isinstance(old.get(k), float)
                                                         and math.isnan(old[k]) and new.get(k)
                                                         is not None and math.isnan(new[k]))}
            if diff:
                differ += 1
                print(f"{name} step {old.get('step')}: {diff}")
        same = len(before[name]) == len(after.get(name, []))
        print(f"{name}: {len(before[name])} steps, {'same count' if same else 'COUNT DIFFERS'}")
        differ += not same
    print("identical" if not differ else f"{differ} differences")
    return int(bool(differ))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path)
    ap.add_argument("--only", nargs="*", choices=list(RUNS), help="some of the runs (default all)")
    ap.add_argument("--steps", type=int, help="steps each train.py run takes (default its own)")
    ap.add_argument("--threads", type=int, help="run.threads of each train.py run")
    args = ap.parse_args()
    EXTRA += [f"--run.steps={args.steps}"] * bool(args.steps)
    EXTRA += [f"--run.threads={args.threads}"] * bool(args.threads)
    sys.exit(compare(*args.compare) if args.compare else capture(args.out, args.only))
