"""Pipelined batch MTP on the coordinator, against the fake pipelines of test_scheduler and
test_mtp_scheduler: drafts take rows beyond a window's pad (up to draft_rows), the rows go to
the slots whose drafts are kept most often, and every request keeps the tokens of plain
decoding alone, with partial acceptance, commits and cancels across groups; the flags of
draft_tokens auto (its choices: test_draft_auto.py, on this file's timed fake pipeline).
The same through real CPU stages: test_pipelined_mtp_stages.py."""
from __future__ import annotations

import random

import pytest

from strata.coordinator.config import SchedulerConfig
from strata.coordinator.speculation.draft_choice import expected_tokens, share_rows
from strata.coordinator.speculation.drafts import DraftCounts
from strata.coordinator.engine.scheduler import Scheduler
from test_mtp_scheduler import DraftingPipeline, mtp_config, random_policy, truth_of
from test_scheduler import STOP, params, prompts, run_alone


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedPipeline(DraftingPipeline):
    """A drafting fake whose windows take time on a fake clock: a decode window of R rows
    asking proposals of up to k drafts takes cost(R, k) seconds; a prompt chunk 1 ms. Records
    each decode window as (group of its first slot, rows, live rows, drafts per slot)."""

    def __init__(self, *args, cost, clock: Clock, group_of, host=lambda live: 0.0, **kw):
        super().__init__(*args, **kw)
        self.cost, self.clock, self.group_of, self.host = cost, clock, group_of, host
        self.decodes: list[tuple[int, int, int, dict[int, int]]] = []

    def submit(self, w) -> None:
        super().submit(w)
        if not w.chunk and any(s >= 0 for s in w.slots):
            live = [s for s in w.slots if s >= 0]
            # the coordinator's own work on the window (and the result before it) takes time
            # before it leaves: host(live rows) seconds
            self.clock.now += self.host(len(live))
            self.decodes.append((self.group_of(live[0]), len(w.slots), len(live),
                                 {s: live.count(s) - 1 for s in set(live)}))

    def receive(self, timeout=None):
        w = self.queue[0]
        asked = max((k for _, k in w.propose), default=0)
        self.clock.now += 0.001 if w.chunk else self.cost(len(w.slots), asked)
        return super().receive(timeout)


def group_of(slots: int, groups: int):
    return lambda slot: slot % groups   # SlotTable: slot i is in group i % groups


# --- rows beyond the pad ----------------------------------------------------------------------

def test_share_rows_gives_rows_by_the_chance_each_draft_is_kept():
    # equal acceptance: an even share, earlier slots first on ties
    assert share_rows([3, 3, 3], [0.5] * 3, 5) == [2, 2, 1]
    # a slot whose drafts are kept 90% of the time gets its 3 before one kept 20% gets a 2nd
    assert share_rows([3, 3], [0.2, 0.9], 4) == [1, 3]
    assert share_rows([3, 3], [0.2, 0.9], 100) == [3, 3]   # room for all: all
    assert share_rows([0, 2], [0.9, 0.1], 3) == [0, 2] and share_rows([2], [0.5], 0) == [0]
    assert expected_tokens(0, 0.7) == 1 and expected_tokens(3, 0.5) == 1.875
    assert expected_tokens(3, 1.0) == 4


def test_draft_window_rows_auto_grows_to_the_row_tile():
    cfg = SchedulerConfig(slots=8)
    assert [cfg.draft_window_rows(r) for r in (8, 16, 24, 32, 40, 64)] == [32, 32, 32, 32,
                                                                           64, 64]
    cfg = SchedulerConfig(slots=8, draft_rows=16)
    assert [cfg.draft_window_rows(r) for r in (8, 32, 56)] == [24, 48, 64]
    assert SchedulerConfig(slots=8, draft_rows=0).draft_window_rows(16) == 16


@pytest.mark.parametrize("rows,fix", [(4, "use 8"), (64, "use 56"), (-8, "use 0")])
def test_draft_rows_must_be_a_multiple_of_8_up_to_56(rows, fix):
    from strata.launch.options import CHOICES, FLAGS
    with pytest.raises(ValueError) as e:
        SchedulerConfig(draft_rows=rows)
    assert e.value.render(FLAGS, CHOICES) == (
        f"--draft-rows {rows} is not a multiple of 8 from 0 to 56 (a decode window has at most "
        f"64 rows); {fix} or auto")


