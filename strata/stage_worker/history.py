"""The last stage's record of each slot's tokens, for the penalties of its sampled rows (on the
host: head.py takes what a window reads of them to the device).

Every window's live rows write their token at their position, before the window samples, so
when a row at position p samples, positions [0, p] of its slot hold the slot's sequence: its
prompt, the tokens it accepted, and the draft tokens before the row in this window (a draft row
is penalised as if the drafts before it were kept, which is what equality acceptance needs).
Nothing is trimmed: the stages refuse a row that would leave a gap (checks.py), so a row at p
follows rows that wrote every position before it since its slot's last commit, and positions
past p are never read. A held prompt's positions hold the same tokens the new request reads
(the slot keeps them only when they are the new prompt's prefix). A window that decodes ahead
(Window.follows) writes its rows' tokens again once the picks they read are on the host, when
it is answered (last_stage.py); its sampled rows have no penalties (checks.py).
"""
from __future__ import annotations

import numpy as np

from strata.protocol.messages import Window


class SlotTokens:
    def __init__(self, slots: int, ctx: int):
        self.tokens = np.zeros((slots, ctx), dtype=np.int64)

    def write(self, w: Window) -> None:
        slots, positions = np.asarray(w.slots), np.asarray(w.positions)
        live = slots >= 0
        self.tokens[slots[live], positions[live]] = np.asarray(w.tokens)[live]
