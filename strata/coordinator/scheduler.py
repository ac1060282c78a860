"""The batch scheduler: slots in groups, windows in flight, admissions, completions, cancels.

Policy only: windows are built by windows.py and run by Pipeline. Every slot belongs to one
group; a group has one window in flight at a time. `groups == 1` is serial (a window passes
every stage and returns before the next); `groups == G` keeps up to G windows in flight, one per
group, each on a different stage. One exception: while a group has no decoding slot, it streams
the prompt chunks of the slot it reads, up to `prompt_depth` in flight (chunk k+1 on stage 0
while chunk k is on stage 1; launches use stages + 1, so the next chunk already waits at stage 0
when a result comes back). Only the last chunk samples, and every stage takes windows in the
order they were sent, so the chunks compute exactly as one at a time.

Which window next, in a group: each prompt chunk (oldest request first) delays the decoding
slots by one window whenever it runs; the order decides who waits when. While the decode
window has a free row, up to window_rows chunks in a row go first: a reading request gets its
first token sooner and joins the window, which costs about the same with one more row.
Otherwise chunks and decode windows alternate, so a long prompt slows the streams by half
instead of stopping them; a decoding slot waits at most window_rows chunks for its next
token. A new request takes a slot of the group with the fewest busy slots (then the fewest
prompt tokens left to read; then the least recently used slot of any group), unless a slot
holds its prefix, so the groups stay about equally full and none runs on alone at the end.
Prompt chunks stream (`prompt_depth`) only while their group has no decoding slot.
Because every row's arithmetic is independent of its neighbours and every draw depends only on
(seed, position), no schedule can change a request's tokens.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from strata.coordinator.drafts import PromptLookup
from strata.coordinator.generate import Sequence
from strata.coordinator.pipeline import Pipeline, WindowFailed
from strata.coordinator.sampling import SamplingParams
from strata.coordinator.slots import Slot, SlotTable
from strata.coordinator.windows import Row, build_window

log = logging.getLogger("strata.scheduler")
_ids = itertools.count(1)


@dataclass(frozen=True)
class SchedulerConfig:
    slots: int = 1
    groups: int = 1
    window_rows: int = 8
    chunk_rows: int = 32
    ctx: int = 2048
    prompt_depth: int = 1   # prompt chunks of one slot in flight at once (> 1: pipelined)
    draft_tokens: int = 0   # at most this many draft rows per slot in a decode window (drafts.py)

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError(f"--batch {self.slots} is below 1")
        if self.window_rows < 1 or self.chunk_rows < 1:
            raise ValueError("--window-rows and --chunk-rows must be at least 1")
        if self.prompt_depth < 1:
            raise ValueError(f"prompt depth {self.prompt_depth} is below 1")
        if not 0 <= self.draft_tokens < self.window_rows:
            raise ValueError(f"--draft-tokens {self.draft_tokens} must be at least 0 and below "
                             f"--window-rows {self.window_rows} (a slot's row and its drafts "
                             f"share one window)")
        if self.groups < 1 or self.slots % self.groups:
            raise ValueError(f"--batch-groups {self.groups} does not divide --batch {self.slots}; "
                             f"use a divisor of {self.slots} or auto")


@dataclass
class Request:
    seq: Sequence
    on_done: Callable[["Request"], None] = lambda r: None
    id: int = field(default_factory=lambda: next(_ids))
    slot: Slot | None = None
    cancelled: bool = False
    reused: int = 0          # prompt tokens the slot already held
    error: str | None = None
    notified: bool = False   # on_done was called (exactly once)
    drafter: PromptLookup | None = None
    drafted: int = 0         # draft tokens sent in windows
    accepted: int = 0        # of them, equal to the token sampled at their position

    @property
    def done(self) -> bool:
        return self.seq.finish_reason is not None


@dataclass
class _Flight:
    group: int
    # per slot in the window: (slot, request, rows sampled, draft tokens those rows verify)
    rows: list[tuple[Slot, Request, int, list[int]]]


class Scheduler:
    def __init__(self, pipe: Pipeline, cfg: SchedulerConfig, stop_ids: frozenset[int],
                 detokenize: Callable[[list[int]], str] = lambda ids: ""):
        self.pipe, self.cfg = pipe, cfg
        self.stop_ids, self.detokenize = stop_ids, detokenize
        self.table = SlotTable(cfg.slots, cfg.groups)
        self.queue: deque[Request] = deque()
        self.in_flight: dict[int, _Flight] = {}
        self.flights = [0] * cfg.groups             # windows in flight per group
        self.streaming: list[Slot | None] = [None] * cfg.groups  # slot whose chunks stream
        self.commits: list[tuple[int, int]] = []   # ride on the next window submitted
        self.prefer_read = [True] * cfg.groups     # alternate prompt chunks and decode windows
        self.ahead = [0] * cfg.groups              # chunks sent in a row while slots decode
        self.cursor = [0] * cfg.groups             # rotation over a group's decoding slots

    # --- requests -----------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams,
               on_token: Callable[[int], None] = lambda t: None,
               on_done: Callable[[Request], None] = lambda r: None) -> Request:
        seq = Sequence(prompt, params.with_seed(), self.stop_ids, self.cfg.ctx, self.detokenize,
                       on_token=on_token)
        req = Request(seq, on_done)
        self.queue.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Ends the request at its slot's next window; its tokens reach no one after that."""
        req.cancelled = True
        if req in self.queue:
            self.queue.remove(req)
            self._finish(req, "cancelled")

    @property
    def idle(self) -> bool:
        return not self.queue and not self.in_flight and all(s.free for s in self.table.slots)

    # --- the loop -----------------------------------------------------------------------------

    def step(self, timeout: float | None = None) -> bool:
        """Admit, fill every idle group with a window, then handle one result.
        Returns False when there was nothing to do."""
        for slot in self.table.slots:  # cancelled requests not in flight leave now
            if not slot.free and slot.request.cancelled and not self.flights[slot.group]:
                self._release(slot, slot.request, "cancelled")
        self._admit()
        for group in range(self.cfg.groups):
            while self._launch(group):
                pass
        if not self.in_flight:
            if not self.commits:
                return False
            # idle with commits pending (a finished or cancelled slot's decoded rows): carry them
            # on a window of one pad row, so no stage keeps rows no slot holds
            self._submit(0, [], 1, [])
        try:
            result, _ = self.pipe.receive(timeout=timeout)
            flight = self.in_flight.pop(result.id)
        except WindowFailed as e:
            flight = self.in_flight.pop(e.error.window, None)
            if flight is None:  # not about a window of ours: nothing to undo
                log.error("a stage reported: %s", e)
            else:
                self._fail(flight, str(e))
            return True
        self._landed(flight.group)
        sampled = iter(result.tokens)
        for slot, req, n, drafts in flight.rows:
            tokens = [next(sampled) for _ in range(n)]
            if req.cancelled:
                self._release(slot, req, "cancelled")
            elif tokens:
                self._accept(slot, req, tokens, drafts)
        return True

    def _accept(self, slot: Slot, req: Request, tokens: list[int], drafts: list[int]) -> None:
        """tokens[j] was sampled at position L + j (L: the sequence's length before); it
        counts while the drafts before it equal the tokens sampled at their positions."""
        start = req.seq.length
        for j, token in enumerate(tokens):
            done = req.seq.accept(token)
            if done or j == len(drafts) or drafts[j] != token:
                break
        req.drafted += len(drafts)
        req.accepted += j      # drafts equal to the token sampled at their position
        if done:
            self._release(slot, req, req.seq.finish_reason)
        elif j < len(drafts):  # rows of rejected drafts hold KV past L + j: drop it
            self.commits.append((slot.index, start + j))

    def run(self) -> None:
        while self.step():
            pass

    # --- mechanics ----------------------------------------------------------------------------

    def _admit(self) -> None:
        while self.queue:
            chosen = self.table.choose(self.queue[0].seq.prompt, self._group_load)
            if chosen is None:
                return
            slot, reuse = chosen
            req = self.queue.popleft()
            req.slot, req.reused = slot, reuse
            slot.request, slot.read_pos = req, reuse
            del slot.held[reuse:]
            self.commits.append((slot.index, reuse))
            if reuse:
                log.info("request %d: slot %d reuses %d of %d prompt tokens", req.id, slot.index,
                         reuse, len(req.seq.prompt))

    def _group_load(self, group: int) -> tuple[int, int]:
        """(busy slots, prompt tokens left to read): a new request joins the least loaded group.
        A heuristic: decode work still to come (max_tokens) is not counted."""
        busy = [s for s in self.table.in_group(group) if not s.free]
        return len(busy), sum(len(s.request.seq.prompt) - s.read_pos for s in busy)

    def _launch(self, group: int) -> bool:
        """Submit the group's next window if it may have one now; True if one was sent."""
        slots = [s for s in self.table.in_group(group) if not s.free]
        reading = [s for s in slots if s.read_pos < len(s.request.seq.prompt)]
        decoding = [s for s in slots if s.read_pos >= len(s.request.seq.prompt)]
        if self.flights[group]:
            slot = self.streaming[group]
            if (slot is None or slot not in reading or decoding or slot.request.cancelled
                    or self.flights[group] >= self.cfg.prompt_depth):
                return False
            self._submit_chunk(group, slot)
            return True
        # while the decode window has a free row, up to window_rows chunks in a row go first
        first = (len(decoding) < self.cfg.window_rows
                 and self.ahead[group] < self.cfg.window_rows)
        if reading and (self.prefer_read[group] or not decoding or first):
            self.prefer_read[group] = False
            self.ahead[group] += bool(decoding)
            self._submit_chunk(group, min(reading, key=lambda s: s.request.id))
        elif decoding:
            self.prefer_read[group] = True
            self.ahead[group] = 0
            start = self.cursor[group] % len(decoding)
            chosen = (decoding[start:] + decoding[:start])[: self.cfg.window_rows]
            self.cursor[group] = start + len(chosen)
            spare = self.cfg.window_rows - len(chosen)   # pad rows: room for drafts
            rows, owners = [], []
            for i, s in enumerate(chosen):
                seq = s.request.seq
                drafts = self._drafts(s.request, spare // (len(chosen) - i))  # an even share
                spare -= len(drafts)
                rows += [Row(s.index, seq.length - 1 + j, t, seq.params)
                         for j, t in enumerate([seq.last_token] + drafts)]
                owners.append((s, s.request, 1 + len(drafts), drafts))
            self._submit(group, rows, self.cfg.window_rows, owners)
        else:
            return False
        return True

    def _submit_chunk(self, group: int, slot: Slot) -> None:
        seq, start = slot.request.seq, slot.read_pos
        end = min(start + self.cfg.chunk_rows, len(seq.prompt))
        rows = [Row(slot.index, p, seq.prompt[p]) for p in range(start, end)]
        last = end == len(seq.prompt)
        if last:  # the prompt's last row samples the first token
            rows[-1] = Row(slot.index, end - 1, seq.prompt[end - 1], seq.params)
        slot.read_pos = end
        slot.held.extend(seq.prompt[start:end])
        self.streaming[group] = None if last else slot
        self._submit(group, rows, self.cfg.chunk_rows, [(slot, slot.request, int(last), [])],
                     chunk=True)

    def _drafts(self, req: Request, room: int) -> list[int]:
        """Draft tokens for the request's next window: within the room left, the context,
        and the tokens it may still generate (the last row's token is sampled anyway)."""
        seq = req.seq
        k = min(self.cfg.draft_tokens, room, seq.ctx - seq.length,
                seq.params.max_tokens - len(seq.generated) - 1)
        if k <= 0:
            return []
        if req.drafter is None:
            req.drafter = PromptLookup(seq.prompt)
        req.drafter.extend(seq.generated[len(req.drafter.tokens) - len(seq.prompt):])
        return req.drafter.propose(k)

    def _submit(self, group: int, rows: list[Row], shape: int, owners,
                chunk: bool = False) -> None:
        w = build_window(self.pipe.new_window_id(), rows, shape, self.commits, chunk=chunk)
        self.commits = []
        self.in_flight[w.id] = _Flight(group, owners)
        self.flights[group] += 1
        self.pipe.submit(w)

    def _landed(self, group: int) -> None:
        self.flights[group] -= 1
        if not self.flights[group]:
            self.streaming[group] = None

    def _release(self, slot: Slot, req: Request, reason: str) -> None:
        """The slot keeps its prompt's KV (the conversation cache); nothing decoded stays."""
        if slot.request is req:
            slot.request = None
            self.commits.append((slot.index, len(slot.held)))
        self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        if req.notified:  # a later window of a streamed prompt: the request already ended
            return
        if req.seq.finish_reason is None or reason == "cancelled":
            req.seq.finish_reason = reason
        req.notified = True
        req.on_done(req)

    def _fail(self, flight: _Flight, message: str) -> None:
        """A stage refused a window: its requests end with the error; the rest go on."""
        self._landed(flight.group)
        log.error("window failed: %s", message)
        for slot, req, _, _ in flight.rows:
            if req.notified:  # a later chunk of a request that already ended (cancelled)
                if slot.free:  # its slot kept rows this window never wrote: keep none
                    slot.held.clear()
                    self.commits.append((slot.index, 0))
                continue
            req.error = message
            if slot.request is req:
                slot.held.clear()  # the stages may hold part of the window: keep nothing
            self._release(slot, req, "error")


def auto_groups(slots: int, stages: int) -> int:
    """One group per stage, or the largest count below that divides the slots."""
    return max(g for g in range(1, min(slots, stages) + 1) if slots % g == 0)

