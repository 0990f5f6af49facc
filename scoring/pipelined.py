"""Rewards scored while the model samples (rollout.overlap_rewards with prompts_per_generate
slices): each slice's rewards (judge requests, people's ratings: mostly waiting) are computed in a
background thread while the next slice samples; the results are joined in order.

    run.sample_and_score = partial(sample_and_score, sample, rewards, tokenizer, cfg)  # at setup
    batch, res = run.sample_and_score(rows, samples)                          # step.score's seam
"""
from __future__ import annotations

import concurrent.futures
import functools
from typing import Callable

import rollout
from rewards import Rewards, in_background, join_results


def sample_and_score(sample: Callable, rewards: Rewards, tokenizer, cfg, rows: list[dict],
                     samples: list[dict]) -> tuple:
    """sample(prompts, on_slice=...) samples the slices (rollout.Sampler); each slice is scored in
    the background, one after the other -> (the rollout, the joined RewardResult). A draw of no
    more prompts than a slice (resampling's extra draws) is sampled and scored in one go."""
    prompts = rollout.render_rows(tokenizer, rows, cfg.data)
    G, pending = cfg.rollout.num_generations, []  # list[concurrent.futures.Future]
    if not 0 < cfg.rollout.prompts_per_generate < len(prompts):
        batch = sample(prompts)
        return batch, rewards(batch.texts, samples, num_tokens=batch.num_tokens())

    def start_rewards(i: int, part) -> None:  # lengths read here: no GPU sync on the thread
        after: concurrent.futures.Future | None = pending[-1] if pending else None
        pending.append(in_background(functools.partial(  # rows i*G, i*G + 1, ...
            rewards, part.texts, samples[i * G:i * G + len(part.texts)],
            num_tokens=part.num_tokens()), after=after))
    batch = sample(prompts, on_slice=start_rewards)
    return batch, join_results([f.result() for f in pending])
