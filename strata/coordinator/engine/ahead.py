"""Decoding ahead (SchedulerConfig.decode_ahead): a group's next window sent while the one
before it is in flight. The next window is the one the scheduler would choose once that window
is back (a prompt chunk, or a decode window), but a slot whose row there samples has no token
on the coordinator yet: its decode row reads the pick there (Window.follows names the sampled
row), which the stage, both first and last, writes in before computing. Policy only:
scheduler.py sends what this gives.

A decode window goes ahead only while none of its requests has a grammar (a mask needs the
token before it) or a penalty (its history does), and either all its slots wait for a token
or none does (then it reads no pick: a refused window ends only its own requests). A slot
whose request ends by length with the window in flight gets no row; one that ends by a stop
token or string is found only when that window lands, and its row's token is then dropped
(the slot's commit drops its KV).
"""
from __future__ import annotations

from strata.coordinator.config import SchedulerConfig
from strata.coordinator.engine.scheduler_state import Flight, RowOwner
from strata.coordinator.slots import Slot
from strata.coordinator.windows import Row


def allowed(cfg: SchedulerConfig) -> bool:
    """Decoding ahead as configured: one group, no drafts (a window's drafts come with the
    Result of the one before it)."""
    return cfg.decode_ahead and cfg.groups == 1 and not cfg.draft_tokens


def waiting(followed: Flight) -> dict[int, tuple[int, object]]:
    """The slots whose token the window in flight samples: slot index -> (the index of that
    sampled row among the window's, the request it samples for); -1 for a slot whose prompt
    it ends without sampling (max_tokens 0: the request ends when it lands)."""
    out, j = {}, 0
    for o in followed.owners:
        if o.sampled:
            out[o.slot.index] = (j + o.sampled - 1, o.request)
            j += o.sampled
        elif o.ends:
            out[o.slot.index] = (-1, o.request)
    return out


def decode_rows(chosen: list[Slot], followed: Flight
                ) -> tuple[list[Row], list[RowOwner], list[int]] | None:
    """The rows of a decode window of the `chosen` slots sent behind `followed` (in flight):
    (rows, their owners, each row's sampled row of `followed` or -1), or None when a slot
    waiting for a token there cannot follow it, or no row is left."""
    if any(s.request.seq.grammar is not None or s.request.seq.params.penalised
           for s in chosen):
        return None
    wait = waiting(followed)
    waits = [s.index in wait and wait[s.index][1] is s.request for s in chosen]
    if any(waits) and not all(waits):
        # a window that reads picks is refused with the window it follows: it holds only
        # that window's slots, so a refusal ends no other request
        return None
    rows, owners, follows = [], [], []
    for s, waits_here in zip(chosen, waits):
        req, seq = s.request, s.request.seq
        if not waits_here:   # its token is here: a window of its own
            rows += seq.decode_rows(s.index, [])
            owners.append(RowOwner(s, req, 1))
            follows.append(-1)
            continue
        j = wait[s.index][0]
        if j < 0 or req.cancelled or not seq.ahead_room():   # it ends with that window
            continue
        rows.append(seq.ahead_row(s.index))
        owners.append(RowOwner(s, req, 1))
        follows.append(j)
    return (rows, owners, follows) if rows else None