def test_drafts_grow_each_groups_window_past_its_pad():
    """8 requests in 2 groups of 4 slots, proposals always right, K = 7: a group's window
    of 4 slots (8 rows without drafts) takes 4 x 8 = 32 rows; with draft_rows 8, 16 rows,
    and with draft_rows 0 the 4 pad rows only. The tokens stay those of plain decoding."""
    ps = prompts(8, random.Random(5))
    alone = run_alone(ps)
    for draft_rows, rows in ((None, 32), (8, 16), (0, 8)):
        pipe = TimedPipeline(8, 256, truth_of(ps, alone), lambda s, w: "true", 7,
                             cost=lambda r, k: 0.001, clock=Clock(), group_of=group_of(8, 2))
        sched = Scheduler(pipe, mtp_config(slots=8, groups=2, draft_tokens=7,
                                           draft_rows=draft_rows), frozenset({STOP}))
        reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
        sched.run()
        assert [r.seq.generated for r in reqs] == alone, draft_rows
        assert max(r for _, r, _, _ in pipe.decodes) == rows, draft_rows
        full = [(r, live) for _, r, live, d in pipe.decodes if len(d) == 4 and r == rows]
        assert full and all(live == rows for r, live in full), (draft_rows, full[:3])
        assert all(r <= max(rows, 8) for _, r, _, _ in pipe.decodes)


def test_rows_go_to_the_slots_whose_drafts_are_kept():
    """One group of 8 slots: their window has no pad row, and draft_rows 8 lets drafts add 8.
    Slots 0-3 get right proposals, slots 4-7 wrong ones: once their acceptance shows, the
    right-proposing slots take (nearly) every draft row; the tokens stay those of plain
    decoding."""
    ps = prompts(8, random.Random(8))
    alone = [_alone(p, n, stop=frozenset()) for p, n in zip(ps, [120] * 4 + [30] * 4)]
    pipe = TimedPipeline(8, 256, truth_of(ps, alone),
                         lambda slot, w: "true" if slot < 4 else "wrong", 3,
                         cost=lambda r, k: 0.001, clock=Clock(), group_of=lambda s: 0)
    sched = Scheduler(pipe, mtp_config(slots=8, draft_tokens=3, draft_rows=8), frozenset())
    # greedy, no stop token; the right-proposing slots take 4 tokens a window: 4x as many keep all 8 busy
    tokens = [120] * 4 + [30] * 4
    reqs = [sched.submit(p, params(0, n)) for p, n in zip(ps, tokens)]
    sched.run()
    assert [r.seq.generated for r in reqs] == alone
    steady = [d for _, rows, _, d in pipe.decodes if len(d) == 8][3:]
    assert len(steady) >= 15 and all(sum(d.values()) <= 8 for d in steady)
    good = sum(d[s] for d in steady for s in range(4))
    bad = sum(d[s] for d in steady for s in range(4, 8))
    assert good >= 6 * bad and good > 0, (good, bad)
    assert all(r.drafts.counts.accepted == 0 for r in reqs[4:])
    assert all(r.drafts.counts.accepted > 0 for r in reqs[:4])


def _alone(prompt: list[int], tokens: int, stop=frozenset({STOP})) -> list[int]:
    """The request's tokens alone, greedy, without drafts."""
    from test_scheduler import FakePipeline
    sched = Scheduler(FakePipeline(1, 256), SchedulerConfig(slots=1, ctx=256, chunk_rows=8),
                      stop)
    req = sched.submit(prompt, params(0, tokens))
    sched.run()
    return req.seq.generated


# --- partial acceptance, commits and cancels across groups --------------------------------------

@pytest.mark.parametrize("slots,groups,k,draft_rows", [(8, 2, 3, None), (8, 2, "auto", None),
                                                        (16, 2, 7, 16), (12, 3, "auto", 8)])
