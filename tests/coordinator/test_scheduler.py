"""The scheduler against a fake pipeline (no model, no processes): fast checks of its policy.

The fake keeps each slot's tokens by position like a stage keeps KV, applies commits, refuses
gaps, and answers each sampled row with a token that depends on everything the slot holds up to
that row and on the row's uniform draw. So a stale row, a wrong commit or a wrong position
changes the tokens, and any schedule must give every request its solo tokens.
"""
from __future__ import annotations

import random
from collections import deque

import pytest

from strata.coordinator.stages.pipeline import WindowFailed
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.protocol.messages import Error, Result
from strata.protocol.transport import pack, unpack

STOP = 2


class FakePipeline:
    def __init__(self, slots: int, ctx: int, fail_slot: int | None = None):
        self.kv = [[] for _ in range(slots)]  # kv[slot][position] = token
        self.ctx, self.fail_slot = ctx, fail_slot
        self.queue: deque = deque()
        self.next_id = 0
        self.max_in_flight = 0
        self.fail_ids: set[int] = set()  # windows refused by id
        self.picked: tuple[int, list[int]] = (-1, [])  # the last window's id and tokens
        self.ahead = 0   # windows that decoded ahead (Window.follows)
        self.chunks_behind = 0

    def new_window_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def check(self) -> None:   # an idle engine's check of the stages: nothing to check here
        pass

    def stage_table(self) -> list[dict]:   # no stage processes
        return []

    def submit(self, w) -> None:
        w, _ = unpack(pack(w))  # what a stage would get: the window as the wire carries it
        if self.queue and w.chunk:   # a prompt chunk sent while another window is in flight
            self.chunks_behind += 1
        self.queue.append(w)
        self.max_in_flight = max(self.max_in_flight, len(self.queue))

    def receive(self, timeout=None):
        w = self.queue.popleft()
        if w.id in self.fail_ids or (self.fail_slot is not None and self.fail_slot in w.slots):
            raise WindowFailed(Error(1, w.id, "injected failure"))
        if w.follows:   # a window decoding ahead: its rows read the last window's picks
            if w.after != self.picked[0]:   # as a stage refuses it (LastStage.check_follows)
                raise WindowFailed(Error(1, w.id, f"the last window computed is not {w.after}"))
            w.tokens = [self.picked[1][j] if j >= 0 else t for t, j in zip(w.tokens, w.follows)]
            self.ahead += 1
        for slot, length in w.commits:
            del self.kv[slot][length:]
        for s, p, t in zip(w.slots, w.positions, w.tokens):
            if s < 0:
                continue
            assert p <= len(self.kv[s]), f"gap: slot {s} holds {len(self.kv[s])}, row at {p}"
            if p < len(self.kv[s]):   # as a stage's KV: the row is written, rows past it stay
                self.kv[s][p] = t
            else:
                self.kv[s].append(t)
        tokens = []
        for row, u in zip(w.sample_rows, w.u):
            s, p = w.slots[row], w.positions[row]
            tokens.append(self.token(self.kv[s][:p + 1], p, u))
        self.picked = (w.id, tokens)
        k = len(w.logprob_rows)   # made-up log-probabilities, none of the top tokens
        return Result(w.id, tokens, logprobs=[-1.0] * k, top_ids=[[]] * k,
                      top_logprobs=[[]] * k), []

    def token(self, history: list[int], p: int, u: float) -> int:
        return (7 * sum(history) + 13 * p + int(u * 1000)) % 60 + 2  # 2 = STOP


def prompts(n: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 60) for _ in range(rng.randrange(1, 90))] for _ in range(n)]


def params(i: int, tokens: int = 20) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, seed=i, max_tokens=tokens)
    return SamplingParams(max_tokens=tokens)


def run_alone(ps, ctx=256):
    out = []
    for i, p in enumerate(ps):
        sched = Scheduler(FakePipeline(1, ctx), SchedulerConfig(slots=1, ctx=ctx, chunk_rows=8),
                          frozenset({STOP}))
        req = sched.submit(p, params(i))
        sched.run()
        out.append(req.seq.generated)
    return out


@pytest.mark.parametrize("slots,groups,window_rows", [(4, 1, 8), (4, 2, 8), (8, 4, None),
                                                      (24, 1, 8), (20, 2, 8), (6, 3, None)])
