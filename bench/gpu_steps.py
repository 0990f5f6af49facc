"""A run's steps as one line each, from its metrics.jsonl, for the GPU checks' logs:

    python bench/gpu_steps.py /tmp/colab/metrics.jsonl

step, rollout and update time (step - rollout), peak memory, completion length, the truncated and
zero-std shares, the gradient norm, skipped fp16 updates and the sampler's log-prob gap (where the
sampler records one); then the medians over steps 2..n (step 1 warms up and compiles).
"""
from __future__ import annotations

import json
import statistics
import sys

COLUMNS = [  # (metrics key, label, format)
    ("step_time", "step", "{:.1f} s"), ("rollout_time", "rollout", "{:.1f} s"),
    ("update_time", "update", "{:.1f} s"), ("peak_gib", "peak", "{:.2f} GiB"),
    ("completions/mean_length", "len", "{:.0f}"), ("completions/clipped_ratio", "cut", "{:.2f}"),
    ("frac_reward_zero_std", "zero_std", "{:.2f}"), ("grad_norm", "grad_norm", "{:.3f}"),
    ("skipped_updates", "skipped", "{:.0f}"), ("sampler_logp_abs_diff", "gap", "{:.4f}"),
]


def main(path: str) -> int:
    steps = [json.loads(x) for x in open(path) if x.strip()]
    for m in steps:
        m["update_time"] = m["step_time"] - m["rollout_time"]
        m["peak_gib"] = m["peak_memory_mb"] / 1024
        m.setdefault("skipped_updates", 0)
        print(f"[steps] step {m['step']}: " + ", ".join(
            f"{label} {fmt.format(m[k])}" for k, label, fmt in COLUMNS if k in m))
    later = steps[1:]
    if later:
        print(f"[steps] median of steps 2..{steps[-1]['step']}: " + ", ".join(
            f"{label} {fmt.format(statistics.median(m[k] for m in later))}"
            for k, label, fmt in COLUMNS if all(k in m for m in later)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
