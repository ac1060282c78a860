"""Decoding ahead (SchedulerConfig.decode_ahead) against test_scheduler's fake pipeline, which
reads a window's `follows` rows from the picks of the window before it as a stage would: a
group's next decode window goes out while the one before it is in flight, and every request
still gets its solo tokens, through stops, lengths, cancels and slots reused."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.sequence import Sequence
from test_scheduler import STOP, FakePipeline, cancel_every_third, params, prompts, run_alone

AHEAD = SchedulerConfig(slots=4, chunk_rows=8, ctx=256, decode_ahead=True)


@pytest.mark.parametrize("slots,window_rows", [(1, None), (4, 8), (24, 8)])
def test_decoding_ahead_gives_solo_tokens(slots, window_rows):
    """24 requests through 1, 4 and 24 slots (in windows of 8 rows: the slots take turns, and
    windows decode ahead once 8 or fewer slots are left)."""
    ps = prompts(24, random.Random(6))   # 5 of them end with a stop token
    pipe = FakePipeline(slots, 256)
    sched = Scheduler(pipe, replace(AHEAD, slots=slots, window_rows=window_rows),
                      frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    sched.run()
    assert [r.seq.generated for r in reqs] == run_alone(ps)
    assert sched.idle
    stopped = sum(r.seq.finish_reason == "stop" for r in reqs)
    assert stopped and stopped < len(reqs)   # requests ended by a stop token and by length
    assert pipe.max_in_flight == 2
    windows = sum(len(r.seq.generated) for r in reqs) // min(slots, 8)
    assert pipe.ahead > windows // (4 if slots == 24 else 2)
    for slot in sched.table.slots:   # no row decoded ahead stays on the stage
        assert pipe.kv[slot.index] == slot.held


def test_cancels_and_reused_slots_leave_no_rows_decoded_ahead():
    ps = prompts(12, random.Random(3))
    pipe = FakePipeline(2, 256)
    sched = Scheduler(pipe, replace(AHEAD, slots=2), frozenset({STOP}))
    cancel_every_third(sched, pipe, ps, after=6, cancelled=3)
    assert pipe.ahead


@pytest.mark.parametrize("change", [dict(repetition_penalty=1.2), dict(presence_penalty=0.5)])
def test_a_penalised_request_is_never_decoded_ahead(change):
    """Its rows' penalties read its tokens before the picks they would follow are known, so
    no decode window goes while another is in flight."""
    pipe = FakePipeline(2, 256)
    sched = Scheduler(pipe, replace(AHEAD, slots=2), frozenset({STOP}))
    a = sched.submit([5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True, **change))
    b = sched.submit([8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    sched.run()
    assert len(a.seq.generated) == 12 and len(b.seq.generated) == 6
    assert pipe.ahead == 0   # (b's prompt went behind a's: no token to follow)


@pytest.mark.parametrize("cfg", [replace(AHEAD, decode_ahead=False),
                                 replace(AHEAD, groups=2), replace(AHEAD, draft_tokens=2)],
                         ids=["off", "two-groups", "drafts"])
def test_no_decoding_ahead_unless_one_group_without_drafts(cfg):
    ps = prompts(6, random.Random(5))
    pipe = FakePipeline(cfg.slots, 256)
    sched = Scheduler(pipe, cfg, frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    sched.run()
    assert [r.seq.generated for r in reqs] == run_alone(ps)
    assert pipe.ahead == 0


@pytest.mark.parametrize("min_tokens", [0, 1, 2, 3])
def test_a_row_ahead_is_the_row_the_sequence_would_have_next(min_tokens):
    """ahead_row before a token lands == decode_rows' row once it has (but the token, which
    the stage fills in), held-back stop tokens included; ahead_room says whether the
    sequence may go on past the token in flight."""
    p = SamplingParams(max_tokens=4, min_tokens=min_tokens)
    seq = Sequence([5, 6, 7], p, frozenset({STOP}), ctx=64)
    for token in (11, 12, 13):
        ahead, room = seq.ahead_row(0), seq.ahead_room()
        done = seq.accept(token)
        assert room == (not done)
        if not done:
            assert ahead._replace(token=token) == seq.decode_rows(0, [])[0]
    assert not seq.ahead_room()   # one token left: the window in flight takes it
    full = Sequence([5] * 63, SamplingParams(max_tokens=10), frozenset({STOP}), ctx=64)
    assert not full.ahead_room()   # the token in flight fills the context


def test_a_failed_window_ends_its_requests_and_the_one_that_followed_it():
    """Window 5 is refused (1 and 2 are the prompts, b's behind a's; 3 waits for b's first
    token; 4, behind 3, reads its picks): its requests end with its error, window 6, sent
    behind it, is refused too (the stage did not compute the window it follows), and a
    request that comes later gets its solo tokens."""
    pipe = FakePipeline(2, 256)
    pipe.fail_ids = {5}
    sched = Scheduler(pipe, replace(AHEAD, slots=2), frozenset({STOP}))
    going = SamplingParams(max_tokens=20, ignore_eos=True)   # no stop token ends them first
    a, b = (sched.submit(p, going) for p in ([5, 6, 7], [8, 9]))
    sched.run()
    # 4 went ahead; 6 was sent and refused; 7, pad rows only, took the released slots' commits
    assert pipe.ahead == 1 and pipe.next_id == 7
    assert a.seq.finish_reason == b.seq.finish_reason == "error"
    assert "injected failure" in a.error and "injected failure" in b.error
    later = sched.submit([5, 6, 7], params(0))
    sched.run()
    assert later.seq.generated == run_alone([[5, 6, 7]])[0]
    assert sched.idle


def test_prompts_read_while_others_decode_go_behind_their_windows():
    """Requests that come while others decode: their prompt chunks (several each) go behind
    the decode window in flight and the decode windows behind the chunks, the first decode
    row of a prompt reading the token its last chunk samples; every request gets its solo
    tokens."""
    rng = random.Random(9)
    ps = [[rng.randrange(3, 60) for _ in range(n)] for n in (5, 7, 40, 33, 26, 3)]
    pipe = FakePipeline(4, 256)
    sched = Scheduler(pipe, AHEAD, frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps[:2])]
    while min(len(r.seq.generated) for r in reqs) < 3:
        sched.step()
    reqs += [sched.submit(p, params(i + 2)) for i, p in enumerate(ps[2:])]
    sched.run()
    assert [r.seq.generated for r in reqs] == run_alone(ps)
    assert pipe.chunks_behind >= 8 and pipe.ahead > 20
    assert sched.idle
    for slot in sched.table.slots:
        assert pipe.kv[slot.index] == slot.held


def test_a_prompt_that_samples_nothing_gets_no_row_behind_its_chunk():
    """max_tokens 0 (a prompt scored only): its last chunk samples nothing and the request
    ends when it lands, so no decode row goes behind it (one would overwrite the prompt's
    last position, which the slot keeps for the next request)."""
    prompt = list(range(3, 13))

    def run(cfg) -> list[int]:
        pipe = FakePipeline(1, 64)
        sched = Scheduler(pipe, cfg, frozenset({STOP}))
        scored = sched.submit(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
        sched.run()
        assert scored.seq.finish_reason == "length" and pipe.next_id == 2   # chunk, commits
        after = sched.submit(prompt + [20, 21], params(0))
        sched.run()
        assert after.reused == len(prompt)
        return after.seq.generated

    cfg = SchedulerConfig(slots=1, ctx=64, chunk_rows=16)
    assert run(replace(cfg, decode_ahead=True)) == run(cfg)


def test_a_refused_window_ends_only_its_own_requests():
    """10 slots in windows of 8 take turns: a window behind another reads picks only when all
    its slots wait for them, so when a window is refused the one behind it, refused too,
    holds none of the 2 slots the refused window did not."""
    pipe = FakePipeline(10, 256)
    slots_of, submit = {}, pipe.submit
    pipe.submit = lambda w: (slots_of.__setitem__(w.id, {s for s in w.slots if s >= 0}),
                             submit(w))
    sched = Scheduler(pipe, replace(AHEAD, slots=10, window_rows=8), frozenset({STOP}))
    going = SamplingParams(max_tokens=30, ignore_eos=True)
    reqs = [sched.submit([5 + i, 6, 7], going) for i in range(10)]
    while sched.step():
        if not pipe.fail_ids and min(len(r.seq.generated) for r in reqs) >= 5:
            pipe.fail_ids.add(pipe.next_id + 1)
    (bad,) = pipe.fail_ids
    ended = {r.slot.index for r in reqs if r.seq.finish_reason == "error"}
    assert ended == slots_of[bad] and len(ended) == 8
    assert all(len(r.seq.generated) == 30 for r in reqs if r.slot.index not in ended)
    assert pipe.ahead


def test_a_cancelled_request_leaves_while_the_group_keeps_a_window_in_flight():
    """Decoding ahead keeps a window in flight: a cancelled request with no row in flight
    leaves at the next step, not when its group is idle."""
    pipe = FakePipeline(2, 256)
    sched = Scheduler(pipe, replace(AHEAD, slots=2), frozenset({STOP}))
    a = sched.submit([5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
    while len(a.seq.generated) < 3:
        sched.step()
    b = sched.submit(list(range(3, 60)) * 2, params(1))   # 114 tokens: 15 chunks of 8
    while b.slot is None or b.slot.read_pos < 24:
        sched.step()
    sched.cancel(b)
    while not b.done:
        sched.step()
    assert b.seq.finish_reason == "cancelled" and b.seq.generated == []
    assert len(a.seq.generated) < 40 and not a.done
    sched.run()
    solo = Scheduler(FakePipeline(1, 256), replace(AHEAD, slots=1, decode_ahead=False),
                     frozenset({STOP}))
    ref = solo.submit([5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
    solo.run()
    assert a.seq.generated == ref.seq.generated and sched.idle
