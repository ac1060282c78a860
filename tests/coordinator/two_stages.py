"""Two fake stages in a row for the scheduler's restart tests (test_scheduler_restart.py),
closer to the real ones than test_scheduler's single KV: stage 0 computes a window when the
coordinator's receive comes (every window sent by then), stage 1 the one it hands back, so
windows in flight have passed stage 0 or not; a stage started again loses its KV, and the
windows given up still reach the stages after it (a surviving stage 1 computes them; a new
stage refuses those that would leave a gap), before the rebuild's windows, as the real stages
take windows in order (DESIGN.md, Starting a stage again). Crashing has a stage go at a given
call; serve, sweep and reference run requests through them.
"""
from __future__ import annotations

import random
from collections import deque

from strata.coordinator.stages.pipeline import PipelineError, WindowFailed
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.protocol.messages import Error, Result
from strata.protocol.transport import pack, unpack
from test_scheduler import STOP

WRONG = 1   # a draft no fake stage ever samples (their tokens are 2..61)
DECODED = 1000   # a decode row's KV differs from a prompt row's of the same token


class TwoStages:
    """Stage 0's KV of a row is its token (+ DECODED when a decode window wrote it); it hands
    stage 1 a digest of the row's history there, which is stage 1's KV of the row; a sampled
    row's token is a digest of its history at stage 1, its position and its draw. So a row
    missing, stale or written by the wrong kind of window at either stage changes every token
    after it. `repeat`: the token repeats the one four places back, bumped by a draw above 0.8
    or now and then by the digest (prompt lookup's drafts are often right). `truth`: each
    request's prompt and solo tokens: stage 1 answers `propose` as an mtp drafter would, from
    `policy(slot, window id)`: true, wrong, mix (the first true), none."""

    def __init__(self, slots: int, ctx: int, repeat: bool = False, truth=None, policy=None):
        self.ctx, self.repeat, self.truth, self.policy = ctx, repeat, truth, policy
        self.kv = [[[] for _ in range(slots)] for _ in range(2)]   # kv[stage][slot]
        self.tokens = [[] for _ in range(slots)]   # stage 1's tokens by position
        self.inbox: deque = deque()       # sent, not yet at stage 0
        self.passed: deque = deque()      # (window, activations): stage 0 done, not stage 1
        self.refused: deque = deque()     # Errors of stage 0, not yet received
        self.stale: set[int] = set()      # windows given up by a restart
        self.proposed: dict[int, list[int]] = {}   # slot -> the last proposals for it
        self.next_id = 0
        self.fail_ids: set[int] = set()   # windows stage 1 refuses (a failed window)

    def new_window_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def submit(self, w) -> None:
        w, _ = unpack(pack(w))   # as the wire carries it
        self.inbox.append(w)

    def lose(self, stage: int) -> None:
        """`stage` is started again: its KV is gone, and so are the drafter's proposals."""
        self.stale |= {w.id for w in self.inbox} | {w.id for w, _ in self.passed}
        for kv in self.kv[stage]:
            kv.clear()
        if stage == 1:
            for t in self.tokens:
                t.clear()
        self.proposed.clear()

    @property
    def idle(self) -> bool:
        return not (self.inbox or self.passed or self.refused)

    def receive(self, timeout=None):
        while self.inbox:   # stage 0 takes every window sent so far
            w = self.inbox.popleft()
            acts = self._compute(0, w)
            if acts is None:
                self.refused.append(Error(0, w.id, "a gap"))
            else:
                self.passed.append((w, acts))
        if self.refused:
            raise WindowFailed(self.refused.popleft())
        w, acts = self.passed.popleft()
        if w.id in self.fail_ids:
            raise WindowFailed(Error(1, w.id, "injected failure"))
        self._check_drafts(w)
        digests = self._compute(1, w, acts)
        if digests is None:
            raise WindowFailed(Error(1, w.id, "a gap"))
        tokens = []
        for row, u in zip(w.sample_rows, w.u):
            s, p = w.slots[row], w.positions[row]
            tokens.append(self._token(digests[row], p, u, self.tokens[s][:p + 1]))
        return Result(w.id, tokens, proposals=self._propose(w, tokens)), []

    def _compute(self, stage: int, w, acts=None) -> list[int] | None:
        """The stage's rows of w (None: refused, as a gap); each row's digest."""
        kv = self.kv[stage]
        reach = [len(h) for h in kv]
        for s, length in w.commits:
            reach[s] = min(reach[s], length)
        for s, p in zip(w.slots, w.positions):
            if s >= 0:
                if p > reach[s]:
                    assert w.id in self.stale, f"stage {stage}: slot {s} holds {reach[s]}, " \
                                               f"window {w.id} writes {p}"
                    return None
                assert p < self.ctx, (s, p)
                reach[s] = max(reach[s], p + 1)
        for s, length in w.commits:
            del kv[s][length:]
            if stage == 1:
                del self.tokens[s][length:]
        out = []
        for i, (s, p, t) in enumerate(zip(w.slots, w.positions, w.tokens)):
            if s < 0:
                out.append(0)
                continue
            del kv[s][p:]
            kv[s].append(t + DECODED * (not w.chunk) if stage == 0 else acts[i])
            if stage == 1:
                del self.tokens[s][p:]
                self.tokens[s].append(t)
            out.append(hash(tuple(kv[s])))
        return out

    def _token(self, digest: int, p: int, u: float, history: list[int]) -> int:
        if not self.repeat:
            return (digest + 13 * p + int(u * 1000)) % 60 + 2   # 2 = STOP
        back = history[-4] if len(history) >= 4 else 3
        return (back - 3 + (u > 0.8 or digest % 7 == 0)) % 11 + 3

    def _check_drafts(self, w) -> None:
        """mtp: a decode window's drafts for a slot are a prefix of the last proposals."""
        if self.truth is None or w.chunk or w.id in self.stale:
            return
        sampled = [(w.slots[r], w.tokens[r]) for r in w.sample_rows]   # a rebuild's: none
        for slot in {s for s, _ in sampled}:
            drafts = [t for s, t in sampled if s == slot][1:]
            assert drafts == self.proposed.get(slot, [])[:len(drafts)], (slot, drafts)

    def _propose(self, w, tokens: list[int]) -> list[list[int]]:
        if self.truth is None:
            return []
        sampled: dict[int, list[tuple[int, int, int]]] = {}   # slot -> (position, in, out)
        for row, token in zip(w.sample_rows, tokens):
            sampled.setdefault(w.slots[row], []).append(
                (w.positions[row], w.tokens[row], token))
        for slot in sampled:
            self.proposed[slot] = []
        proposals = []
        for slot, k in w.propose:
            rows = sampled[slot]
            a = 0   # drafts kept: leading rows whose input is the token sampled before
            while a + 1 < len(rows) and rows[a + 1][1] == rows[a][2]:
                a += 1
            history = self.tokens[slot][:rows[0][0] + a + 1] + [rows[a][2]]
            mode = self.policy(slot, w.id)
            if mode == "none":
                continue
            true = next((full[len(history):] for full in self.truth
                         if full[:len(history)] == history), [])
            true = (true + [WRONG] * k)[:k]
            drafts = {"true": true, "wrong": [WRONG] * k,
                      "mix": true[:1] + [WRONG] * (k - 1)}[mode]
            self.proposed[slot] = drafts
            proposals.append([slot, *drafts])
        return proposals


