"""Data-parallel GRPO on one CPU: torchrun with 2 processes of 1 thread against 1 process of 2
threads, on the quickstart; and the gradient all-reduce against DistributedDataParallel.

    python bench/data_parallel_cpu/ddp_cpu.py     # ~10 min on 2 cores; log: ddp_cpu.log beside it
    python bench/data_parallel_cpu/ddp_cpu.py --steps 6 --log /tmp/ddp.log

1. `train`: configs/quickstart.yaml for --steps steps (global B = 4 prompts x 8 completions, the
   same config on both sides), run one after the other:
     torchrun 2x1   OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 train.py ... --run.threads=1
     python 1x2     OMP_NUM_THREADS=2 python train.py ... --run.threads=2
   Per step: step_time and reward side by side, then the medians over steps 2.. and the wall time
   of each command (loading included). The two runs sample differently (each rank has its own
   seed), so the reward curves agree in trend, not value.
2. `sync`: under torchrun 2x1, the quickstart's policy (LoRA r=16, 4.88M trainable parameters) runs
   forward and backward over 2 micro-batches of 8 fixed 40-token rows a update, 4 updates a side:
     all-reduce     parallel.distributed.sum_gradients after accumulation (what train.py does)
     DDP            DistributedDataParallel, no_sync on all but the last micro-batch
   Per update: median seconds, and how long the all-reduce alone takes.
Writes nothing but the log and a temp folder.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def train_side(name: str, cmd: list[str], threads: int, out: Path, log) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.monotonic()
    done = subprocess.run(cmd + [f"--run.out_dir={out}", f"--run.threads={threads}"], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    log(f"{name}: wall {wall:.1f} s (loading included), {len(metrics)} steps")
    return metrics


def train(steps: int, log) -> None:
    common = ["train.py", "--config", "configs/quickstart.yaml", f"--run.steps={steps}",
              "--run.save_every=0", "--run.sample_every=0"]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with tempfile.TemporaryDirectory() as tmp:
        ddp = train_side("torchrun 2x1", [torchrun, "--nproc_per_node=2", *common], 1,
                         Path(tmp) / "ddp", log)
        one = train_side("python 1x2", [sys.executable, *common], 2, Path(tmp) / "one", log)
    log(f"{'step':>4} | {'torchrun 2x1 s':>14} {'reward':>7} | {'python 1x2 s':>12} {'reward':>7}")
    for a, b in zip(ddp, one):
        log(f"{a['step']:>4} | {a['step_time']:>14.2f} {a['reward']:>7.3f} | "
            f"{b['step_time']:>12.2f} {b['reward']:>7.3f}")
    med = [statistics.median(m["step_time"] for m in side[1:]) for side in (ddp, one)]
    mean = [statistics.mean(m["reward"] for m in side) for side in (ddp, one)]
    log(f"median step (steps 2..): torchrun 2x1 {med[0]:.2f} s, python 1x2 {med[1]:.2f} s, "
        f"ratio {med[0] / med[1]:.2f}; mean reward {mean[0]:.3f} vs {mean[1]:.3f}")


def sync() -> None:
    """Under torchrun (2 ranks): seconds per update, all-reduce vs DDP; rank 0 prints JSON."""
    sys.path.insert(0, str(ROOT))
    import torch

    import train as tr
    from parallel import distributed
    from run import lifecycle
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        r = lifecycle.setup(*tr.parse_args(["--config", "configs/quickstart.yaml",
                                       f"--run.out_dir={tmp}/run"]))
    g = torch.Generator().manual_seed(distributed.rank())
    batches = [torch.randint(0, 40000, (8, 40), generator=g) for _ in range(2)]
    ddp = torch.nn.parallel.DistributedDataParallel(r.model)

    def update(model, reduce: bool) -> tuple[float, float]:
        t0 = time.perf_counter()
        for i, ids in enumerate(batches):
            last = i == len(batches) - 1
            with model.no_sync() if (not reduce and not last) else contextlib.nullcontext():
                model(input_ids=ids).logits.float().mean().backward()
        t1 = time.perf_counter()
        if reduce:
            distributed.sum_gradients(r.params)
        t2 = time.perf_counter()
        for p in r.params:
            p.grad = None
        return t2 - t0, t2 - t1
    out = {}
    for name, model, reduce in (("all-reduce", r.model, True), ("DDP", ddp, False)) * 2:
        times = [update(model, reduce) for _ in range(2)]
        out.setdefault(name, []).extend(times)
    if distributed.rank() == 0:
        print(json.dumps({k: {"update_s": statistics.median(t for t, _ in v),
                              "allreduce_s": statistics.median(a for _, a in v)}
                          for k, v in out.items()}))
    distributed.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--log", default=str(Path(__file__).with_name("ddp_cpu.log")))
    ap.add_argument("--part", choices=["all", "train", "sync", "sync-rank"], default="all")
    args = ap.parse_args()
    if args.part == "sync-rank":  # one rank of part 2, started by torchrun below
        sync()
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    with open(args.log, "w") as f:
        def log(line: str) -> None:
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()
        log(f"bench/data_parallel_cpu/ddp_cpu.py at {commit}"
            f"{' (+ uncommitted changes)' if dirty else ''}, "
            f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        if args.part in ("all", "train"):
            train(args.steps, log)
        if args.part in ("all", "sync"):
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            done = subprocess.run([torchrun, "--nproc_per_node=2", __file__, "--part=sync-rank"],
                                  cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"sync failed:\n{done.stderr[-2000:]}")
            res = json.loads(done.stdout.strip().splitlines()[-1])
            for name, v in res.items():
                log(f"{name:10s} per update (2 micro-batches of 8 x 40 tokens): "
                    f"{v['update_s']:.3f} s, of which the all-reduce {v['allreduce_s']:.4f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