def test_any_schedule_gives_solo_tokens(slots, groups, window_rows):
    rng = random.Random(slots * 100 + groups)
    ps = prompts(24, rng)
    pipe = FakePipeline(slots, 256)
    sched = Scheduler(pipe, SchedulerConfig(slots=slots, groups=groups, window_rows=window_rows,
                                            chunk_rows=8, ctx=256), frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    sched.run()
    assert [r.seq.generated for r in reqs] == run_alone(ps)
    assert pipe.max_in_flight == groups  # pipelined: one window per group in flight
    assert sched.idle


def test_cancel_and_reuse_leave_no_stale_rows():
    rng = random.Random(7)
    ps = prompts(10, rng)
    pipe = FakePipeline(2, 256)
    sched = Scheduler(pipe, SchedulerConfig(slots=2, groups=2, chunk_rows=8, ctx=256),
                      frozenset({STOP}))
    cancel_every_third(sched, pipe, ps, after=2, cancelled=2)


def cancel_every_third(sched: Scheduler, pipe: FakePipeline, ps, after: int, cancelled: int):
    """Runs a request per prompt, cancelling every third once it has `after` tokens: at least
    `cancelled` end so, each with a prefix of its solo tokens, the others with all of them;
    and each slot's stage-side rows are exactly what the slot table says it holds."""
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    while sched.step():
        for r in reqs[::3]:
            if len(r.seq.generated) >= after and not r.done:
                sched.cancel(r)
    alone = run_alone(ps)
    for i, r in enumerate(reqs):
        if r.seq.finish_reason == "cancelled":
            assert r.seq.generated == alone[i][:len(r.seq.generated)]
        else:
            assert r.seq.generated == alone[i], i
    assert sum(r.seq.finish_reason == "cancelled" for r in reqs) >= cancelled
    for slot in sched.table.slots:
        assert pipe.kv[slot.index] == slot.held


def test_cancel_before_admission():
    sched = Scheduler(FakePipeline(1, 64), SchedulerConfig(slots=1, ctx=64), frozenset({STOP}))
    a = sched.submit([5, 6, 7], params(0))
    b = sched.submit([8, 9], params(1))
    sched.cancel(b)
    sched.run()
    assert b.seq.finish_reason == "cancelled" and b.seq.generated == []
    assert a.seq.finish_reason in ("stop", "length") and a.seq.generated


def test_prefix_reuse_reads_only_the_rest():
    ps = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]
    pipe = FakePipeline(2, 128)
    sched = Scheduler(pipe, SchedulerConfig(slots=2, ctx=128, chunk_rows=4), frozenset({STOP}))
    first = sched.submit(ps[0], params(0, 5))
    other = sched.submit(ps[1], params(0, 5))
    sched.run()
    turn2 = ps[0] + first.seq.generated + [30, 31]
    second = sched.submit(turn2, params(0, 5))
    sched.run()
    assert second.slot is first.slot and other.slot is not first.slot
    assert second.reused == len(ps[0])  # the prompt, not the decoded answer
    fresh = Scheduler(FakePipeline(1, 128), SchedulerConfig(slots=1, ctx=128, chunk_rows=4),
                      frozenset({STOP}))
    ref = fresh.submit(turn2, params(0, 5))
    fresh.run()
    assert second.seq.generated == ref.seq.generated


def test_new_conversation_takes_free_then_least_recently_used_slot():
    sched = Scheduler(FakePipeline(2, 64), SchedulerConfig(slots=2, ctx=64), frozenset({STOP}))
    a = sched.submit([10, 11], params(0, 2))
    sched.run()
    b = sched.submit([20, 21], params(0, 2))  # a different conversation: the never-used slot
    sched.run()
    c = sched.submit([30, 31], params(0, 2))  # both used: the one used longest ago (a's)
    sched.run()
    assert b.slot is not a.slot and c.slot is a.slot


