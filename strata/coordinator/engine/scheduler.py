"""The batch scheduler: slots in groups, windows in flight, admissions, completions, cancels.

Policy only: windows are built by windows.py and run by Pipeline; drafts (which a decode window
verifies, the proposals it asks for, what its tokens keep) are speculation.py's; grammars'
masks are grammar.py's; a restarted stage's KV is rebuilt by rebuild.py. Every slot belongs to
one group, and a group has one window in flight at a time (its prompt chunks may stream while
it has no decoding slot; with decode_ahead its next window may go behind the one in flight:
ahead.py). docs/DESIGN.md says the rest: units of work (window sizes, groups),
which window goes next, the life of a decode window, and why no schedule can change a token.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Callable

from strata.coordinator.config import (  # noqa: F401 (SchedulerConfig, auto_groups re-exported)
    WINDOW_ROW_STEP, SchedulerConfig, auto_groups, round_rows)
from strata.coordinator.grammar import Constraint, WindowMasks
from strata.coordinator.stages.pipeline import Pipeline, PipelineError, WindowFailed
from strata.coordinator.engine import ahead
from strata.coordinator.engine.rebuild import decoded_rows, start_rebuild
from strata.coordinator.sampling_params import SamplingParams, TokenLogprob
from strata.coordinator.engine.scheduler_state import (  # noqa: F401 (the state types re-exported)
    DecodeWindow, Flight, Group, Request, RowOwner, SchedulerSnapshot, SlotState)
from strata.coordinator.sequence import Sequence
from strata.coordinator.slots import Slot, SlotTable
from strata.coordinator.speculation.speculation import Speculation
from strata.coordinator.windows import Row, build_window

log = logging.getLogger("strata.scheduler")

CHUNKS_FIRST = 8   # prompt chunks sent in a row while the decode window can grow


class Scheduler:
    def __init__(self, pipe: Pipeline, cfg: SchedulerConfig, stop_ids: frozenset[int],
                 detokenize: Callable[[list[int]], str] = lambda ids: "",
                 clock: Callable[[], float] = time.perf_counter):
        self.pipe, self.cfg, self.clock = pipe, cfg, clock
        self.stop_ids, self.detokenize = stop_ids, detokenize
        self.table = SlotTable(cfg.slots, cfg.groups)
        self.queue: deque[Request] = deque()
        self.in_flight: dict[int, Flight] = {}     # window id -> what its rows serve
        self.groups = [Group() for _ in range(cfg.groups)]
        self.commits: list[tuple[int, int]] = []   # ride on the next window submitted
        self.speculation = Speculation(cfg)         # drafts: offered, asked for, accepted
        self._ids = itertools.count(1)

    # --- requests -----------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams,
               on_token: Callable[[int], None] = lambda t: None,
               on_done: Callable[[Request], None] = lambda r: None,
               grammar: Constraint | None = None) -> Request:
        """grammar: structured output, a fresh matcher of the request's own (grammar.py)."""
        seq = Sequence(prompt, params.with_seed(), self.stop_ids, self.cfg.ctx, self.detokenize,
                       on_token=on_token, grammar=grammar)
        req = Request(next(self._ids), seq, on_done)
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
        """Nothing queued, in flight, in a slot or left to commit: step() has nothing to do."""
        return (not self.queue and not self.in_flight and not self.commits
                and all(s.free for s in self.table.slots))

    def snapshot(self) -> SchedulerSnapshot:
        views = []
        for slot in self.table.slots:
            req = slot.request
            if req is None:
                views.append(SlotState(slot.index, slot.group, "idle", held=len(slot.held)))
                continue
            prompt = len(req.seq.prompt)
            state = ("rebuilding" if slot.read_pos < slot.rebuild else
                     "reading" if slot.reading else "decoding")
            views.append(SlotState(slot.index, slot.group, state,
                                   req.id, prompt, slot.read_pos, req.reused,
                                   len(req.seq.generated),
                                   draft_counts=req.drafts.counts.copy()))
        return SchedulerSnapshot(tuple(views), tuple(g.flights for g in self.groups),
                                 len(self.queue), tuple(g.last_decode for g in self.groups),
                                 self.speculation.counts.copy(), self.speculation.choices())

    # --- the loop -----------------------------------------------------------------------------

    def step(self, timeout: float | None = None) -> bool:
        """Admit, fill every idle group with a window, then handle one result.
        Returns False when there was nothing to do."""
        # cancelled requests with no row in flight leave now (decoding ahead, a group may
        # always have a window in flight)
        cancelled = [s for s in self.table.slots if s.request is not None and s.request.cancelled]
        if cancelled:
            flying = {o.slot.index for f in self.in_flight.values() for o in f.owners}
            for slot in cancelled:
                if slot.index not in flying:
                    self._release(slot, slot.request, "cancelled")
        self._admit()
        for group in range(self.cfg.groups):
            while self._launch(group):
                pass
        if not self.in_flight:
            if not self.commits:
                return False
            # idle with commits pending (a finished or cancelled slot's decoded rows): carry them
            # on a window of pad rows (the smallest decode window), so no stage keeps rows no
            # slot holds
            self._submit(0, [], self.cfg.window_shape(1), [])
        try:
            result, _ = self.pipe.receive(timeout=timeout)
        except WindowFailed as e:
            flight = self.in_flight.pop(e.error.window, None)
            if flight is None:  # about no window in flight (-1: none): no group changes
                log.error("dropped an error about no window in flight: %s", e)
            else:
                self._fail(flight, str(e))
            return True
        flight = self.in_flight.pop(result.id, None)
        if flight is None:  # not a window of ours (another coordinator's?): nothing lands
            log.error("dropped a result for window %d, which is not in flight", result.id)
            return True
        self._landed(flight.group, result.id)
        self.speculation.landed(flight.group, self.clock())   # times its decode windows
        if (len(result.tokens) != sum(o.sampled for o in flight.owners)
                or len(result.logprobs) != sum(o.logprobs for o in flight.owners)):
            self._fail(flight, f"window {result.id} came back with {len(result.tokens)} tokens "
                               f"and {len(result.logprobs)} log-probabilities, not what it "
                               f"asked for", landed=False)   # (landed above)
            return True
        sampled = iter(result.tokens)
        scored = iter(zip(result.logprobs, result.top_ids, result.top_logprobs))
        proposals = {p[0]: p[1:] for p in result.proposals}   # slot -> d1..dk
        kept = iter(self.speculation.verify(flight.owners, result.tokens))
        for o in flight.owners:
            drafts_kept = next(kept)
            tokens = [next(sampled) for _ in range(o.sampled)]
            entries = [next(scored) for _ in range(o.logprobs)]
            prompt, logprobs = entries[:len(o.scores)], entries[len(o.scores):]
            if o.request.cancelled:
                self._release(o.slot, o.request, "cancelled")
                continue
            if o.request.notified:   # a row decoded ahead of a window that ended its request
                continue
            seq = o.request.seq
            for position, entry in zip(o.scores, prompt):
                seq.prompt_logprobs[position] = TokenLogprob.of(seq.prompt[position], entry)
            if tokens:
                self._accept(o.slot, o.request, tokens, o.drafts, drafts_kept,
                             proposals.get(o.slot.index, []),
                             [TokenLogprob.of(t, e) for t, e in zip(tokens, logprobs)])
            elif o.ends:
                self._release(o.slot, o.request, "length")
        return True

    def _accept(self, slot: Slot, req: Request, tokens: list[int], drafts: list[int],
                kept: int, proposals: list[int] = (), logprobs: list[TokenLogprob] = ()
                ) -> None:
        """The slot's sampled tokens, `kept` of its drafts kept (speculation.py): the request
        ends, or the KV of the drafts it did not keep is dropped."""
        start = req.seq.length
        kept, done = self.speculation.accept(req, tokens, drafts, kept, proposals, logprobs)
        if done:
            req.error = req.error or req.seq.error
            self._release(slot, req, req.seq.finish_reason)
        elif kept < len(drafts):  # rows of rejected drafts hold KV past L + kept: drop it
            self.commits.append((slot.index, start + kept))

    def run(self) -> None:
        while self.step():
            pass

    # --- mechanics ----------------------------------------------------------------------------

    def _admit(self) -> None:
        while self.queue:
            seq = self.queue[0].seq
            # a request that scores its prompt reads all of it: a held prefix has no logits
            chosen = self.table.choose(seq.prompt, self._group_load,
                                       reuse=seq.params.prompt_logprobs is None)
            if chosen is None:
                return
            slot, reuse = chosen
            req = self.queue.popleft()
            req.slot, req.reused = slot, reuse
            slot.request, slot.read_pos, slot.rebuild = req, reuse, 0
            del slot.held[reuse:]
            self.commits.append((slot.index, reuse))
            if reuse:
                log.info("request %d: slot %d reuses %d of %d prompt tokens", req.id, slot.index,
                         reuse, len(req.seq.prompt))

    def _group_load(self, group: int) -> tuple[int, int]:
        """(busy slots, prompt tokens left to read): a new request joins the least loaded group.
        A heuristic: decode work still to come (max_tokens) is not counted."""
        busy = [s for s in self.table.in_group(group) if not s.free]
        return len(busy), sum(max(len(s.request.seq.prompt), s.rebuild) - s.read_pos
                              for s in busy if s.reading)

    def _launch(self, group: int) -> bool:
        """Submit the group's next window if it may have one now; True if one was sent."""
        g = self.groups[group]
        behind = g.flights == 1 and g.followable is not None   # decoding ahead (ahead.py)
        if g.flights and not behind:
            # only the streaming slot's next prompt chunk may go, while no slot decodes
            slot = g.streaming
            if (slot is None or slot.request is None or not slot.reading
                    or slot.request.cancelled or g.flights >= self.cfg.prompt_depth
                    or any(s.request is not None and not s.reading
                           for s in self.table.in_group(group))):
                return False
            self._submit_chunk(group, slot)
            return True
        reading, decoding = [], []
        for s in self.table.in_group(group):
            if s.request is not None:
                (reading if s.reading else decoding).append(s)
        return self._choose(group, reading, decoding,
                            self.in_flight[g.followable] if behind else None)

    def _choose(self, group: int, reading: list[Slot], decoding: list[Slot],
                followed: Flight | None = None) -> bool:
        """Submit the group's next window: a prompt chunk or a decode window (DESIGN.md, which
        window next); with `followed`, the window in flight, behind it (ahead.py). True if
        one was sent."""
        g = self.groups[group]
        # while the decode window can take one more row, up to CHUNKS_FIRST chunks go first
        first = len(decoding) < self.cfg.window_rows and g.ahead < CHUNKS_FIRST
        if reading and (g.prefer_read or not decoding or first):
            slot = min(reading, key=lambda s: s.request.id)
            if followed is not None and slot.request.cancelled:   # it ends when that lands
                return False
            g.prefer_read = False
            g.ahead += bool(decoding)
            self._submit_chunk(group, slot)
        elif decoding:
            if not self._submit_decode(group, decoding, followed):
                return False
            g.prefer_read = True
            g.ahead = 0
        else:
            return False
        return True

    def _submit_decode(self, group: int, decoding: list[Slot],
                       followed: Flight | None = None) -> bool:
        """The next decode window of the group: up to window_rows decoding slots (in rotation),
        each with the drafts speculation.py offers it; with `followed` (in flight), behind it,
        a slot waiting for its token there reading its pick (ahead.py). False when none went:
        decoding ahead is not possible now."""
        g = self.groups[group]
        # in slot order, from the slot after the last one served: slots that join or leave
        # don't make others skip their turn
        order = ([s for s in decoding if s.index > g.cursor]
                 + [s for s in decoding if s.index <= g.cursor])
        chosen = order[: self.cfg.window_rows]
        if followed is not None:
            window = ahead.decode_rows(chosen, followed)
            if window is None:
                return False
            rows, owners, follows = window
            # a row reading a pick names it; with every token here it is a window of its own
            extra = dict(after=g.followable, follows=follows) if max(follows) >= 0 else {}
        else:
            offer = self.speculation.offer(group, chosen)
            rows, owners, masks = [], [], WindowMasks()
            for s, drafts in zip(chosen, offer.drafts):
                seq = s.request.seq
                mask = masks.add(seq.grammar, drafts) if seq.grammar is not None else None
                rows += seq.decode_rows(s.index, drafts, -1 if mask is None else mask)
                owners.append(RowOwner(s, s.request, 1 + len(drafts), drafts))
            extra = dict(propose=offer.propose, timed=offer.timed, masks=masks)
        g.cursor = chosen[-1].index
        shape = self.cfg.window_shape(len(rows))   # offer.rows, or a small window
        if self._submit(group, rows, shape, owners, **extra) is not None:
            g.last_decode = DecodeWindow(shape, len(rows))
        return True

    def _submit_chunk(self, group: int, slot: Slot) -> None:
        seq, start = slot.request.seq, slot.read_pos
        if start >= len(seq.prompt):
            self._submit_rebuild(group, slot)
            return
        end = min(start + self.cfg.chunk_rows, len(seq.prompt))
        rows = [seq.scored_row(slot.index, p) for p in range(start, end)]
        scores = tuple(r.position + 1 for r in rows if r.score is not None)
        # the prompt's last row samples the first token, unless that was sampled before a
        # rebuild, or the request asks for none (max_tokens 0: it ends with its prompt)
        ends = end == len(seq.prompt) and not slot.rebuild
        last = ends and seq.params.max_tokens > 0
        masks = WindowMasks()
        if last:
            mask = masks.add(seq.grammar, []) if seq.grammar is not None else -1
            rows[-1] = seq.sampled_row(slot.index, end - 1, seq.prompt[end - 1], mask)
        slot.read_pos = end
        slot.held.extend(seq.prompt[start:end])
        self.groups[group].streaming = slot if slot.reading else None
        # after its first token, the slot decodes beside the group's decoding slots
        decoding = sum(not s.free and not s.reading
                       for s in self.table.in_group(group))
        propose = (self.speculation.ask(group, [slot], min(decoding, self.cfg.window_rows))
                   if last else [])
        owner = RowOwner(slot, slot.request, int(last), scores=scores, ends=ends and not last)
        self._submit(group, rows, self.cfg.chunk_rows, [owner], chunk=True, propose=propose,
                     masks=masks)

    def _submit(self, group: int, rows: list[Row], shape: int, owners: list[RowOwner],
                chunk: bool = False, propose: list[tuple[int, int]] = (),
                timed: tuple[int, int] | None = None, masks: WindowMasks | None = None,
                after: int = -1, follows: list[int] = ()) -> int | None:
        """Sends the window; returns its id, or None when it could not be built or sent (its
        requests ended). timed: a decode window's (rows, proposals a slot), under which
        draft_choice.py keeps its time. masks: the token masks its rows index (structured
        output). after, follows: a window that decodes ahead (build_window)."""
        commits, self.commits = self.commits, []
        try:
            w = build_window(self.pipe.new_window_id(), rows, shape, commits, chunk=chunk,
                             propose=propose, coupled=self.cfg.draft_sampling == "coupled",
                             masks=masks.fill() if masks is not None else None,
                             after=after, follows=follows)
            self.pipe.submit(w)
        except PipelineError:
            raise
        except Exception as e:  # e.g. a sampling parameter the wire cannot carry
            # a window of commits only holds small ints, which always encode
            assert owners, f"a window of commits only failed: {e!r}"
            # nothing reached the stages: the commits ride on the next window, and only the
            # requests of this window end
            self.commits = commits + self.commits
            self._fail(Flight(group, owners), f"the coordinator could not send its window "
                       f"({type(e).__name__}: {e})", landed=False)
            return None
        self.in_flight[w.id] = Flight(group, owners)
        self.groups[group].flights += 1
        # decoding ahead: the group's next window may go behind this one (ahead.py)
        self.groups[group].followable = w.id if ahead.allowed(self.cfg) else None
        self.speculation.sent(group, self.clock(), timed, decode=not chunk)
        return w.id

    def _landed(self, group: int, window: int) -> None:
        g = self.groups[group]
        g.flights -= 1
        if g.followable == window:
            g.followable = None
        if not g.flights:
            g.streaming = None

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
        req.drafts.proposals = []   # for a window that will not come
        req.notified = True
        req.on_done(req)

    def _fail(self, flight: Flight, message: str, landed: bool = True) -> None:
        """A window failed (a stage refused it, or it could not be sent: landed=False): every
        request with a row in it ends with the error (a decode window's neighbours too); the
        rest go on."""
        if landed:
            self._landed(flight.group, -1)
        g = self.groups[flight.group]
        g.followable = None   # a window that would follow it is refused too
        if any(o.slot is g.streaming for o in flight.owners):
            g.streaming = None  # its chunks stop here
        log.error("window failed: %s", message)
        for o in flight.owners:
            slot, req = o.slot, o.request
            if req.notified:  # a later chunk of a request that already ended (cancelled)
                if slot.free:  # its slot kept rows this window never wrote: keep none
                    slot.held.clear()
                    self.commits.append((slot.index, 0))
                continue
            req.error = message
            if slot.request is req:
                slot.held.clear()  # the stages may hold part of the window: keep nothing
            self._release(slot, req, "error")
        if landed:   # the stage that refused it did not apply its commits: every free slot's
            self.commits += [(s.index, len(s.held)) for s in self.table.slots if s.free]

    # --- a stage started again (rebuild.py) ---------------------------------------------------

    def restarted(self) -> None:
        """A stage was started again, and its KV cache is empty: every window in flight is
        given up, no slot holds a prompt any more, and each request in a slot writes its KV
        again from position 0 before it goes on to exactly the tokens it would have had."""
        self.in_flight.clear()
        for g in self.groups:
            g.flights, g.streaming, g.followable = 0, None, None
        self.speculation.restarted()   # a decode window given up is not timed
        self.commits = [(slot.index, 0) for slot in self.table.slots]
        for slot in self.table.slots:
            slot.held.clear()
            req = slot.request
            if req is None:
                continue
            if req.cancelled:
                self._release(slot, req, "cancelled")
            else:
                start_rebuild(slot)

    def _submit_rebuild(self, group: int, slot: Slot) -> None:
        """The slot's next decode window of decoded tokens written again, sampling nothing."""
        rows = decoded_rows(slot, self.cfg.chunk_rows)
        slot.read_pos += len(rows)
        self.groups[group].streaming = slot if slot.reading else None
        self._submit(group, rows, round_rows(len(rows)), [RowOwner(slot, slot.request, 0)])
