"""Sampling parameters of a request, and the counter-based uniform draw for each position.

The token at position p is drawn with u = Philox(key=seed, counter=p): the same seed gives the
same draw at the same position, however the request is batched, pipelined or speculated.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

MAX_TOP_LOGPROBS = 20   # the stages' limit (kernels/sampling/logprobs.py MAX_TOP)


MAX_LOGIT_BIAS = 300     # logit_bias entries a request may give (each rides on its rows)
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids a request may give


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    min_p: float = 0.0         # 0 = off
    seed: int | None = None    # None: a random seed is chosen (and reported)
    max_tokens: int = 128      # 0: only with prompt_logprobs (the prompt is scored, no more)
    stop: tuple[str, ...] = field(default_factory=tuple)
    # applied to the logits before temperature and the filters (kernels/sampling/penalties.py)
    repetition_penalty: float = 1.0   # 1 = off; tokens of the prompt and the output
    frequency_penalty: float = 0.0    # 0 = off; per occurrence in the output
    presence_penalty: float = 0.0     # 0 = off; once for a token in the output
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100])
    min_tokens: int = 0        # the stop tokens are held back until this many are generated
    ignore_eos: bool = False   # the model's end-of-text tokens do not end the output
    stop_token_ids: tuple[int, ...] = ()   # more tokens that end the output (not part of it)
    logprobs: int | None = None          # None = off; N: each token's and the top N's
    prompt_logprobs: int | None = None   # None = off; N: each prompt token's, and the top N

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} is below 0; use 0 for greedy")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} is below 0; use 0 to turn it off")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} is outside (0, 1]; use 1 to turn it off")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p {self.min_p} is outside [0, 1]; use 0 to turn it off")
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens {self.max_tokens} is below 1 (0 only when the "
                             f"prompt is scored)")
        if not 0 < self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty {self.repetition_penalty} is outside "
                             f"(0, 100]; use 1 to turn it off")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} {getattr(self, name)} is outside [-2, 2]; use 0 to "
                                 f"turn it off")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; give at most "
                             f"{MAX_LOGIT_BIAS}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias) or not all(
                t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias):
            raise ValueError("logit_bias must map distinct token ids to biases in [-100, 100]")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise ValueError(f"min_tokens {self.min_tokens} is outside [0, max_tokens "
                             f"{self.max_tokens}]")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in
                                                                 self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} {n} is outside [0, {MAX_TOP_LOGPROBS}]")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed {self.seed} is outside [0, 2**64)")

    @property
    def penalised(self) -> bool:
        """Whether a penalty depends on the slot's tokens (repetition, frequency, presence)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

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


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability in the model's distribution at its position (before
    temperature, penalties and filters), and the most likely tokens there with theirs."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most likely first

    @classmethod
    def of(cls, token: int, entry: tuple[float, list[int], list[float]]) -> "TokenLogprob":
        """`token`'s, from a Result's entry (logprob, top ids, top logprobs)."""
        logprob, ids, values = entry
        return cls(token, logprob, tuple(zip(ids, values)))
