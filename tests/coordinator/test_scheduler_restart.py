"""A stage started again (Scheduler.restarted) at every step of a schedule, against the two
fake stages of two_stages.py: every request in a slot rebuilds its KV and ends with exactly
its solo tokens, with several groups, streamed prompts, drafts (prompt lookup and mtp),
cancels, the conversation cache, a context nearly full, a window refused just before, and a
restart during the rebuild of another; afterwards each stage holds exactly what each slot
says it holds.
"""
from __future__ import annotations

import random

import pytest

from strata.coordinator.speculation.drafts import DraftCounts
from strata.coordinator.stages.pipeline import PipelineError
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from test_scheduler import STOP, params
from two_stages import (Crashing, assert_stages_hold_what_slots_hold, calls_of, random_policy,
                        reference, serve, sweep)


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
    counts = sum((r.drafts.counts for r in reqs), DraftCounts())
    assert 0 < counts.accepted < counts.drafted
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
        times = sched.speculation.groups[0].ms
        assert times and max(times.values()) < 1000, times
    assert [r.seq.generated for r in reqs] == [g for g, _ in reference(ps, [params(0, 30),
                                                                          params(1, 30)],
                                                                      repeat=True)]
