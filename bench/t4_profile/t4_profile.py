"""The T4 profile's learning on a CPU, side by side (issue 52): the quickstart trained and evaluated
at fp32, at model.dtype=float16 (fp16 compute, loss scaling: a T4's) and at model.quant=4bit (an
NF4 base), over the same 30 steps. Per arm: held-out accuracy base and trained (eval.py, greedy,
the 100 held-out problems, in the arm's own dtype), seconds a step, peak RSS, and the
sampler-trainer log-prob gap of every step.

    python bench/t4_profile/t4_profile.py --out runs/t4_profile      # all three arms, ~60 min
    python bench/t4_profile/t4_profile.py --out runs/t4_profile --arms nf4            # one
    python bench/t4_profile/t4_profile.py --out runs/t4_profile --arms nf4_repacked  # unfixed
    python bench/t4_profile/t4_profile.py --out runs/t4_profile --arms bf16  # an A10/H100's gap
    python bench/t4_profile/t4_profile.py --report runs/t4_profile   # the table, from the files

The gap: HF generate records the log-prob it sampled each token with only for a merged or compiled
sampler, which a CPU's auto leaves off (and NF4 refuses merging); here every arm's sampler records
it (rollout.Sampler's sampler_logp option, set by this script only). With grpo.tis_cap 0 that only
adds the metric sampler_logp_abs_diff (mean |log pi_train - log pi_sampler| over the step's
tokens): the training is the quickstart's. Each arm is a fresh process, one after the other: time
it on a quiet machine. This proves the T4's code path on a CPU, not a T4's speed (torch's float16
matmuls on a CPU are far slower than fp32's) nor a real model's quality.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = {"fp32": [], "fp16": ["--model.dtype=float16"], "nf4": ["--model.quant=4bit"],
        # NF4 as before model.trainable_4bit_layout: bitsandbytes' CPU repack left on (the cause)
        "nf4_repacked": ["--model.quant=4bit", "--repacked"],
        "bf16": ["--model.dtype=bfloat16"]}  # not a T4's: the gap fp16 is compared with
CONFIG = "configs/quickstart.yaml"


def train_with_sampler_logp(argv: list[str]) -> int:
    """train.py's main, its HF sampler recording the log-probs it samples with; --repacked: the
    4-bit layers left to bitsandbytes' CPU inference repack, as before the fix."""
    sys.path.insert(0, str(ROOT))
    import model
    import rollout
    import train
    if "--repacked" in argv:
        argv = [a for a in argv if a != "--repacked"]
        model.trainable_4bit_layout = lambda m: None
    of = rollout.Sampler.of

    def recording(model, tokenizer, cfg):
        sample = of(model, tokenizer, cfg)
        sample.options["sampler_logp"] = True
        return sample
    rollout.Sampler.of = recording
    return train.main(argv)


def run_arm(name: str, out: Path) -> None:
    run_dir = out / name
    flags = ARMS[name]
    py = sys.executable
    subprocess.run([py, __file__, "--train", "--config", CONFIG, f"--run.out_dir={run_dir}",
                    *flags], cwd=ROOT, check=True)
    subprocess.run([py, "eval.py", "--config", CONFIG, "--models", "base", f"trained={run_dir}",
                    f"--eval.out_dir={run_dir}/eval", *(f for f in flags if f != "--repacked")],
                   cwd=ROOT, check=True)


def report(out: Path) -> str:
    rows = ["| arm | held-out accuracy base -> trained | s a step (median, steps 2-30) | "
            "peak RSS | sampler-trainer gap, mean (min-max over steps) |", "|---|---|---|---|---|"]
    for name in ARMS:
        run_dir = out / name
        if not (run_dir / "eval" / "results.json").is_file():  # not run, or not finished
            continue
        ms = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
        acc = {k: v["metrics"].get("accuracy") for k, v in json.loads(
            (run_dir / "eval" / "results.json").read_text())["models"].items()}
        gaps = [m["sampler_logp_abs_diff"] for m in ms if "sampler_logp_abs_diff" in m]
        step = statistics.median(m["step_time"] for m in ms[1:])
        rss = max(m["peak_memory_mb"] for m in ms) / 1024
        rows.append(f"| {name} | {acc.get('base', float('nan')):.2f} -> "
                    f"{acc.get('trained', float('nan')):.2f} | {step:.1f} | {rss:.2f} GiB | "
                    f"{statistics.mean(gaps):.2e} ({min(gaps):.1e}-{max(gaps):.1e}) |")
    return "\n".join(rows)


def main() -> int:
    if "--train" in sys.argv:  # one arm's training process
        return train_with_sampler_logp([a for a in sys.argv[1:] if a != "--train"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/t4_profile"))
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=["fp32", "fp16", "nf4"])
    ap.add_argument("--report", type=Path, help="only print the table of a finished --out")
    args = ap.parse_args()
    if args.report:
        print(report(args.report))
        return 0
    for name in args.arms:
        run_arm(name, args.out)
    print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
