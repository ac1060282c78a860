"""A stage started again (Scheduler.restarted) at every step of a schedule, against two fake
stages: every request in a slot rebuilds its KV and ends with exactly its solo tokens, with
several groups, streamed prompts, drafts (prompt lookup and mtp), cancels, the conversation
cache, a context nearly full, a window refused just before, and a restart during the rebuild
of another; afterwards each stage holds exactly what each slot says it holds.

The fake stages are closer to the real ones than test_scheduler's single KV: stage 0 computes
a window when the coordinator's receive comes (every window sent by then), stage 1 the one it
hands back, so windows in flight have passed stage 0 or not; a stage started again loses its
KV, and the windows given up still reach the stages after it (a surviving stage 1 computes
them; a new stage refuses those that would leave a gap), before the rebuild's windows, as
the real stages take windows in order (DESIGN.md, Starting a stage again).
"""
from __future__ import annotations

import random
from collections import deque

import pytest

from strata.coordinator.pipeline import PipelineError, WindowFailed
from strata.coordinator.scheduler import Scheduler, SchedulerConfig
from strata.protocol.messages import Error, Result
from strata.protocol.transport import pack, unpack
from test_scheduler import STOP, params, prompts

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


@pytest.mark.parametrize("slots,groups,depth", [(2, 1, 1), (4, 2, 3)])
def test_a_restart_at_any_step_gives_solo_tokens(slots, groups, depth):
    """Serial or two groups with streamed prompts; stage 0 or 1 goes at each call in turn,
    mid-prompt, mid-decoding, and once while two requests are one token from their stop."""
    rng = random.Random(3)
    ps = [[rng.randrange(3, 60) for _ in range(n)] for n in (3, 30, 12, 1, 20)]
    ps_params = [params(i, 6) for i in range(len(ps))]
    want = reference(ps, ps_params)
    cfg = SchedulerConfig(slots=slots, groups=groups, prompt_depth=depth, chunk_rows=8,
                          ctx=128)
    n = calls_of(cfg, ps, ps_params)
    runs = sweep(cfg, ps, ps_params, want, [{k: k % 2} for k in range(1, n + 1)])
    assert all(runs)
    # a request that ends with a stop token on the first window after its rebuild
    lengths = {length for restarts in runs for slots in restarts for length in slots}
    stops = {len(p) + len(g) for p, (g, reason) in zip(ps, want) if reason == "stop"}
    assert len(stops) == 2 and stops <= lengths


def test_a_second_restart_during_the_rebuild_of_the_first():
    """Stage 1 goes, then stage 0 (or stage 1 again) 1 to 6 calls later, mid-rebuild."""
    rng = random.Random(5)
    ps = [[rng.randrange(3, 60) for _ in range(n)] for n in (25, 9, 17, 4)]
    ps_params = [params(i, 8) for i in range(len(ps))]
    want = reference(ps, ps_params)
    cfg = SchedulerConfig(slots=4, groups=2, prompt_depth=2, chunk_rows=8, ctx=128)
    n = calls_of(cfg, ps, ps_params)
    sets = [{k: 1, k + d: d % 2} for k in range(8, n, 7) for d in range(1, 7)]
    sweep(cfg, ps, ps_params, want, sets)


@pytest.mark.parametrize("drafter", ["lookup", "mtp"])
def test_drafts_across_a_restart_give_solo_tokens(drafter):
    """Drafts kept and rejected before and after a restart at any step; mtp proposals in hand
    are dropped (the fake checks each window's drafts are a prefix of the last proposals, and
    a stage started again proposed none)."""
    rng = random.Random(9)
    repeat = drafter == "lookup"
    ps = [[rng.randrange(3, 14) for _ in range(n)] for n in (6, 14, 2, 9, 20, 3)]
    ps_params = [params(i, 12) for i in range(len(ps))]
    want = reference(ps, ps_params, repeat=repeat)
    kw = ({"repeat": True} if repeat else
          {"truth": [p + g for p, (g, _) in zip(ps, want)], "policy": random_policy(3)})
    # two slots a group: a slot's proposals wait while its group reads another's prompt
    cfg = SchedulerConfig(slots=4, groups=2, chunk_rows=8, ctx=128, draft_tokens=3,
                          drafter=drafter)
    pipe = Crashing(cfg.slots, cfg.ctx, **kw)
    sched, reqs, _ = serve(pipe, cfg, ps, ps_params)
    assert 0 < sum(r.accepted for r in reqs) < sum(r.drafted for r in reqs)
    n = pipe.calls
    sweep(cfg, ps, ps_params, want, [{k: k % 2} for k in range(1, n + 1)], kw)


