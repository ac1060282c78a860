"""The inputs of the drafter's fused steps (drafter.py `_run_steps`) in one int64 array: one
copy to the device a window, into a graph's static input on CUDA.

A StepShape is what a capture is specialised on: n NextN rows, a asks, k chained steps and r
rows of the hidden-state buffer. On CUDA n and a are padded to the drafter's graph sizes and r
is MAX_DECODE_ROWS; on the CPU they are the window's own counts. The array holds, in order:

    sources  [n]       row of [hidden (r rows); last_h (S slots); zeros; trash] each row reads
    tokens   [n]
    packed   [3, n]    slot, position - 1, position of each NextN row (RowTensors)
    accepted [2, r]    each slot's last accepted row: the slot, and its row of hidden
    tops     [a]       each ask's row among the n: the first proposal's input
    steps    [k-1, 3, a]  the rows of chained step 2..k (packed, as above)

Pads: a row reads zeros and writes the NextN cache's trash slot; an accepted pad writes the
trash row of last_h; an ask's steps past its own k (the context's end) go to the trash slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StepFields:
    sources: torch.Tensor   # (or numpy arrays, on the host)
    tokens: torch.Tensor
    packed: torch.Tensor
    accepted: torch.Tensor
    tops: torch.Tensor
    steps: torch.Tensor


@dataclass(frozen=True)
class StepShape:
    n: int   # NextN rows
    a: int   # asks
    k: int   # chained steps (proposals an ask may get)
    r: int   # rows of the hidden states the sources index

    @property
    def size(self) -> int:
        return 5 * self.n + 2 * self.r + self.a + max(self.k - 1, 0) * 3 * self.a

    def _cuts(self) -> list[int]:
        n, a, r = self.n, self.a, self.r
        return np.cumsum([n, n, 3 * n, 2 * r, a]).tolist()

    def fields(self, ints):
        """The fields of the array (a tensor, or on the host a numpy array) as views."""
        n, a, r, steps = self.n, self.a, self.r, max(self.k - 1, 0)
        parts = (torch.tensor_split(ints, self._cuts()) if isinstance(ints, torch.Tensor)
                 else np.split(ints, self._cuts()))
        return StepFields(parts[0], parts[1], parts[2].reshape(3, n), parts[3].reshape(2, r),
                          parts[4], parts[5].reshape(steps, 3, a))

    def accepted(self, ints: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(last_h rows, hidden rows) of the slots' last accepted rows, pads included."""
        acc = self.fields(ints).accepted
        return acc[0], acc[1]

    def inputs(self, plan, asks: list[tuple], rows: int, slots: int, trash: int) -> np.ndarray:
        """The array for a drafter plan (drafter._Plan) and its asks [(slot, k, top, _)], of a
        window of `rows` rows on a drafter of `slots` slots whose NextN cache's trash slot is
        `trash`."""
        assert len(plan.slots) <= self.n and len(asks) <= self.a and rows <= self.r
        out = np.zeros(self.size, dtype=np.int64)
        f = self.fields(out)   # views of out
        m, shift = len(plan.slots), self.r - rows
        f.sources[:] = self.r + slots   # zeros
        f.sources[:m] = [x if x < rows else x + shift for x in plan.sources]
        f.tokens[:m] = plan.tokens
        f.packed[0] = trash
        f.packed[0, :m] = plan.slots
        f.packed[2, :m] = plan.positions
        f.packed[1, :m] = f.packed[2, :m] - 1
        f.accepted[0] = slots + 1       # the trash row of last_h
        f.accepted[0, :len(plan.accepted)] = list(plan.accepted)
        f.accepted[1, :len(plan.accepted)] = list(plan.accepted.values())
        f.tops[:len(asks)] = [plan.tops[s] for s, *_ in asks]
        f.steps[:, 0] = trash
        for j, (s, k, top, _) in enumerate(asks):
            for i in range(2, k + 1):
                f.steps[i - 2, :, j] = (s, top + i - 2, top + i - 1)
        return out
