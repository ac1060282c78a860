"""A window's rows as records: what the coordinator builds a window from (Window.from_rows),
what the last stage reads of it (Window.sampled, Window.scored) and what the sampler takes
(kernels/sampling/sample.py). On the wire they travel as the Window's columns (messages.py).
Named tuples: a decode window makes one per sampled row, several times quicker than a frozen
dataclass. The kernels may import this module and no other of protocol/.
May import: nothing"""
from __future__ import annotations

from typing import NamedTuple, Sequence


class SamplingRow(NamedTuple):
    """A sampled row: how the last stage picks the token for the row's position + 1. The
    sampler's fields come first (kernels/sampling/sample.py reads only these); after them the
    row's index in the window and what the head applies to its logits before the sampler
    (stage_worker/head.py): the penalties and biases (kernels/sampling/penalties.py), then
    the token mask."""
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    min_p: float = 0.0        # 0 = off
    u: float = 0.0            # uniform in [0, 1), drawn by the coordinator
    row: int = 0
    penalty: Sequence[float] = ()   # [repetition, frequency, presence], or () for none
    output_start: int = 0     # where the slot's output begins: frequency and presence count
                              # the tokens at [output_start, position], repetition [0, position]
    bias_ids: Sequence[int] = ()    # tokens whose logits get `bias` added (-inf: the row may
    bias: Sequence[float] = ()      # not sample them)
    mask: int = -1            # the index of the row's token mask in Window.masks; -1: none

    def filtered(self, vocab: int) -> bool:
        """Whether top-k, top-p or min-p may cut the row's distribution (a sampled row without
        them is picked without a sort: kernels/sampling/sample.py's pick_unfiltered)."""
        return 0 < self.top_k < vocab or self.top_p < 1.0 or self.min_p > 0.0


class LogprobRow(NamedTuple):
    """A row whose log-probabilities the last stage reports (Result.logprobs), any live row:
    of `token` (-1: the token the row samples) and of the row's `top` most likely tokens, in
    the model's own distribution (before penalties, biases, masks and temperature)."""
    row: int
    token: int
    top: int
