"""Rebuilding every slot's KV after a stage was started again (Scheduler.restarted).

A stage started again has an empty KV cache. The windows in flight are given up (no token of
theirs counts), every slot commits length 0 on every stage, no slot holds a prompt for the next
request any more, and a request cancelled meanwhile leaves its slot. Each other request in a
slot writes its KV again from position 0 before it goes on (start_rebuild), in its group's
windows, as a slot reading its prompt does (Slot.reading until read_pos reaches slot.rebuild):

- its prompt, as prompt chunks, none of it reused; the last chunk samples only if the request
  has decoded nothing yet (else its first token was sampled before);
- then, if it has decoded, its decoded tokens but the last, as decode windows of its own rows
  that sample nothing (decoded_rows): a decoded token's KV must be written by a decode row, as
  it was (DESIGN.md, exactness 2); a prompt row would compute it otherwise;
- its last token, which its next decode window reads, as any decoding slot's.

Every row computes as it did and every draw depends only on (seed, position), so each stage's
KV is what it was and the request goes on to exactly the tokens it would have had. Proposals in
hand are dropped; the same windows give the last stage's drafter its kept states again.
"""
from __future__ import annotations

import logging

from strata.coordinator.config import MAX_WINDOW_ROWS, round_rows
from strata.coordinator.slots import Slot
from strata.coordinator.windows import Row

log = logging.getLogger("strata.scheduler")


def start_rebuild(slot: Slot) -> None:
    """The slot's request (not cancelled) writes its KV again from position 0: [0, rebuild)
    is its prompt, then all its tokens but the last if it has decoded."""
    req = slot.request
    # nothing of its prompt is held any more: it reads it all again
    slot.read_pos, req.reused, req.drafts.proposals = 0, 0, []
    slot.rebuild = req.seq.length - 1 if req.seq.generated else 0
    if slot.rebuild:
        log.info("request %d: slot %d writes %d positions again", req.id, slot.index,
                 slot.rebuild)


def rebuild_window_rows(chunk_rows: int) -> int:
    """The rows of a rebuild's decode windows: about a prompt chunk's."""
    return min(round_rows(chunk_rows), MAX_WINDOW_ROWS)


def decoded_rows(slot: Slot, chunk_rows: int) -> list[Row]:
    """The next rows of the slot's rebuild once its prompt is read: its decoded tokens from
    read_pos on, at most rebuild_window_rows of them and none at or past slot.rebuild, as decode
    rows that sample nothing (as drafts that are all kept). Not empty while the slot reads."""
    seq, start = slot.request.seq, slot.read_pos
    end = min(start + rebuild_window_rows(chunk_rows), slot.rebuild)
    tokens = seq.prompt + seq.generated
    return [Row(slot.index, p, tokens[p]) for p in range(start, end)]
