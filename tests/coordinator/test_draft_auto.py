"""draft_tokens auto on the coordinator (speculation/draft_choice.py), against the timed fake
pipelines of test_pipelined_mtp: K per group from the windows' measured times (a fake clock)
and acceptance, windows the drafter catches up in left untimed, a losing choice tried again,
the margin a drafting choice must win by, and each group's choice in /v1/status; every request
keeps the tokens of plain decoding alone."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from strata.coordinator.speculation.draft_choice import (EXPLORE_EVERY, HOLD, MARGIN, RETRY,
                                                         Acceptance, GroupDrafts,
                                                         expected_tokens)
from strata.coordinator.speculation.drafts import DraftCounts
from strata.coordinator.engine.scheduler import Scheduler
from test_mtp_scheduler import mtp_config, truth_of
from test_pipelined_mtp import Clock, TimedPipeline, _alone, group_of
from test_scheduler import STOP, params


def stepped_cost(rows: int, k: int) -> float:
    """Windows of up to 16 rows take 10 ms, larger ones 40 ms; each proposal asked 0.2 ms."""
    return (0.010 if rows <= 16 else 0.040) + 0.0002 * k


def run_auto(policy, tokens=120, slots=8, groups=2, cost=stepped_cost, rounds=3,
             host=lambda live: 0.0):
    """`rounds` requests a slot, one after the other, greedy, `tokens` each."""
    ps = [list(range(5 + i, 25 + i)) for i in range(slots * rounds)]
    alone = [_alone(p, tokens) for p in ps]
    clock = Clock()
    pipe = TimedPipeline(slots, 256, truth_of(ps, alone), policy, 7, cost=cost, clock=clock,
                         group_of=group_of(slots, groups), host=host)
    sched = Scheduler(pipe, mtp_config(slots=slots, groups=groups, draft_tokens="auto"),
                      frozenset({STOP}), clock=clock)
    reqs = [sched.submit(p, params(0, tokens)) for p in ps]
    sched.run()
    assert [r.seq.generated for r in reqs] == alone
    return sched, pipe, reqs


def test_auto_takes_the_most_drafts_that_keep_windows_cheap_when_drafts_are_kept():
    """Proposals always right, 4 slots a group: K = 3 fills 16 rows (10 ms a window, 4 tokens
    a slot); K = 4..7 need 24-32 rows (40 ms, at most 8 tokens). K climbs a proposal at a
    time: once K = 4 is timed, K = 6 and 7 (32 rows, as slow at least) are not worth a try,
    and each group's windows of 4 slots settle at 16 rows (explorations aside)."""
    sched, pipe, reqs = run_auto(lambda s, w: "true", tokens=220)
    for group in (0, 1):
        timed = {(r, k): ms for r, k, ms in sched.speculation.groups[group].timed()}
        # a window's own time, not the other group's before it
        assert timed[(16, 3)] == pytest.approx(10.6) and timed[(24, 4)] == pytest.approx(40.8)
        assert not any(rows == 32 for rows, _ in timed), timed
        full = [(r, d) for g, r, _, d in pipe.decodes if g == group and len(d) == 4]
        late = full[len(full) // 2:]
        assert sum(r == 16 and set(d.values()) == {3} for r, d in late) >= 0.8 * len(late), \
            [r for r, _ in full]
    counts = sum((r.drafts.counts for r in reqs), DraftCounts())
    assert counts.accepted > 0.8 * counts.drafted


def test_auto_stops_drafting_when_drafts_are_never_kept():
    """Proposals always wrong and each proposal asked costing as much as a window's rows
    (here 2 ms each on a 10 ms window): K = 0 (no drafts, none asked) is the fastest, so the
    group settles there, trying drafts again only now and then."""
    sched, pipe, reqs = run_auto(lambda s, w: "wrong",
                                 cost=lambda r, k: 0.010 + 0.002 * k, tokens=200)
    for group in (0, 1):
        choice = sched.speculation.groups[group].choice
        assert choice.k == 0 and choice.acceptance < 0.2, choice
        late = [d for g, _, _, d in pipe.decodes if g == group][-100:]
        drafted = sum(1 for d in late if sum(d.values()))
        assert drafted <= 100 // EXPLORE_EVERY * 2 + 2, drafted
    assert sum(r.drafts.counts.accepted for r in reqs) == 0


def test_auto_counts_the_coordinators_work_on_serial_windows():
    """One group (serial windows): half the proposals are kept, a window of up to 16 rows
    takes 10 ms on the stages, and the coordinator works 2 ms a live row on each window
    before it leaves (accepting the tokens before it, building it). A drafted window (16 rows,
    12 tokens) then takes 42 ms of the cycle against a plain one's 26 ms (8 tokens): K = 0 is
    the faster, though by the stages' time alone (10 ms either way) the drafts would win."""
    coin = random.Random(4)
    memo: dict[tuple[int, int], str] = {}
    half = lambda slot, wid: memo.setdefault((slot, wid), coin.choice(("true", "wrong")))
    sched, pipe, reqs = run_auto(half, tokens=160, groups=1, rounds=2,
                                 host=lambda live: 0.002 * live)
    timed = {(r, k): ms for r, k, ms in sched.speculation.groups[0].timed()}
    # its whole cycle: the stages' 10.2 ms and the coordinator's for its 12 to 16 live rows
    assert 10.2 + 12 * 2 <= timed[(16, 1)] <= 10.2 + 16 * 2 + 1e-6, timed
    # while all 8 slots decode (before the last requests end), drafts only to explore
    full = [d for _, _, live, d in pipe.decodes if len(d) == 8]
    assert len(full) > 100
    drafted = sum(1 for d in full[8:] if sum(d.values()))
    assert drafted <= len(full) // EXPLORE_EVERY + 2, (drafted, len(full))


def _ks_chosen(slots: int, windows: int) -> set[int]:
    """The K a group's choice takes over `windows` decode windows of `slots` slots and up to
    32 rows, every window 3 ms, half the drafts kept."""
    g, now, ks = GroupDrafts(), 0.0, set()
    for _ in range(20):
        g.acceptance.observe(2, 1)
    for _ in range(windows):
        c = g.choose(slots=slots, limit=32, max_k=7, mtp=True)
        ks.add(c.k)
        g.sent(now, c.rows, c.k)
        now += 0.003
        g.landed(now, 0)
    return ks


def test_auto_asks_no_proposals_the_rows_cannot_hold():
    """16 slots, windows of up to 32 rows: K = 1 fills the 16 rows left, so K = 2..7 would
    ask more proposals for the same drafts. They are no option, explorations included: the
    choice is K = 0 or 1. With 4 slots each K up to 7 adds drafts (28 at most), and is tried."""
    assert _ks_chosen(16, 6 * EXPLORE_EVERY) == {0, 1}
    assert 7 in _ks_chosen(4, 40 * EXPLORE_EVERY)


def test_auto_times_the_plain_window_first_then_climbs_a_draft_at_a_time():
    """With mtp each proposal asked costs the drafter: a group's first choice is the plain
    window (K = 0, the one every later choice is measured against); as soon as that is timed,
    one draft; and while the most drafts timed are the best, one more at once (drafts always
    kept, the drafter's step nearly free), up to the 7 the pad rows of one slot hold. With
    drafts never kept and each step 1 ms on a 3 ms window, K = 1 is tried and nothing more
    (no jump to K = 7: a useless head pays for one drafter step, not seven)."""
    def run(kept: int, step_ms: float, windows: int) -> list[tuple[int, bool]]:
        g, now, ks = GroupDrafts(), 0.0, []
        for _ in range(windows):
            c = g.choose(slots=1, limit=8, max_k=7, mtp=True)
            ks.append((c.k, c.explored))
            g.sent(now, c.rows, c.k)
            now += (3.0 + step_ms * c.k) / 1000
            g.landed(now, 0)
            g.acceptance.observe(c.k, min(c.k, kept))
        return ks
    good = run(7, 0.01, 8 * HOLD)
    assert good[:2 * HOLD + 1] == [(0, True)] * HOLD + [(1, True)] * HOLD + [(2, True)]
    assert [k for k, _ in good[::HOLD]] == list(range(8))
    useless = run(0, 1.0, 4 * EXPLORE_EVERY)
    assert {k for k, explored in useless if explored and k} == {1}


def test_auto_tries_no_drafts_that_the_timed_windows_show_cannot_win():
    """One slot (8 rows whatever K), K = 0 and 7 timed, each proposal 2 ms of the drafter's:
    at acceptance 0.05 no K between pays for its proposals (their time taken in proportion),
    so none is tried; at 0.67 some could, and are."""
    def tried(kept_of_3: int) -> set[int]:
        g = GroupDrafts()
        for _ in range(20):
            g.acceptance.observe(3, kept_of_3)
        g.ms, g.timed_at = {(8, 0): 4.0, (8, 7): 18.0}, {(8, 0): 0, (8, 7): 0}
        ks, now = set(), 0.0
        for _ in range(4 * EXPLORE_EVERY):
            c = g.choose(slots=1, limit=8, max_k=7, mtp=True)
            if c.explored:
                ks.add(c.k)
            g.sent(now, c.rows, c.k)
            now += (4.0 + 2.0 * c.k) / 1000
            g.landed(now, 0)
        return ks
    assert tried(0) == set()
    assert tried(2) & set(range(1, 7))


def test_auto_choice_explores_sparingly():
    """GroupDrafts alone: with one size timed, an untimed one is tried only every
    EXPLORE_EVERY windows, and only when even the fastest time known would make it win."""
    g = GroupDrafts()
    for _ in range(20):
        g.acceptance.observe(3, 3)   # drafts always kept
    first = g.choose(slots=4, limit=32, max_k=7, mtp=False)
    assert first.rows == 8 and first.k == 1 and first.explored   # the pad rows, untimed
    tries, now = [], 0.0
    for i in range(4 * EXPLORE_EVERY):
        c = g.choose(slots=4, limit=32, max_k=7, mtp=False)
        g.sent(now, c.rows, 0)
        now += 0.010 if c.rows <= 8 else 0.011   # larger windows nearly free
        g.landed(now, 0)
        tries.append(c.explored)
    assert 2 <= sum(tries) <= 4 * 2 and g.choice.rows == 32 and g.choice.k == 7


def test_acceptance_is_kept_over_first_rejections():
    a = Acceptance()
    assert a.rate() == 0.5
    for _ in range(50):
        a.observe(4, 2)    # two kept, then one rejected: 2 / 3
    assert a.rate() == pytest.approx(2 / 3, abs=0.02)
    a.observe(0, 0)        # no drafts: nothing learnt
    assert a.rate() == pytest.approx(2 / 3, abs=0.02)


class CatchUpPipeline(TimedPipeline):
    """TimedPipeline whose drafter first writes the NextN rows a slot lacks: a window asking
    proposals for a slot whose last decode window asked none takes `catch_up` seconds more."""

    def __init__(self, *args, catch_up: float, **kw):
        super().__init__(*args, **kw)
        self.catch_up, self.asked_last = catch_up, set()

    def receive(self, timeout=None):
        w = self.queue[0]
        if not w.chunk:
            asked = {s for s, _ in w.propose}
            self.clock.now += self.catch_up * len(asked - self.asked_last)
            self.asked_last = asked
        return super().receive(timeout)


def test_auto_drafts_for_one_client_though_its_first_drafted_window_catches_up():
    """One client, half the proposals kept, a window 10 ms and each proposal asked 1 ms, but
    the first window that asks proposals after windows that asked none 60 ms (the drafter
    writes the NextN rows the slot lacks). That window verifies no draft and is not timed,
    so K >= 1 (1.5 tokens or more in 11-12 ms, against 1 in 10) wins and stays."""
    coin = random.Random(7)
    memo: dict[tuple[int, int], str] = {}
    half = lambda slot, wid: memo.setdefault((slot, wid), coin.choice(("true", "wrong")))
    ps = [list(range(5, 25))]
    alone = [_alone(p, 240) for p in ps]
    clock = Clock()
    pipe = CatchUpPipeline(1, 512, truth_of(ps, alone), half, 7, catch_up=0.060,
                           cost=lambda r, k: 0.010 + 0.001 * k, clock=clock,
                           group_of=group_of(1, 1))
    sched = Scheduler(pipe, mtp_config(slots=1, groups=1, draft_tokens="auto"),
                      frozenset({STOP}), clock=clock)
    req = sched.submit(ps[0], params(0, 240))
    sched.run()
    assert req.seq.generated == alone[0]
    late = [d[0] for _, _, _, d in pipe.decodes][len(pipe.decodes) // 3:]
    assert sum(k >= 1 for k in late) >= 0.8 * len(late), late
    assert all(ms < 30 for _, k, ms in sched.speculation.groups[0].timed() if k)


def test_auto_tries_a_losing_choice_again_ever_more_rarely_and_returns_when_it_pays():
    """One slot, a window 10 ms and each proposal asked 2 ms. While no proposal is kept, K = 1
    is tried again after RETRY windows, then after twice as many each time it loses (the
    first try comes as soon as K = 0 is timed); once proposals are kept, a try finds it and
    the group drafts again."""
    g, now, tries = GroupDrafts(), 0.0, []
    def windows(n: int, kept: bool) -> list[int]:
        nonlocal now
        ks = []
        for _ in range(n):
            before = g.choice
            c = g.choose(slots=1, limit=8, max_k=7, mtp=True)
            if c.explored and c.k and c is not before:   # a new choice (each lasts HOLD)
                tries.append(g.windows)
            g.sent(now, c.rows, c.k)
            now += (10.0 + 2.0 * c.k) / 1000
            g.landed(now, 0)
            g.acceptance.observe(c.k, c.k if kept else 0)
            ks.append(c.k)
        return ks
    windows(8 * RETRY, kept=False)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) >= 4 and gaps[0] >= RETRY, tries
    assert all(b >= 2 * a - HOLD - EXPLORE_EVERY for a, b in zip(gaps, gaps[1:])), tries
    assert len(tries) <= 6, tries
    late = windows(2 * max(gaps) + 4 * RETRY, kept=True)[-4 * RETRY:]
    # drafting but for what every STALE windows tries again, K = 0 among them
    assert sum(k >= 1 for k in late) >= 0.95 * len(late), late


def test_auto_counts_windows_that_verify_no_drafts():
    """A drafter that never proposes: a window asking proposals verifies no draft, and is
    left untimed as a catch-up would be, but only UNTIMED of them in a row; each counts
    towards the choice's hold, so the groups keep choosing (no choice held for good)."""
    sched, pipe, reqs = run_auto(lambda s, w: "none", tokens=120)
    for group in (0, 1):
        g = sched.speculation.groups[group]
        mine = [d for gr, _, _, d in pipe.decodes if gr == group]
        assert g.windows >= len(mine) and g.chosen_at >= g.windows - 2 * HOLD, g
        assert {k for _, k, _ in g.timed()} >= {0, 1}, g.timed()
    assert sum(r.drafts.counts.drafted for r in reqs) == 0


def test_auto_drafts_only_when_drafting_beats_the_plain_window_by_its_margin():
    """One slot, the plain window 10 ms; a window with one draft 11.8 ms, its draft kept
    about 28% of the time (8% more tokens a second), or 10.5 ms kept 48% (41% more). A
    serial group (margin 5%) drafts in both; a group among several (margin 15%, their
    timed intervals noisier) only where drafting gains 41%."""
    def late_k(kept: tuple[int, ...], drafted_ms: float, margin: float) -> list[int]:
        g, now, ks = GroupDrafts(), 0.0, []
        for i in range(40):   # the drafts of i % 10 in `kept` kept, spread over the windows
            g.acceptance.observe(1, int(i % 10 in kept))
        for _ in range(12 * EXPLORE_EVERY):
            c = g.choose(slots=1, limit=8, max_k=1, mtp=True, margin=margin)
            g.sent(now, c.rows, c.k)
            now += (drafted_ms if c.k else 10.0) / 1000
            g.landed(now, 0)
            ks.append(c.k)
        return ks[-4 * EXPLORE_EVERY:]
    few, half = (0, 3, 6), (0, 2, 4, 6, 8)
    assert sum(late_k(few, 11.8, MARGIN[0])) >= 0.9 * 4 * EXPLORE_EVERY
    assert sum(late_k(few, 11.8, MARGIN[1])) <= 2 * HOLD
    assert sum(late_k(half, 10.5, MARGIN[1])) >= 0.9 * 4 * EXPLORE_EVERY


def test_status_says_each_groups_choice():
    from strata.coordinator.api.connections import ServerConfig
    from strata.coordinator.engine.engine import Engine
    from strata.coordinator.engine.metrics import Metrics
    from strata.coordinator.api.server import Server
    ps = [list(range(5 + i, 25 + i)) for i in range(4)]
    alone = [_alone(p, 120) for p in ps]
    clock = Clock()
    pipe = TimedPipeline(4, 256, truth_of(ps, alone), lambda s, w: "true", 7,
                         cost=stepped_cost, clock=clock, group_of=group_of(4, 2))
    engine = Engine(pipe, mtp_config(slots=4, groups=2, draft_tokens="auto"),
                    frozenset({STOP}), lambda ids: "")
    # stepped here, without the engine's thread, on the fake clock
    sched = engine.scheduler = Scheduler(engine.pipe, engine.cfg, frozenset({STOP}),
                                         clock=clock)
    reqs = [sched.submit(p, params(0, 120)) for p in ps]
    while min(len(r.seq.generated) for r in reqs) < 90 and sched.step():
        pass
    engine._publish()
    server = Server(engine, None, 64, ServerConfig(model="fake"), Metrics(), lambda: None)
    status = json.loads(asyncio.run(server.status(None)).text)
    assert status["draft_tokens"] == "auto"
    for g in status["groups"]:
        d = g["drafts"]
        # 2 slots a group: K = 7 fills 16 rows, still 10 ms a window
        assert (d["k"], d["rows"]) == (7, 16), d
        assert d["acceptance"] > 0.9 and d["window_ms"] > 0 and d["tok_s"] > 0
        assert d["tokens_per_window"] == pytest.approx(2 * expected_tokens(7, d["acceptance"]),
                                                       rel=1e-3)
        assert {"rows": 16, "k": 7} in [{"rows": t["rows"], "k": t["k"]} for t in d["timed"]]
