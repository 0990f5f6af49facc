"""Does a training config fit a GPU memory budget? train.py's own loop under a hard memory cap.

    python bench/memory_cap.py --budget-gb 13.9 --model random:qwen2.5-1.5b -- \\
        --config configs/t4.yaml --model.dtype=float16 --rollout.ignore_eos=true \\
        --data.name=tests/fixtures/gsm8k_sample.jsonl --run.steps=3 --run.out_dir=/tmp/t4

It caps this process's CUDA allocations with torch.cuda.set_per_process_memory_fraction(budget /
card), builds the model if it is a `random:` shape (bench/random_models.py's, seeded, weights random
since hubs may be unreachable), runs train.main with the remaining arguments and --model.name set,
and prints each step's peak torch.cuda.max_memory_allocated (metrics.jsonl's peak_memory_mb) and
whether the run fit: an allocation over the cap raises CUDA OOM, which is reported as not fitting.
`--rollout.ignore_eos=true` makes every completion max_new_tokens long: the worst case. fp16 is a
T4's compute dtype (no bf16 there). CUDA only; not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-gb", type=float, required=True,
                    help="GiB the run may allocate on the GPU")
    ap.add_argument("--model", help="random:<shape> (see bench/random_models.py), a model "
                    "directory, or unset (the config's)")
    ap.add_argument("--tokenizer",
                    help="tokenizer directory for random models (default: the built-in model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's arguments")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("memory_cap.py measures GPU memory: it needs a CUDA GPU", file=sys.stderr)
        return 2
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = a.budget_gb * 2**30 / total
    if not 0 < fraction <= 1:
        print(f"--budget-gb {a.budget_gb} must be in (0, {total / 2**30:.1f}] on this GPU",
              file=sys.stderr)
        return 2
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    args = [x for x in a.train_args if x != "--"]
    if a.model:
        from random_models import model_dir
        args.append(f"--model.name={model_dir(a.model, 'cuda', a.tokenizer, a.seed)}")
    import train
    from config import load_config
    from run import lifecycle
    i = args.index("--config")
    out = Path(load_config(args[i + 1], args[:i] + args[i + 2:]).run.out_dir)
    print(f"[memory_cap] {torch.cuda.get_device_name(0)}, {total / 2**30:.1f} GiB; "
          f"cap {a.budget_gb} GiB (fraction {fraction:.3f}); train.py {' '.join(args)}", flush=True)
    ran_out, explain = [], lifecycle.out_of_memory  # train.main reports an OOM (one line, exit 2)
    lifecycle.out_of_memory = lambda *x, **k: ran_out.append(True) or explain(*x, **k)
    try:
        rc = train.main(args)
    except torch.OutOfMemoryError as e:  # while loading, before the steps
        print(f"[memory_cap] DOES NOT FIT in {a.budget_gb} GiB: {str(e).splitlines()[0]}")
        return 1
    if ran_out:
        print(f"[memory_cap] DOES NOT FIT in {a.budget_gb} GiB: out of memory in a step "
              f"(train.py's line above), peak allocated "
              f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        return 1
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
             if x.strip()] if rc == 0 else []
    for m in steps:
        print(f"[memory_cap] step {m['step']}: peak allocated "
              f"{m['peak_memory_mb'] / 1024:.2f} GiB, step time {m['step_time']:.1f} s, "
              f"completions/mean_length {m.get('completions/mean_length', float('nan')):.0f}")
    if rc != 0 or not steps:
        print(f"[memory_cap] train.py exited {rc}")
        return 1
    peak = max(m["peak_memory_mb"] for m in steps) / 1024
    print(f"[memory_cap] FITS: peak allocated {peak:.2f} GiB of a {a.budget_gb} GiB cap "
          f"(torch.cuda.max_memory_reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
