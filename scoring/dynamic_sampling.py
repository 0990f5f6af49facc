"""DAPO's dynamic sampling (arXiv 2503.14476), rollout.resample_zero_std: groups whose rewards are
all equal carry no signal (advantage 0), so more prompts are drawn until B groups have signal or
rollout.max_prompts_per_step prompts were drawn; the flat groups then fill the batch.

    run.resample = until_signal   # run/lifecycle.prepare, under rollout.resample_zero_std
    kept, drawn = run.resample(run, first, score, concat, take_group)   # step.collect's seam

Metrics are taken over everything drawn. tests/test_step.py holds it.
"""
from __future__ import annotations

from typing import Callable

import grpo


def until_signal(run, first, score: Callable, concat: Callable, take_group: Callable) -> tuple:
    """first: the B = run.prompts_per_step groups drawn (a step.Scored); score(run, idx) draws
    more. -> (the B groups to train on, everything drawn), each group kept whole."""
    G, tol, B = run.cfg.rollout.num_generations, run.cfg.grpo.zero_std_tol, run.prompts_per_step
    cap, drawn = max(run.cfg.rollout.max_prompts_per_step // run.world or 4 * B, B), B
    parts = [first]
    zero = [grpo.zero_std_groups(first.total, G, tol).tolist()]
    while sum(z.count(False) for z in zero) < B and drawn < cap:
        k = min(B - sum(z.count(False) for z in zero), cap - drawn)
        parts.append(score(run, run.sampler.draw(k)))
        zero.append(grpo.zero_std_groups(parts[-1].total, G, tol).tolist())
        drawn += k
    signal = [(p, g) for p, z in zip(parts, zero) for g, flat in enumerate(z) if not flat]
    flat = [(p, g) for p, z in zip(parts, zero) for g, f in enumerate(z) if f]
    kept = [take_group(p, g, G) for p, g in (signal + flat)[:B]]
    pad = run.tokenizer.pad_token_id
    return concat(kept, pad), concat(parts, pad)
