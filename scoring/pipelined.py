"""Rewards scored while the model samples (rollout.overlap_rewards with prompts_per_generate
slices): each slice's rewards (judge requests, people's ratings: mostly waiting) are computed in a
background thread while the next slice samples; the results are joined in order.

    batch, samples, res = sample_and_score(run, prompts, samples, context, sample)   # step.score
"""
from __future__ import annotations

import concurrent.futures
import functools
from typing import Callable

from rewards import compute_rewards, in_background, join_results


def sample_and_score(run, prompts: list[str], samples: list[dict], context: dict,
                     sample: Callable) -> tuple:
    """sample(run, prompts, on_slice=...) samples the slices (step.sample); each slice is scored in
    the background, one after the other -> (the rollout, samples, the joined RewardResult)."""
    G, pending = run.cfg.rollout.num_generations, []  # list[concurrent.futures.Future]

    def rewards_of(texts: list[str], num_tokens: list[int], first: int):
        return compute_rewards(texts, samples[first:first + len(texts)], run.cfg.rewards,
                               num_tokens=num_tokens, context=context)  # rows first, first + 1...

    def start_rewards(i: int, part) -> None:  # lengths read here: no GPU sync on the thread
        after: concurrent.futures.Future | None = pending[-1] if pending else None
        pending.append(in_background(functools.partial(
            rewards_of, part.texts, part.num_tokens(), i * G),
            after=after))
    batch = sample(run, prompts, on_slice=start_rewards)
    return batch, samples, join_results([f.result() for f in pending])