def test_a_failed_window_ends_its_requests_and_the_rest_go_on():
    pipe = FakePipeline(2, 64, fail_slot=1)
    sched = Scheduler(pipe, SchedulerConfig(slots=2, groups=2, ctx=64), frozenset({STOP}))
    ok, bad = sched.submit([5, 6, 7], params(0, 6)), sched.submit([8, 9], params(0, 6))
    sched.run()
    assert bad.seq.finish_reason == "error" and "injected failure" in bad.error
    assert ok.seq.finish_reason in ("stop", "length") and ok.error is None
    alone = Scheduler(FakePipeline(1, 64), SchedulerConfig(slots=1, ctx=64), frozenset({STOP}))
    ref = alone.submit([5, 6, 7], params(0, 6))
    alone.run()
    assert ok.seq.generated == ref.seq.generated


def test_context_limit_ends_with_length():
    sched = Scheduler(FakePipeline(1, 16), SchedulerConfig(slots=1, ctx=16), frozenset())
    req = sched.submit(list(range(3, 13)), SamplingParams(max_tokens=100))
    sched.run()
    assert req.seq.finish_reason == "length" and req.seq.length == 16


@pytest.mark.parametrize("slots,groups,depth", [(1, 1, 3), (4, 1, 2), (4, 2, 2), (6, 3, 4)])
def test_streamed_prompt_chunks_give_solo_tokens(slots, groups, depth):
    rng = random.Random(slots * 10 + depth)
    ps = prompts(12, rng) + [[rng.randrange(3, 60) for _ in range(70)]]  # 9 chunks of 8
    pipe = FakePipeline(slots, 256)
    sched = Scheduler(pipe, SchedulerConfig(slots=slots, groups=groups, chunk_rows=8, ctx=256,
                                            prompt_depth=depth), frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    sched.run()
    assert [r.seq.generated for r in reqs] == run_alone(ps)
    assert groups < pipe.max_in_flight <= groups * depth  # chunks streamed, within the depth
    assert sched.idle


def test_a_lone_prompt_streams_exactly_depth_chunks():
    pipe = FakePipeline(1, 256)
    sched = Scheduler(pipe, SchedulerConfig(slots=1, chunk_rows=8, ctx=256, prompt_depth=3),
                      frozenset({STOP}))
    req = sched.submit(list(range(3, 53)), params(0))
    sched.run()
    assert pipe.max_in_flight == 3 and req.seq.generated == run_alone([list(range(3, 53))])[0]


def test_streamed_prompt_cancelled_or_failed_ends_once():
    done = []
    pipe = FakePipeline(2, 256, fail_slot=1)
    sched = Scheduler(pipe, SchedulerConfig(slots=2, groups=2, chunk_rows=8, ctx=256,
                                            prompt_depth=3), frozenset({STOP}))
    ok = sched.submit(list(range(3, 60)), params(0, 4), on_done=done.append)
    bad = sched.submit(list(range(5, 60)), params(0, 4), on_done=done.append)  # slot 1 fails
    sched.step()
    cancelled = sched.submit(list(range(7, 60)), params(0, 4), on_done=done.append)
    sched.run()
    assert bad.seq.finish_reason == "error" and done.count(bad) == 1
    assert ok.seq.finish_reason in ("stop", "length") and done.count(ok) == 1
    # a cancel while several of its chunks are in flight
    pipe2 = FakePipeline(1, 256)
    sched2 = Scheduler(pipe2, SchedulerConfig(slots=1, chunk_rows=8, ctx=256, prompt_depth=3),
                       frozenset({STOP}))
    req = sched2.submit(list(range(3, 60)), params(0, 4), on_done=done.append)
    sched2.step()  # sends 3 chunks, takes the first result
    assert len(pipe2.queue) == 2 and sched2.snapshot().in_flight == (2,)
    sched2.cancel(req)
    sched2.run()
    assert req.seq.finish_reason == "cancelled" and done.count(req) == 1 and sched2.idle
    assert pipe2.kv[0] == sched2.table.slots[0].held
    assert cancelled.seq.finish_reason in ("stop", "length", "error")


def test_a_refused_chunk_after_a_cancel_leaves_no_rows_the_stages_lack():
    """A streamed prompt is cancelled; a chunk still in flight is then refused. The slot must
    not keep that chunk's rows: a later request with the same prompt reuses only what the
    stages hold and gets its solo tokens."""
    prompt = list(range(3, 60))
    pipe = FakePipeline(1, 256)
    sched = Scheduler(pipe, SchedulerConfig(slots=1, chunk_rows=8, ctx=256, prompt_depth=3),
                      frozenset({STOP}))
    req = sched.submit(prompt, params(0))
    sched.step()                       # chunks 1-3 sent, chunk 1 answered
    sched.cancel(req)
    pipe.fail_ids.add(pipe.queue[1].id)  # chunk 3 will be refused
    sched.run()
    assert req.seq.finish_reason == "cancelled"
    assert pipe.kv[0][:len(sched.table.slots[0].held)] == sched.table.slots[0].held
    again = sched.submit(prompt, params(0))
    sched.run()
    assert again.error is None and again.seq.generated == run_alone([prompt])[0]


@pytest.mark.parametrize("groups,depth", [(1, 1), (2, 3)])
def test_a_window_that_cannot_be_sent_ends_only_its_requests(groups, depth):
    """top_k 2**64 passes SamplingParams but not msgpack: the window sampling its first token
    fails to encode. That request ends with an error; its slot is free and holds nothing the
    stages lack; every other request gets its solo tokens."""
    rng = random.Random(3)
    ps = prompts(8, rng)
    bad_prompt = list(range(3, 45))   # several chunks: earlier ones are in flight when it fails
    pipe = FakePipeline(4, 256)
    sched = Scheduler(pipe, SchedulerConfig(slots=4, groups=groups, chunk_rows=8, ctx=256,
                                            prompt_depth=depth), frozenset({STOP}))
    done = []
    reqs = [sched.submit(p, params(i), on_done=done.append) for i, p in enumerate(ps[:4])]
    bad = sched.submit(bad_prompt, SamplingParams(temperature=0.5, top_k=2**64, seed=1),
                       on_done=done.append)
    reqs += [sched.submit(p, params(i + 4), on_done=done.append) for i, p in enumerate(ps[4:])]
    sched.run()
    assert bad.seq.finish_reason == "error" and "could not send its window" in bad.error
    assert done.count(bad) == 1 and bad.seq.generated == []
    assert [r.seq.generated for r in reqs] == run_alone(ps)
    assert all(r.error is None for r in reqs) and sched.idle
    for slot in sched.table.slots:
        assert pipe.kv[slot.index] == slot.held
    again = sched.submit(bad_prompt, params(1))   # the failed slot's prefix is not trusted
    sched.run()
    assert again.seq.generated == run_alone([bad_prompt, bad_prompt])[1]


def test_each_scheduler_numbers_its_own_requests():
    a, b = (Scheduler(FakePipeline(1, 64), SchedulerConfig(slots=1, ctx=64), frozenset({STOP}))
            for _ in range(2))
    assert [a.submit([5], params(0)).id for _ in range(2)] == [1, 2]
    assert b.submit([5], params(0)).id == 1


def test_snapshot_says_what_each_slot_does():
    sched = Scheduler(FakePipeline(2, 64), SchedulerConfig(slots=2, groups=2, chunk_rows=4,
                                                           ctx=64), frozenset())
    long, short = sched.submit(list(range(3, 13)), params(0)), sched.submit([5, 6], params(0))
    sched.step()  # both groups sent a chunk; one result came back
    snap = sched.snapshot()
    assert snap.queued == 0 and sum(snap.in_flight) == 1
    by_request = {s.request: s for s in snap.slots}
    assert by_request[long.id].state == "reading" and by_request[long.id].prompt_tokens == 10
    assert by_request[short.id].state in ("reading", "decoding")
    sched.cancel(long)
    sched.cancel(short)
    sched.run()
    snap = sched.snapshot()
    assert [s.state for s in snap.slots] == ["idle", "idle"] and not any(snap.in_flight)


class RecordingPipeline(FakePipeline):
    """Records each window as it is sent: 'chunk <slot>' or 'decode <live rows>'."""

    def __init__(self, slots: int, ctx: int):
        super().__init__(slots, ctx)
        self.sent: list[str] = []

    def submit(self, w) -> None:
        live = [s for s in w.slots if s >= 0]
        self.sent.append(f"chunk {live[0]}" if w.chunk else f"decode {len(live)}")
        super().submit(w)


def test_a_new_request_joins_the_least_loaded_group():
    sched = Scheduler(FakePipeline(6, 256), SchedulerConfig(slots=6, groups=2, ctx=256),
                      frozenset({STOP}))
    long = sched.submit(list(range(3, 103)), params(0))    # group 0, 100 prompt tokens
    short = sched.submit([5, 6, 7], params(1))              # group 1: no busy slot
    third = sched.submit([8, 9, 10], params(2))             # both have one: fewer tokens left
    fourth = sched.submit([11, 12], params(3))              # group 0 has 1 busy slot, group 1 2
    sched._admit()
    assert [r.slot.group for r in (long, short, third, fourth)] == [0, 1, 1, 0]
    sched.run()
    assert ([r.seq.generated for r in (long, short, third, fourth)]
            == run_alone([r.seq.prompt for r in (long, short, third, fourth)]))


def test_one_client_at_a_time_keeps_every_groups_conversations():
    """Under light load the groups tie, and the least recently used slot of any group is
    taken: six conversations in turn keep six slots, and each one's second turn reuses its
    prompt."""
    sched = Scheduler(FakePipeline(8, 64), SchedulerConfig(slots=8, groups=2, ctx=64),
                      frozenset({STOP}))
    first = []
    for i in range(6):
        first.append(sched.submit([10 + i, 11 + i, 12], params(0, 2)))
        sched.run()
    assert sorted(r.slot.index for r in first) == [0, 1, 2, 3, 4, 5]
    for i, r in enumerate(first):
        again = sched.submit([10 + i, 11 + i, 12, 40], params(0, 2))
        sched.run()
        assert again.slot is r.slot and again.reused == 3


def test_prompts_go_first_while_the_decode_window_has_room():
    """Three prompts of 3 chunks each arrive while one slot decodes: with a window of 8 rows
    8 chunks go first, then a decode window, then the last chunk; with a full window (8 rows,
    8 decoding slots) a ninth prompt's chunks alternate with decode windows."""
    pipe = RecordingPipeline(4, 256)
    sched = Scheduler(pipe, SchedulerConfig(slots=4, window_rows=8, chunk_rows=4, ctx=256),
                      frozenset())
    first = sched.submit([5, 6], SamplingParams(max_tokens=30))
    sched.step()
    sched.step()
    assert pipe.sent == ["chunk 0", "decode 1"]
    late = [sched.submit(list(range(10 + 12 * i, 22 + 12 * i)), SamplingParams(max_tokens=4))
            for i in range(3)]
    sched.run()
    assert pipe.sent[2:10] == ["chunk 1"] * 3 + ["chunk 2"] * 3 + ["chunk 3"] * 2
    assert pipe.sent[10:13] == ["decode 3", "chunk 3", "decode 4"]
    ps = [first.seq.prompt] + [r.seq.prompt for r in late]
    got = [r.seq.generated for r in [first] + late]
    want = []
    for p, n in zip(ps, (30, 4, 4, 4)):
        alone = Scheduler(FakePipeline(1, 256), SchedulerConfig(slots=1, chunk_rows=4, ctx=256),
                          frozenset())
        want.append(alone.submit(p, SamplingParams(max_tokens=n)).seq)
        alone.run()
    assert got == [s.generated for s in want]

    full = RecordingPipeline(9, 256)
    sched = Scheduler(full, SchedulerConfig(slots=9, window_rows=8, chunk_rows=4, ctx=256),
                      frozenset())
    for i in range(8):
        sched.submit([5 + i, 6], SamplingParams(max_tokens=30))
    for _ in range(10):
        sched.step()
    assert full.sent == [f"chunk {i}" for i in range(8)] + ["decode 8", "decode 8"]
    sched.submit(list(range(10, 22)), SamplingParams(max_tokens=4))
    for _ in range(6):
        sched.step()
    assert full.sent[10:16] == ["chunk 8", "decode 8"] * 3


class RepeatingPipeline(FakePipeline):
    """The next token repeats the one four places back, but a draw above 0.8 bumps it: greedy
    requests repeat their last four tokens for ever (prompt lookup's drafts are right), sampled
    ones now and then break the pattern (drafts are wrong)."""

    def token(self, history: list[int], p: int, u: float) -> int:
        back = history[-4] if len(history) >= 4 else 3
        return (back - 3 + (u > 0.8)) % 11 + 3


@pytest.mark.parametrize("slots,groups,window_rows,draft", [(1, 1, 8, 7), (4, 1, 8, 3),
                                                           (4, 2, 8, 4), (6, 3, 8, 2),
                                                           (18, 2, 16, 7)])
def test_drafts_give_the_tokens_of_plain_decoding(slots, groups, window_rows, draft):
    rng = random.Random(slots * 10 + draft)
    ps = [[rng.randrange(3, 14) for _ in range(rng.randrange(1, 30))] for _ in range(10)]
    runs = {}
    for k in (0, draft):
        pipe = RepeatingPipeline(slots, 256)
        sched = Scheduler(pipe, SchedulerConfig(slots=slots, groups=groups,
                                                window_rows=window_rows, chunk_rows=8, ctx=256,
                                                draft_tokens=k), frozenset())
        reqs = [sched.submit(p, params(i, 40)) for i, p in enumerate(ps)]
        sched.run()
        runs[k] = reqs, pipe.next_id
        assert all(r.seq.finish_reason == "length" for r in reqs)
        for slot in sched.table.slots:  # no row of a rejected draft stays on the stages
            assert pipe.kv[slot.index] == slot.held
    (plain, plain_windows), (drafted, windows) = runs[0], runs[draft]
    assert [r.seq.generated for r in drafted] == [r.seq.generated for r in plain]
    accepted = sum(r.drafts.counts.accepted for r in drafted)
    assert 0 < accepted < sum(r.drafts.counts.drafted for r in drafted)  # some right, some wrong
    assert windows < plain_windows


def test_drafts_stop_at_the_end_of_a_request():
    """A stop token or max_tokens reached inside a window's drafts ends the request there."""
    for stop, max_tokens in ((frozenset({7}), 60), (frozenset(), 5)):
        out = []
        for k in (0, 6):
            pipe = RepeatingPipeline(1, 128)
            sched = Scheduler(pipe, SchedulerConfig(slots=1, chunk_rows=8, ctx=128,
                                                    draft_tokens=k), stop)
            req = sched.submit([3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_tokens=max_tokens))
            sched.run()
            out.append((req.seq.generated, req.seq.finish_reason))
            assert pipe.kv[0] == sched.table.slots[0].held
        assert out[0] == out[1]


def test_arrivals_cannot_starve_a_decoding_slot():
    """Requests that end at their first token keep arriving at a free slot: the decoding slot
    still gets a window after at most window_rows chunks."""
    pipe = RecordingPipeline(2, 256)
    sched = Scheduler(pipe, SchedulerConfig(slots=2, window_rows=8, chunk_rows=4, ctx=256),
                      frozenset())
    long = sched.submit([5, 6], SamplingParams(max_tokens=20))
    sched.step()
    for i in range(40):
        sched.submit([7 + i % 50, 8, 9, 10], SamplingParams(max_tokens=1))
    sched.run()
    assert long.seq.finish_reason == "length"
    decodes = [0] + [i for i, w in enumerate(pipe.sent) if w.startswith("decode")]  # 0: its chunk
    assert max(b - a for a, b in zip(decodes, decodes[1:])) <= 8 + 1
    assert sum(w.startswith("chunk") for w in pipe.sent) == 41


def test_draft_tokens_must_leave_a_row_for_the_slot():
    with pytest.raises(ValueError, match="draft_tokens 8 is not from 0 to 7 .a slot's row and "
                                         "its drafts share one decode window of at least 8"):
        SchedulerConfig(window_rows=16, draft_tokens=8)
    SchedulerConfig(window_rows=8, draft_tokens=7)
    with pytest.raises(ValueError, match="drafter 'bogus' is not one of mtp, lookup"):
        SchedulerConfig(draft_tokens=2, drafter="bogus")


def test_config_errors_name_fields_and_the_cli_names_its_flags():
    from strata.launch.options import CHOICES, FLAGS
    with pytest.raises(ValueError) as e:
        SchedulerConfig(slots=6, groups=4)
    assert str(e.value) == "groups 4 does not divide slots 6; use a divisor of 6"
    assert e.value.render(FLAGS, CHOICES) == ("--batch-groups 4 does not divide --batch 6; use "
                                              "a divisor of 6 or auto")
    with pytest.raises(ValueError) as e:
        SchedulerConfig(chunk_rows=0)
    assert str(e.value) == "chunk_rows 0 is below 1; use 1 or more"
    assert e.value.render(FLAGS).startswith("--chunk-rows 0 is below 1")
