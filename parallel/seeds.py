"""The random generators a process draws from (Python's, numpy's, torch's), seeded: with run.seed
for one process, and under torchrun with each rank's own seed, so ranks sample different
completions while rank 0 keeps run.seed (a one-process run and rank 0 draw alike).

    seeds.seed_everything(cfg.run.seed)
    seeds.seed_everything(seeds.rank_seed(cfg.run.seed, rank))
"""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators: what sampling draws from (train.py, eval.py)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """Rank `rank`'s seed: run.seed for rank 0, a large odd stride apart for the others.

    >>> rank_seed(7, 0), rank_seed(7, 2)
    (7, 2000013)
    """
    return seed + 1_000_003 * rank