def test_pipelined_groups_with_drafts_give_the_tokens_of_plain_decoding(slots, groups, k,
                                                                         draft_rows):
    rng = random.Random(slots + groups)
    ps = prompts(24, rng)
    alone = run_alone(ps)
    pipe = TimedPipeline(slots, 256, truth_of(ps, alone), random_policy(slots), 7,
                         cost=lambda r, kk: 0.002 + r * 1e-5 + kk * 1e-4, clock=Clock(),
                         group_of=group_of(slots, groups))
    sched = Scheduler(pipe, mtp_config(slots=slots, groups=groups, draft_tokens=k,
                                       draft_rows=draft_rows, prompt_depth=3),
                      frozenset({STOP}), clock=pipe.clock)
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    sched.run()
    assert [r.seq.generated for r in reqs] == alone
    assert sched.idle and all(pipe.kv[s.index] == s.held for s in sched.table.slots)
    counts = sum((r.drafts.counts for r in reqs), DraftCounts())
    drafted, accepted = counts.drafted, counts.accepted
    assert 0 < accepted < drafted   # partial acceptance: rejected drafts were committed away
    # drafts took rows past the pad in some window (more live rows than slots rounded up)
    assert any(live > -(-len(d) // 8) * 8 for _, _, live, d in pipe.decodes)
    assert {g for g, _, _, _ in pipe.decodes} == set(range(groups))


def test_cancels_across_groups_while_windows_grow():
    """Requests cancelled mid-decode in both groups, while windows carry drafts past their
    pad: the cancelled keep a prefix of their solo tokens and drop their proposals, the next
    request in their slot starts without any (the fake checks every draft was proposed), the
    rest keep their solo tokens, and no slot keeps a stale row."""
    rng = random.Random(21)
    ps = prompts(16, rng)
    alone = run_alone(ps)
    pipe = TimedPipeline(8, 256, truth_of(ps, alone), random_policy(9), 7,
                         cost=lambda r, k: 0.001, clock=Clock(), group_of=group_of(8, 2))
    sched = Scheduler(pipe, mtp_config(slots=8, groups=2, draft_tokens=5, prompt_depth=3),
                      frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    for _ in range(5000):
        if not sched.step():
            break
        for r in reqs[::3]:
            if len(r.seq.generated) >= 3 and not r.done:
                sched.cancel(r)
    cancelled = [r for r in reqs if r.seq.finish_reason == "cancelled"]
    assert len(cancelled) >= 3 and {r.slot.group for r in cancelled} == {0, 1}
    for i, r in enumerate(reqs):
        if r in cancelled:
            assert r.seq.generated == alone[i][:len(r.seq.generated)] and r.drafts.proposals == []
        else:
            assert r.seq.generated == alone[i], i
    assert sum(r.drafts.counts.accepted for r in reqs) > 0
    assert any(live > 8 for _, _, live, _ in pipe.decodes)   # windows grew past 8 rows
    for slot in sched.table.slots:
        assert pipe.kv[slot.index] == slot.held


# --- the flags ------------------------------------------------------------------------------

def test_the_flags_take_auto(tiny_model):
    from strata.launch.options import prepare
    shared = dict(model=str(tiny_model), layer_split="2", devices="cpu", ctx_size=256, batch=8,
                  batch_groups="2", window_rows="auto", chunk_rows="auto", drafter="lookup")
    sched = prepare(**shared, draft_tokens="auto").sched
    assert (sched.draft_tokens, sched.auto_drafts, sched.max_draft_tokens) == ("auto", True, 7)
    # auto on CPU stages (every row costs): the pad rows only
    assert sched.draft_rows == 0 and sched.draft_window_rows(8) == 8
    from strata.launch.options import auto_draft_rows
    from strata.launch.plan import plan_stages
    assert auto_draft_rows(plan_stages("2", ["cuda:0", "cuda:1"], 4)) is None   # row tiles
    assert auto_draft_rows(plan_stages("2", ["cuda:0", "cpu"], 4)) == 0
    sched = prepare(**shared, draft_tokens="3", draft_rows="16").sched
    assert (sched.draft_tokens, sched.draft_rows, sched.auto_drafts) == (3, 16, False)


@pytest.mark.parametrize("flag,value,says", [
    ("--draft-rows", "12", "strata-launch: --draft-rows 12 is not a multiple of 8 from 0 to 56 "
                           "(a decode window has at most 64 rows); use 16 or auto"),
    ("--draft-tokens", "x", "strata-launch: --draft-tokens 'x' is not a number or auto"),
    ("--draft-tokens", "8", "strata-launch: --draft-tokens 8 is not from 0 to 7 (a slot's row "
                            "and its drafts share one decode window of at least 8 rows); use "
                            "0 (off) to 7 or auto")])
def test_bad_draft_flags_get_a_sentence(tiny_model, no_stage_left, flag, value, says):
    from test_mtp_scheduler import launch_cli
    out = launch_cli("--model", str(tiny_model), flag, value)
    assert out.exit_code == 2 and out.stderr == says + "\n", (out.output, out.exception)
