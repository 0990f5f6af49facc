"""The order in which training prompts are drawn: reproducible (seeded), resumable (the whole state
is a few integers saved in each checkpoint), and for a mixture of sources, weighted by a schedule
that can turn the mix into a curriculum (data.mixture's weight -> weight_end).

    sampler = PromptSampler([len(s.rows) for s in sources], cfg.data.shuffle_seed,
                            [(s.weight, s.weight_end) for s in sources])
    sampler.progress = (step - 1) / (steps - 1)
    sampler.draw(4)                             # 4 indices into the sources' rows, concatenated
    sampler.load_state(state["data_position"])  # --resume draws what the first run would have
"""
from __future__ import annotations

import random

from config import ConfigError


class PromptSampler:
    """Draws row indices, reproducibly and resumably.

    Within a source of n rows, its p-th draw is perm_e[p % n] with e = p // n: each epoch a fresh
    seeded permutation. With several sources (sizes, weights), the global draw p first picks a
    source with probability w_s(progress) / sum_k w_k(progress) by a uniform seeded on (seed, p);
    the caller sets `progress` (0 at the first step, 1 at the last). The whole state is state():
    the global position and each source's position, so a resumed run draws what the
    uninterrupted one drew. The returned indices are into the sources' rows concatenated.
    Under torchrun each process (rank r of `world`) draws every world-th of those draws, from the
    r-th on: the ranks of a step draw, together, the prompts one process would (one source), and
    each rank's state is its own (resample_zero_std draws more on one rank than another).
    """

    def __init__(self, sizes: list[int], seed: int,
                 weights: list[tuple[float, float]] | None = None, rank: int = 0, world: int = 1):
        self.sizes, self.seed, self.rank, self.world = list(sizes), seed, rank, world
        self.weights = weights or [(1.0, 1.0)] * len(self.sizes)
        self.offsets = [sum(self.sizes[:s]) for s in range(len(self.sizes))]
        self.position, self.positions, self.progress = 0, [0] * len(self.sizes), 0.0
        self.counts = [0] * len(self.sizes)  # draws per source since pop_counts()
        self._perms: dict[int, tuple[int, list[int]]] = {}  # source -> (epoch, permutation)

    def _index(self, s: int, p: int) -> int:
        epoch = p // self.sizes[s]
        if self._perms.get(s, (None,))[0] != epoch:
            perm = list(range(self.sizes[s]))
            random.Random((self.seed + 7919 * s) * 1_000_003 + epoch).shuffle(perm)
            self._perms[s] = (epoch, perm)
        return self._perms[s][1][p % self.sizes[s]]

    def _now(self) -> list[float]:
        return [max(0.0, a + (b - a) * self.progress) for a, b in self.weights]

    def shares(self) -> list[float]:
        """Each source's probability now: its weight at this progress over the weights' sum."""
        w = self._now()
        return [x / (sum(w) or 1.0) for x in w]

    def _source(self, p: int) -> int:
        if len(self.sizes) == 1:
            return 0
        w = self._now()
        u, acc = random.Random(f"{self.seed}:{p}").random() * sum(w), 0.0
        for s, ws in enumerate(w):
            acc += ws
            if u < acc:
                return s
        return max(s for s, ws in enumerate(w) if ws > 0)  # u == sum(w) after rounding

    def draw(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            s = self._source(self.position * self.world + self.rank)
            out.append(self.offsets[s] + self._index(s, self.positions[s] * self.world + self.rank))
            self.position += 1
            self.positions[s] += 1
            self.counts[s] += 1
        return out

    def pop_counts(self) -> list[int]:
        counts, self.counts = self.counts, [0] * len(self.sizes)
        return counts

    def state(self) -> dict:
        return {"position": self.position, "positions": list(self.positions),
                "sizes": list(self.sizes)}

    def load_state(self, state: dict | int) -> None:
        if isinstance(state, int):  # checkpoints before mixtures saved the position alone
            state = {"position": state, "positions": [state]}
        if len(state["positions"]) != len(self.sizes):
            raise ConfigError(f"the checkpoint drew from {len(state['positions'])} data sources, "
                              f"this config has {len(self.sizes)}")
        # e.g. a filtering data.map changed
        if "sizes" in state and list(state["sizes"]) != list(self.sizes):
            raise ConfigError(f"the checkpoint drew from data sources of {state['sizes']} rows, "
                              f"this config gives {list(self.sizes)}: the same positions would "
                              "draw other rows; restore the data (or the map, data.skip_long and "
                              "the length limits) it trained on")
        self.position, self.positions = state["position"], list(state["positions"])
