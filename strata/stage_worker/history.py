"""The last stage's record of each slot's tokens, for the penalties of its sampled rows.

Every window's live rows write their token at their position, before the window samples, so
when a row at position p samples, positions [0, p] of its slot hold the slot's sequence: its
prompt, the tokens it accepted, and the draft tokens before the row in this window (a draft row
is penalised as if the drafts before it were kept, which is what equality acceptance needs).
Nothing is trimmed: the stages refuse a row that would leave a gap (checks.py), so a row at p
follows rows that wrote every position before it since its slot's last commit, and positions
past p are never read. A held prompt's positions hold the same tokens the new request reads
(the slot keeps them only when they are the new prompt's prefix).
"""
from __future__ import annotations

import numpy as np
import torch

from strata.kernels.device import to_device
from strata.kernels.sampling.penalties import history_counts
from strata.protocol.messages import Window
from strata.protocol.rows import SamplingRow


class SlotTokens:
    def __init__(self, slots: int, ctx: int):
        self.tokens = np.zeros((slots, ctx), dtype=np.int64)

    def write(self, w: Window) -> None:
        slots, positions = np.asarray(w.slots), np.asarray(w.positions)
        live = slots >= 0
        self.tokens[slots[live], positions[live]] = np.asarray(w.tokens)[live]

    def counts(self, w: Window, sampled: list[SamplingRow], vocab: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """history_counts of these sampled rows of w: the tokens at positions [0, p] of the
        row's slot (p its position), those from its output_start on counted as output. On
        `device`, one copy of [2, m, L] there."""
        ends = [w.positions[p.row] + 1 for p in sampled]
        width = max(ends)
        packed = np.full((2, len(sampled), width), vocab, dtype=np.int64)
        packed[1] = 0
        for i, (p, end) in enumerate(zip(sampled, ends)):
            packed[0, i, :end] = self.tokens[w.slots[p.row], :end]
            packed[1, i, p.output_start:end] = 1
        on = to_device(torch.from_numpy(packed), device)
        return history_counts(on[0], on[1].bool(), vocab)
