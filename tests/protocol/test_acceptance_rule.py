"""The coordinator (Speculation.accept) and the last stage's drafter (Drafter._plan) accept the
same draft rows of a window: both apply protocol/acceptance.py's rule, to inputs each side
builds its own way. Random slots, drafts and sampled tokens; the test fails if the two sides
ever count differently."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from strata.coordinator.config import SchedulerConfig
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler_state import Request, RowOwner
from strata.coordinator.sequence import Sequence
from strata.coordinator.speculation.speculation import Speculation
from strata.protocol.acceptance import kept_drafts, kept_rows
from strata.protocol.messages import Window
from strata.stage_worker.drafter import Drafter

TOKENS = st.integers(0, 3)   # few token values: drafts equal the sampled token often


def _coordinator_keeps(prompt: list[int], drafts: list[int], sampled: list[int]) -> int:
    """Draft rows the coordinator keeps: Speculation.verify, then accept, on a request that
    has generated nothing yet."""
    seq = Sequence(prompt, SamplingParams(max_tokens=100), frozenset(), ctx=256)
    req = Request(0, seq)
    speculation = Speculation(SchedulerConfig(drafter="mtp", draft_tokens=7))
    owner = RowOwner(None, req, 1 + len(drafts), drafts)
    kept, = speculation.verify([owner], sampled)
    assert speculation.accept(req, sampled, drafts, kept) == (kept, False)
    assert req.drafts.counts.accepted == kept
    return kept


def _drafter_keeps(slot_rows: dict[int, tuple[int, list[int], list[int]]], order: list[int]
                   ) -> dict[int, int]:
    """Draft rows the drafter keeps per slot, from one window holding every slot's rows (its
    last token at P, then its drafts), in the row order `order` gives."""
    slots, positions, tokens, samples = [], [], [], {}
    for s, (p, drafts, sampled) in slot_rows.items():
        for i, token in enumerate([7] + drafts):
            slots.append(s)
            positions.append(p + i)
            tokens.append(token)
            samples[len(slots) - 1] = sampled[i]
    perm = [order[i % len(order)] % len(slots) for i in range(len(slots))]
    perm = list(dict.fromkeys(perm + list(range(len(slots)))))   # a permutation of the rows
    n = len(perm)
    w = Window(id=1, slots=[slots[i] for i in perm], positions=[positions[i] for i in perm],
               tokens=[tokens[i] for i in perm], sample_rows=list(range(n)),
               temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, min_p=[0.0] * n,
               u=[0.5] * n)
    sampled = {r: samples[perm[r]] for r in range(len(perm))}
    drafter = _bare_drafter(len(slot_rows))
    plan = drafter._plan(w, [sampled[r] for r in range(n)])
    # every row is sampled: the next token follows the last row kept, at P + 1 + kept
    return {s: plan.tops[s][0] - 1 - p for s, (p, _, _) in slot_rows.items()}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(TOKENS, max_size=7), st.lists(TOKENS, min_size=8,
                                                                  max_size=8)),
                min_size=1, max_size=4),
       st.lists(st.integers(0, 40), min_size=1, max_size=32))
def test_the_coordinator_and_the_drafter_keep_the_same_drafts(slots, order):
    slot_rows = {}
    for s, (drafts, sampled) in enumerate(slots):
        slot_rows[s] = (5 + 3 * s, drafts, sampled[:len(drafts) + 1])
    on_stage = _drafter_keeps(slot_rows, order)
    for s, (p, drafts, sampled) in slot_rows.items():
        prompt = [1] * p + [7]           # the row at P holds the prompt's last token
        kept = _coordinator_keeps(prompt, drafts, sampled)
        assert kept == kept_drafts(drafts, sampled)
        assert on_stage[s] == kept, f"slot {s}: drafts {drafts}, sampled {sampled}"


def test_a_draft_is_kept_only_after_every_draft_before_it():
    assert kept_drafts([3, 4, 5], [3, 4, 9, 1]) == 2
    assert kept_drafts([3, 4, 5], [3, 9, 5, 1]) == 1   # a later match after a miss counts not
    assert kept_drafts([], [2]) == 0


def test_kept_rows_over_a_window_of_several_slots():
    """Runs side by side: each run's rows count up to its first break (a draft unlike the
    token sampled before it, or a position gap), a row not sampled passes its successor, and
    a run's breaks stay its own."""
    tokens = [9, 3, 4, 5, 9, 7, 8, 9, 1, 2]
    sampled = [3, 4, 6, 0, -1, -1, 5, 2, 2, 0]   # run 1 breaks at 5; run 2's rows not sampled
    first = [True, False, False, False, True, False, False, True, False, False]
    assert kept_rows(tokens, sampled, first) == [True, True, True, False,
                                                 True, True, True, True, False, False]
    positions = [10, 11, 12, 13, 4, 5, 7, 0, 1, 2]   # run 2 has a gap before its third row
    assert kept_rows(tokens, sampled, first, positions)[4:7] == [True, True, False]


def _bare_drafter(slots: int, ctx: int = 64) -> Drafter:
    drafter = Drafter.__new__(Drafter)
    drafter.ctx, drafter.filled = ctx, np.zeros(slots, dtype=np.int64)
    drafter.known = np.full((slots, ctx), -1)
    return drafter


HELD = st.sampled_from(["nothing", "its token", "another token", "rows past it"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 48), TOKENS, TOKENS, st.booleans(),
                          HELD), min_size=2, max_size=6, unique_by=lambda t: t[0]),
       st.lists(st.tuples(st.integers(0, 5), st.integers(1, 60), TOKENS), max_size=12))
def test_a_window_of_one_row_a_slot_plans_as_the_acceptance_rule_does(rows, history):
    """Drafter._plan's array path (every live row of its own slot) leaves the plan, the
    NextN rows written (filled) and the tokens known that _plan_runs does, whatever the
    slots hold already: rows written before (history, and per row: at its position with its
    token or another, or past it), sampled rows and a pad row."""
    fast, runs = _bare_drafter(6), _bare_drafter(6)
    for d in (fast, runs):
        for s, p, token in history:
            d.known[s, p], d.filled[s] = token, max(d.filled[s], p)
        for s, p, token, _, _, held in rows:
            if held in ("its token", "another token"):
                d.known[s, p] = token if held == "its token" else token + 1
                d.filled[s] = max(d.filled[s], p + 2)
            elif held == "rows past it":
                d.filled[s] = max(d.filled[s], p + 5)
    slots = [r[0] for r in rows] + [-1]     # a pad row last
    positions = [r[1] for r in rows] + [0]
    tokens = [r[2] for r in rows] + [0]
    sampled = [i for i, r in enumerate(rows) if r[4]]
    n = len(sampled)
    w = Window(id=1, slots=slots, positions=positions, tokens=tokens, sample_rows=sampled,
               temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, min_p=[0.0] * n,
               u=[0.5] * n)
    picks = [rows[i][3] for i in sampled]
    a, b = fast._plan(w, picks), runs._plan_runs(w, picks)
    assert (a.at, a.rows, a.tops) == (b.at, b.rows, b.tops)
    assert fast.filled.tolist() == runs.filled.tolist()
    assert np.array_equal(fast.known, runs.known)
