"""Decoding ahead (SchedulerConfig.decode_ahead): what a group's next decode window holds when
it is sent while the one before it is in flight. Each of its rows reads the token its slot's
row in that window samples: the coordinator does not have it yet, the stage does (it is both
first and last), so the row names it (Window.follows: the sampled row of the window in
flight) and the stage writes it in before computing. Policy only: scheduler.py sends it.

A window goes ahead only while the one in flight holds every decoding slot of the group (no
slot waits for its turn), no slot reads a prompt, and no request has a grammar (its next mask
needs the token) or a penalty (its history does). A slot whose request ends with the window in
flight by length gets no row; one that ends by a stop token or string is found only when that
window lands, and its row's token is then dropped (its slot's commit drops the KV).
"""
from __future__ import annotations

from strata.coordinator.config import SchedulerConfig
from strata.coordinator.engine.scheduler_state import RowOwner
from strata.coordinator.slots import Slot
from strata.coordinator.windows import Row


def allowed(cfg: SchedulerConfig) -> bool:
    """Decoding ahead as configured: one group, no drafts (a window's drafts come with the
    Result of the one before it)."""
    return cfg.decode_ahead and cfg.groups == 1 and not cfg.draft_tokens


def next_rows(slots: list[Slot], followed: list[RowOwner]
              ) -> tuple[list[Row], list[RowOwner], list[int]] | None:
    """The rows of the window that follows one in flight (its owners `followed`, one sampled
    row each, in row order), given the group's busy slots: (rows, their owners, each row's
    sampled row in the window followed), or None when no window may go ahead."""
    live = [(j, o) for j, o in enumerate(followed) if not o.request.notified]   # not ended
    if (len(slots) != len(live) or any(s.reading for s in slots)
            or {s.index for s in slots} != {o.slot.index for _, o in live}):
        return None
    for _, o in live:
        req = o.request
        if (o.slot.request is not req or req.cancelled or req.seq.grammar is not None
                or req.seq.params.penalised):
            return None
    going = [(j, o) for j, o in live if o.request.seq.ahead_room()]
    if not going:
        return None
    return ([o.request.seq.ahead_row(o.slot.index) for _, o in going],
            [RowOwner(o.slot, o.request, 1) for _, o in going], [j for j, _ in going])
