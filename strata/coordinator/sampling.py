"""Sampling parameters of a request, and the counter-based uniform draw for each position.

The token at position p is drawn with u = Philox(key=seed, counter=p): the same seed gives the
same draw at the same position, however the request is batched, pipelined or speculated.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    min_p: float = 0.0         # 0 = off
    seed: int | None = None    # None: a random seed is chosen (and reported)
    max_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} is below 0; use 0 for greedy")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} is below 0; use 0 to turn it off")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} is outside (0, 1]; use 1 to turn it off")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p {self.min_p} is outside [0, 1]; use 0 to turn it off")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens} is below 1")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed {self.seed} is outside [0, 2**64)")

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed (drawn at random if none was given)."""
        if self.seed is not None:
            return self
        from dataclasses import replace
        return replace(self, seed=secrets.randbits(63))


@lru_cache(maxsize=1 << 14)
def draw_uniform(seed: int, position: int) -> float:
    """u in [0, 1) for the token at `position`, from Philox keyed by the seed. Memoised (a
    Philox draw costs ~20 us): a coupled proposal's draw, made when its window is built, is
    the one its position's row samples with a window later."""
    gen = np.random.Generator(np.random.Philox(key=seed, counter=[position, 0, 0, 0]))
    return float(gen.random())
