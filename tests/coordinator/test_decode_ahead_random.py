"""Decoding ahead under random schedules: arrivals, prompts of several chunks, prefix reuse,
slots taking turns, cancels, log-probabilities of tokens and prompts (max_tokens 0 too),
min_tokens, stop strings, stage restarts, refused windows; every request against itself alone
without it (a request that failed or was cancelled: a prefix of it).

The fake stage here is stricter than test_scheduler's: a token depends on the slot's whole
history, a position remembers whether a prompt chunk or a decode row wrote it (they compute
differently: DESIGN.md, exactness 2), it answers log-probabilities and holds back biased
tokens, and it refuses gaps and windows that follow picks it lacks as a stage does.
"""
from __future__ import annotations

import random

import pytest

from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.stages.pipeline import WindowFailed
from strata.protocol.messages import Error, Result
from test_scheduler import STOP, FakePipeline


def detokenize(ids: list[int]) -> str:
    return "".join(chr(65 + i % 26) for i in ids)


class StrictStage(FakePipeline):
    """kv[slot][position] = (token, written by a prompt chunk)."""

    def receive(self, timeout=None):
        w = self.queue.popleft()
        if w.id in self.fail_ids:
            raise WindowFailed(Error(1, w.id, "injected failure"))
        if w.follows:
            if w.after != self.picked[0]:
                raise WindowFailed(Error(1, w.id, f"the last window computed is not {w.after}"))
            w.tokens = [self.picked[1][j] if j >= 0 else t for t, j in zip(w.tokens, w.follows)]
            self.ahead += 1
        filled = [len(k) for k in self.kv]
        for slot, length in w.commits:
            filled[slot] = min(filled[slot], length)
        for s, p in zip(w.slots, w.positions):
            if s >= 0:
                if p > filled[s]:
                    raise WindowFailed(Error(1, w.id, f"slot {s}: position {p} leaves a gap"))
                filled[s] = max(filled[s], p + 1)
        for slot, length in w.commits:
            del self.kv[slot][length:]
        for s, p, t in zip(w.slots, w.positions, w.tokens):
            if s >= 0:
                if p < len(self.kv[s]):
                    self.kv[s][p] = (t, w.chunk)
                else:
                    self.kv[s].append((t, w.chunk))
        tokens = []
        for p in w.sampled:
            s, at = w.slots[p.row], w.positions[p.row]
            t = (hash((tuple(self.kv[s][:at + 1]), at)) + int(p.u * 1000)) % 60 + 2
            while t in p.bias_ids:   # held back (min_tokens): the next one
                t = (t - 1) % 60 + 2
            tokens.append(t)
        picks = {p.row: t for p, t in zip(w.sampled, tokens)}
        scored = [hash((tuple(self.kv[w.slots[r.row]][:w.positions[r.row] + 1]),
                        picks[r.row] if r.token < 0 else r.token)) for r in w.scored]
        self.picked = (w.id, tokens)
        return Result(w.id, tokens, logprobs=[-(h % 1000) / 100 for h in scored],
                      top_ids=[[h % 60][:r.top] for h, r in zip(scored, w.scored)],
                      top_logprobs=[[-(h % 7) / 10][:r.top] for h, r in zip(scored, w.scored)]
                      ), []


def request_params(rng: random.Random, i: int) -> SamplingParams:
    kw = {}
    if rng.random() < 0.5:
        kw.update(temperature=0.9, seed=i)
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.3:
        kw["prompt_logprobs"] = rng.choice([0, 1])
    if rng.random() < 0.2:
        kw["stop"] = ("QR", "Z")
    if rng.random() < 0.1:
        kw["ignore_eos"] = True
    tokens = 0 if "prompt_logprobs" in kw and rng.random() < 0.3 else rng.randrange(1, 30)
    kw["min_tokens"] = min(rng.randrange(0, 6) if rng.random() < 0.3 else 0, tokens)
    return SamplingParams(max_tokens=tokens, **kw)