def test_a_request_cancelled_while_its_slot_rebuilds_ends_once_and_leaves_no_rows():
    """Stage 1 goes while request 1 decodes; request 1 is cancelled at each step of its
    rebuild: it ends once, cancelled, with a prefix of its solo tokens; its slot keeps only
    the prompt the stages hold; the others end with their solo tokens."""
    rng = random.Random(2)
    ps = [[rng.randrange(3, 60) for _ in range(n)] for n in (21, 30, 5)]
    ps_params = [params(i, 8) for i in range(len(ps))]
    want = reference(ps, ps_params)
    cfg = SchedulerConfig(slots=3, prompt_depth=2, chunk_rows=8, ctx=128)
    rebuilding = 0
    for at in range(1, 12):
        pipe = Crashing(3, 128)
        sched = Scheduler(pipe, cfg, frozenset({STOP}))
        done = []
        reqs = [sched.submit(p, sp, on_done=done.append) for p, sp in zip(ps, ps_params)]
        while len(reqs[1].seq.generated) < 2:
            sched.step()
        pipe.crashes = {pipe.calls + 1: 1}
        steps = 0
        while True:
            try:
                if not sched.step():
                    break
            except PipelineError:
                sched.restarted()
            steps += not pipe.crashes
            if steps == at:
                state = sched.snapshot().slots[reqs[1].slot.index].state
                rebuilding += state == "rebuilding"
                sched.cancel(reqs[1])
        assert sorted(r.id for r in done) == [r.id for r in reqs]   # each ends once
        for r, (tokens, reason) in zip(reqs, want):
            if r is reqs[1]:
                assert r.seq.finish_reason == "cancelled"
                assert r.seq.generated == tokens[:len(r.seq.generated)]
            else:
                assert (r.seq.generated, r.seq.finish_reason) == (tokens, reason)
        assert_stages_hold_what_slots_hold(sched, pipe)
    assert rebuilding >= 5


def test_a_prompt_held_before_a_restart_is_not_reused_after_it():
    """Turn 1 ends and its slot holds its prompt; a stage goes (stage 0 or 1, while idle, or
    while the commit-only window of turn 1's end is in flight); turn 2, whose prompt begins
    with turn 1's, reads it all again and gets the tokens of a fresh read."""
    first = [5, 9, 11, 13, 17, 19, 23, 29, 31, 37]
    cfg = SchedulerConfig(slots=2, chunk_rows=4, ctx=128)
    (answer, _), = reference([first], [params(0, 5)])
    second = first + answer + [41, 43]
    want = reference([second], [params(1, 5)])
    for crash in ("idle", "commit"):
        for stage in (0, 1):
            pipe = Crashing(2, 128)
            sched = Scheduler(pipe, cfg, frozenset({STOP}))
            turn1 = sched.submit(first, params(0, 5))
            while not turn1.done:
                sched.step()
            assert sched.commits   # turn 1's end, for a commit-only window
            if crash == "commit":
                pipe.crashes = {pipe.calls + 2: stage}   # the commit-only window's receive
                with pytest.raises(PipelineError):
                    sched.step()
                assert [all(s < 0 for s in w.slots) for w in pipe.inbox] == [True]
            else:
                sched.run()
                pipe.lose(stage)
            sched.restarted()
            turn2 = sched.submit(second, params(1, 5))
            sched.run()
            assert turn2.reused == 0
            assert [(turn2.seq.generated, turn2.seq.finish_reason)] == want
            assert_stages_hold_what_slots_hold(sched, pipe)


def test_a_request_that_reused_a_held_prompt_rebuilds_it_all():
    """Turn 2 reuses turn 1's prompt from its slot, then a stage goes at any step of turn 2:
    its tokens are those of reading its whole prompt fresh, and it no longer counts as reusing
    any (/v1/status: of the tokens read, those held from an earlier request)."""
    first = [5, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41]
    cfg = SchedulerConfig(slots=2, groups=2, prompt_depth=2, chunk_rows=4, ctx=128)
    (answer, _), = reference([first], [params(1, 4)])
    second = first + answer + [43, 47, 53]
    other = [7, 8, 9, 10, 11]
    want = reference([second, other], [params(1, 9), params(2, 9)])
    k, seen = 0, set()
    while True:
        k += 1
        pipe = Crashing(2, 128)
        sched = Scheduler(pipe, cfg, frozenset({STOP}))
        sched.submit(first, params(1, 4))
        sched.run()
        start = pipe.calls
        pipe.crashes = {start + k: k % 2}
        reqs = [sched.submit(second, params(1, 9)), sched.submit(other, params(2, 9))]
        rebuilt = False
        while True:
            try:
                if not sched.step():
                    break
            except PipelineError:
                sched.restarted()
                rebuilt = not reqs[0].done
            assert sched.snapshot().slots[reqs[0].slot.index].reused <= reqs[0].slot.read_pos
        assert [(r.seq.generated, r.seq.finish_reason) for r in reqs] == want
        assert reqs[0].reused == (0 if rebuilt else len(first))
        assert_stages_hold_what_slots_hold(sched, pipe)
        seen.add(bool(pipe.crashes))
        if pipe.crashes:   # past the last call: every step was tried
            break
    assert seen == {True, False} and k > 20


