"""Batch slots: which conversation holds which slot, and what each slot still holds.

A slot's KV lives on every stage. A finished slot keeps the tokens it read as prompt (`held`),
so a new request whose prompt begins with them reads only the rest. Decoded tokens are not
kept: decode windows and prompt chunks compute differently (DESIGN.md, exactness 2), so a
conversation's turn 2 reads its turn-1 answer again as prompt and gets exactly the tokens of
reading the whole history fresh.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Slot:
    index: int
    group: int
    held: list[int] = field(default_factory=list)  # tokens [0, len) whose KV is valid (read as prompt)
    request: object | None = None                   # the Request using the slot, if any
    read_pos: int = 0                               # next prompt position to read
    last_used: int = -1                             # admission counter, for least-recently-used
    # after a stage was started again: the positions [0, rebuild) the request's KV is written
    # again at before it decodes on (its prompt, then all but its last generated token;
    # rebuild.py)
    rebuild: int = 0

    @property
    def free(self) -> bool:
        return self.request is None

    @property
    def reading(self) -> bool:
        """The request still has rows to send before it decodes: its prompt, or a rebuild."""
        return self.read_pos < max(len(self.request.seq.prompt), self.rebuild)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SlotTable:
    def __init__(self, n_slots: int, n_groups: int):
        assert n_slots % n_groups == 0, (n_slots, n_groups)
        self.slots = [Slot(i, i % n_groups) for i in range(n_slots)]
        self.admissions = 0
        self._groups = [[s for s in self.slots if s.group == g] for g in range(n_groups)]

    def in_group(self, group: int) -> list[Slot]:
        """The group's slots, in index order (one list each call returns: do not change it)."""
        return self._groups[group]

    def choose(self, prompt: list[int], group_load: Callable[[int], Any] | None = None,
               reuse: bool = True) -> tuple[Slot, int] | None:
        """A free slot for this prompt and how many of its tokens the slot already holds.
        Prefers the longest held prefix (unless not `reuse`: then none is held); without one,
        a slot of the group with the least `group_load` (compared as given; None: any
        group), and among those a never-used slot, then the least recently used (so under
        light load every group's slots keep conversations)."""
        free = [s for s in self.slots if s.free]
        if not free:
            return None

        def held(s: Slot) -> int:
            # at least one prompt token is read again: its row gives the first token's logits
            return min(common_prefix(s.held, prompt), len(prompt) - 1) if reuse else 0

        best = max(free, key=lambda s: (held(s), -s.last_used))
        reuse = held(best)
        if reuse == 0:
            load = {g: group_load(g) if group_load else 0 for g in {s.group for s in free}}
            best = min(free, key=lambda s: (load[s.group], s.last_used))
        self.admissions += 1
        best.last_used = self.admissions
        return best, reuse