def outcome(req) -> tuple:
    s = req.seq
    return (s.generated, s.logprobs, s.prompt_logprobs, s.finish_reason,
            s.text if s.params.stop else None)


def alone(prompt: list[int], params: SamplingParams, ctx: int):
    sched = Scheduler(StrictStage(1, ctx), SchedulerConfig(slots=1, ctx=ctx, chunk_rows=8),
                      frozenset({STOP}), detokenize=detokenize)
    req = sched.submit(prompt, params)
    sched.run()
    return req


def schedule(seed: int, restarts: bool = False, failures: bool = False) -> None:
    rng = random.Random(seed)
    slots = rng.choice([1, 2, 4, 10, 12, 17])
    ctx = rng.choice([64, 256])
    cfg = SchedulerConfig(slots=slots, ctx=ctx, chunk_rows=8, decode_ahead=True,
                          window_rows=rng.choice([None, 8]) if slots > 8 else None)
    stage = StrictStage(slots, ctx)
    sched = Scheduler(stage, cfg, frozenset({STOP}), detokenize=detokenize)
    shared = [rng.randrange(3, 60) for _ in range(40)]   # prompts that share it reuse slots
    arrivals = []   # (step, prompt, parameters)
    for i in range(rng.randrange(3, 30)):
        n = rng.randrange(1, min(ctx - 1, 70))
        prompt = shared[:n] if rng.random() < 0.3 else [rng.randrange(3, 60) for _ in range(n)]
        arrivals.append((rng.randrange(0, 40), prompt, request_params(rng, i)))
    arrivals.sort(key=lambda a: a[0])
    reqs, cancel_at, step = [], {}, 0
    while True:
        while arrivals and arrivals[0][0] <= step:
            _, prompt, params = arrivals.pop(0)
            reqs.append(sched.submit(prompt, params))
            if rng.random() < 0.25:
                cancel_at[reqs[-1].id] = step + rng.randrange(0, 25)
        for r in reqs:
            if cancel_at.get(r.id) == step and not r.done:
                sched.cancel(r)
        if failures and stage.queue and rng.random() < 0.05:   # the stage refuses one
            stage.fail_ids.add(rng.choice(list(stage.queue)).id)
        if restarts and step > 3 and rng.random() < 0.02:   # a stage started again
            stage.queue.clear()
            stage.kv, stage.picked = [[] for _ in range(slots)], (-1, [])
            sched.restarted()
        busy = sched.step()
        step += 1
        assert stage.max_in_flight <= 2 and step < 20000
        if not busy and not arrivals:
            break
    for r in reqs:
        got, want = outcome(r), outcome(alone(r.seq.prompt, r.seq.params, ctx))
        if r.seq.finish_reason in ("cancelled", "error"):
            assert got[0] == want[0][:len(got[0])] and got[1] == want[1][:len(got[1])], r.id
        else:
            assert got == want, r.id
        assert failures or restarts or r.seq.finish_reason != "error", r.error
    for slot in sched.table.slots:   # the stage keeps what the slot table says, read as prompt
        assert [t for t, _ in stage.kv[slot.index]] == slot.held
        assert all(chunk for _, chunk in stage.kv[slot.index])
    assert sched.idle


@pytest.mark.parametrize("seed", range(120))
def test_random_schedules_give_solo_tokens(seed):
    schedule(seed, restarts=False)


@pytest.mark.parametrize("seed", range(30))
def test_random_schedules_with_restarts_give_solo_tokens(seed):
    schedule(seed, restarts=True)


@pytest.mark.parametrize("seed", range(30))
def test_random_schedules_with_refused_windows_keep_the_slot_table(seed):
    """A refused window ends its requests and any sent behind it; the others go on, and the
    commits it carried are made again for the free slots."""
    schedule(seed, failures=True)