@pytest.mark.parametrize("drafts", [0, 3])
def test_a_restart_near_the_end_of_the_context(drafts):
    """Requests that run into the end of the context (ctx 40), with drafts near the end or
    without: a stage goes at any step (without drafts, once while a sequence holds 39
    tokens); they end at ctx with their solo tokens."""
    ps = [[3 + i % 11 for i in range(30)], [4, 5, 6, 7] * 8 + [8]]
    ps_params = [params(0, 50), params(1, 50)]
    want = reference(ps, ps_params, ctx=40, repeat=True)
    assert [len(p) + len(g) for p, (g, _) in zip(ps, want)] == [40, 40]
    assert {reason for _, reason in want} == {"length"}
    cfg = SchedulerConfig(slots=2, chunk_rows=8, ctx=40, draft_tokens=drafts)
    n = calls_of(cfg, ps, ps_params, {"repeat": True})
    runs = sweep(cfg, ps, ps_params, want, [{k: 1} for k in range(1, n + 1)], {"repeat": True})
    lengths = {length for restarts in runs for slots in restarts for length in slots}
    assert drafts or 39 in lengths


def test_a_restart_right_after_a_window_failed():
    """A stage refuses request 1's decode window (it ends with the error), then a stage goes
    1 to 8 calls later: the others end with their solo tokens, request 1's slot keeps none
    of its rows."""
    rng = random.Random(4)
    ps = [[rng.randrange(3, 60) for _ in range(n)] for n in (12, 7, 19)]
    ps_params = [params(i, 10) for i in range(len(ps))]
    want = reference(ps, ps_params)
    cfg = SchedulerConfig(slots=3, groups=3, chunk_rows=8, ctx=128)

    def run(crashes, fail: int):
        pipe = Crashing(3, 128, crashes=crashes)
        pipe.fail_ids.add(fail)
        sched, reqs, _ = serve(pipe, cfg, ps, ps_params)
        return pipe, sched, reqs

    probe = Crashing(3, 128)
    windows = []
    submit = probe.submit
    probe.submit = lambda w: (windows.append(w), submit(w))
    serve(probe, cfg, ps, ps_params)
    fail = [w for w in windows if not w.chunk and 1 in w.slots][2].id   # its third
    pipe, sched, reqs = run({}, fail)
    failed = reqs[1].seq.generated
    assert reqs[1].seq.finish_reason == "error" and 0 < len(failed) < len(want[1][0])
    at = pipe.came[fail]
    for k in range(at + 1, at + 9):
        pipe, sched, reqs = run({k: k % 2}, fail)
        assert reqs[1].seq.finish_reason == "error" and reqs[1].seq.generated == failed
        assert [(r.seq.generated, r.seq.finish_reason) for r in reqs[::2]] == want[::2]
        assert_stages_hold_what_slots_hold(sched, pipe)


def test_a_decode_window_given_up_is_not_timed():
    """draft_tokens auto times each group's decode windows: the decode window in flight when
    a stage goes never comes back, and the window that next comes back (the rebuild's) is
    not timed as it, over the seconds the stage took to start again."""
    now = [0.0]

    def clock() -> float:
        now[0] += 0.01   # 10 ms a window
        return now[0]

    rng = random.Random(6)
    ps = [[rng.randrange(3, 14) for _ in range(n)] for n in (9, 4)]
    cfg = SchedulerConfig(slots=2, chunk_rows=8, ctx=128, draft_tokens="auto")
    pipe = Crashing(2, 128, repeat=True)
    sched = Scheduler(pipe, cfg, frozenset({STOP}), clock=clock)
    reqs = [sched.submit(p, params(i, 30)) for i, p in enumerate(ps)]
    while len(reqs[0].seq.generated) < 6:
        sched.step()
    pipe.crashes = {pipe.calls + 2: 1}   # the next step's receive: its decode window is lost
    with pytest.raises(PipelineError):
        sched.step()
    assert [w.chunk for w in pipe.inbox] == [False]
    now[0] += 30.0   # the stage loads again
    sched.restarted()
    while sched.step():
        times = sched.groups[0].drafts.ms
        assert times and max(times.values()) < 1000, times
    assert [r.seq.generated for r in reqs] == [g for g, _ in reference(ps, [params(0, 30),
                                                                          params(1, 30)],
                                                                      repeat=True)]