def random_policy(seed: int):
    rng = random.Random(seed)
    memo: dict[tuple[int, int], str] = {}
    return lambda slot, wid: memo.setdefault(
        (slot, wid), rng.choice(("true", "true", "mix", "wrong", "none")))


class Crashing(TwoStages):
    """TwoStages whose n-th call of submit or receive (counted together) finds stage k gone:
    crashes = {n: k}. The windows in flight then are given up (lose)."""

    def __init__(self, *args, crashes: dict[int, int] = None, **kw):
        super().__init__(*args, **kw)
        self.crashes, self.calls = dict(crashes or {}), 0
        self.came: dict[int, int] = {}   # window id -> the call that received it

    def _call(self) -> None:
        self.calls += 1
        stage = self.crashes.pop(self.calls, None)
        if stage is not None:
            self.lose(stage)
            raise PipelineError(f"stage {stage} has gone", stage=stage)

    def submit(self, w) -> None:
        self._call()
        super().submit(w)

    def receive(self, timeout=None):
        self._call()
        if self.refused:
            self.came[self.refused[0].window] = self.calls
        elif self.passed:
            self.came[self.passed[0][0].id] = self.calls
        return super().receive(timeout)


def serve(pipe: Crashing, cfg: SchedulerConfig, ps, ps_params, each_step=None):
    """The requests together; a PipelineError restarts (as the engine does). Returns the
    scheduler, its requests and, for each restart, the lengths of the sequences in slots."""
    sched = Scheduler(pipe, cfg, frozenset({STOP}))
    reqs = [sched.submit(p, sp) for p, sp in zip(ps, ps_params)]
    restarts = []
    for _ in range(10_000):
        try:
            if not sched.step():
                break
        except PipelineError:
            restarts.append([s.request.seq.length for s in sched.table.slots if s.request])
            sched.restarted()
        if each_step is not None:
            each_step(sched, reqs)
    else:
        raise AssertionError("the scheduler never ran out of work")
    return sched, reqs, restarts


def assert_stages_hold_what_slots_hold(sched: Scheduler, pipe: TwoStages) -> None:
    assert pipe.idle and sched.idle
    for slot in sched.table.slots:   # a held prompt, read as prompt, and nothing else
        assert pipe.kv[0][slot.index] == slot.held, slot.index
        assert len(pipe.kv[1][slot.index]) == len(slot.held), slot.index


def sweep(cfg: SchedulerConfig, ps, ps_params, want, crash_sets, pipe_kw=None):
    """For each crash set, serve with those crashes; every request ends with its solo tokens
    and finish reason. Returns each run's restarts (serve)."""
    runs = []
    for crashes in crash_sets:
        pipe = Crashing(cfg.slots, cfg.ctx, crashes=crashes, **(pipe_kw or {}))
        sched, reqs, restarts = serve(pipe, cfg, ps, ps_params)
        got = [(r.seq.generated, r.seq.finish_reason) for r in reqs]
        assert got == want, f"crashes {crashes}"
        assert_stages_hold_what_slots_hold(sched, pipe)
        runs.append(restarts)
    return runs


def calls_of(cfg, ps, ps_params, pipe_kw=None) -> int:
    pipe = Crashing(cfg.slots, cfg.ctx, **(pipe_kw or {}))
    serve(pipe, cfg, ps, ps_params)
    return pipe.calls


def reference(ps, ps_params, ctx=128, repeat=False):
    out = []
    for p, sp in zip(ps, ps_params):
        sched = Scheduler(TwoStages(1, ctx, repeat), SchedulerConfig(slots=1, ctx=ctx,
                                                                     chunk_rows=8),
                          frozenset({STOP}))
        req = sched.submit(p, sp)
        sched.run()
        out.append((req.seq.generated, req.seq.finish_reason))
    return out
