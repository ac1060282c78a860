"""--restart-stages: a stage that dies (SIGKILL) or hangs (SIGSTOP, past the stage timeout)
mid-generation is started again, every request in a slot rebuilds its KV from its tokens, and
each ends with exactly the tokens it has alone (greedy and seeded, drafts on and off), on a
real CPU launch of SmolLM2 with the server's Engine. Then the rebuild itself against the fake
stages of test_scheduler, where a decoded token's KV written again by a prompt chunk would
give other tokens, and the Unix socket that keeps a message for a peer that binds again.
test_scheduler_restart.py starts a stage again at every step of many schedules, and
test_engine_restart.py checks the engine's side.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import pytest

from strata.coordinator.engine.engine import Engine, Finished, Job
from strata.coordinator.engine.metrics import Metrics
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.protocol import unixsock
from test_scheduler import FakePipeline, params, prompts

CTX = 512   # as the session's reference launch (conftest.py); its requests take 12 tokens


@pytest.fixture(scope="module")
def stages(smollm2_drafting_stages, smollm2_alone):
    """SmolLM2 on 2 CPU stages, 4 slots, the shipped NextN head on the last one (the session's
    launch, conftest's smollm2_drafting_stages, taken for hung after its STAGE_TIMEOUT), and the
    session's reference: harness.prompt_set(8), each request alone (conftest.py)."""
    run = smollm2_drafting_stages
    assert run.procs.mtp_head is not None and (run.slots, run.ctx) == (4, CTX)
    tok, ids, ps, alone = smollm2_alone
    return run, tok, ids, ps, [r.seq.generated for r in alone]


def _serve(run, tok, cfg: SchedulerConfig, ids, ps, faults: list[tuple[int, int, int]]):
    """The prompts together (more than the slots: some wait, and take slots that others held)
    on an Engine that restarts stages; faults: (after this many tokens of request 0, send
    this signal, to this stage). Returns each request's tokens, the
    engine's stage table and its metrics."""
    metrics = Metrics()
    engine = Engine(run.pipe, cfg, tok.stop_ids, tok.decode, metrics,
                    restart=run.procs.restart)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(str(i), p, sp, loop, asyncio.Queue()) for i, (p, sp) in
                enumerate(zip(ids, ps))]
        for job in jobs:
            engine.submit(job)
        pending = list(faults)

        async def collect(job: Job) -> list[int]:
            out = []
            while True:
                item = await asyncio.wait_for(job.events.get(), 120)
                if isinstance(item, Finished):
                    assert item.reason in ("stop", "length"), item
                    return out
                out.append(item.id)
                while job is jobs[0] and pending and len(out) >= pending[0][0]:
                    _, sig, stage = pending.pop(0)
                    os.kill(run.procs.procs[stage].pid, sig)
        return await asyncio.gather(*(collect(j) for j in jobs))

    engine.start()
    try:
        tokens = asyncio.run(main())
    finally:
        engine.stop()
    assert engine.failure is None, engine.failure
    return tokens, engine.stages, metrics


@pytest.mark.parametrize("drafts", [0, 2], ids=["plain", "mtp-drafts"])
def test_a_stage_killed_or_stopped_is_started_again_and_every_request_ends_exactly(
        stages, drafts):
    """Plain: stage 1 killed, then stage 0 stopped (taken for hung and killed); with drafts
    the last stage, the drafter's, killed. The tokens equal each request's alone."""
    run, tok, ids, ps, alone = stages
    pids = {k: p.pid for k, p in run.procs.procs.items()}
    faults = ([(4, signal.SIGKILL, 1), (10, signal.SIGSTOP, 0)] if not drafts
              else [(6, signal.SIGKILL, 1)])
    cfg = SchedulerConfig(slots=4, ctx=CTX, draft_tokens=drafts, drafter="mtp")
    tokens, table, metrics = _serve(run, tok, cfg, ids, ps, faults)
    assert tokens == alone
    assert max(len(t) for t in alone) > faults[-1][0]   # the faults came mid-generation
    restarted = {stage for _, _, stage in faults}
    for row in table:
        assert (row["pid"] != pids[row["stage"]]) == (row["stage"] in restarted), table
    for stage in restarted:
        assert metrics.stage_restarts.labels(str(stage))._value.get() == 1
        assert "starting it again" in Path(run.procs.log_path(stage)).read_text()


# --- the rebuild, against fake stages ----------------------------------------------------------

class KindAwarePipeline(FakePipeline):
    """Fake stages whose KV of a position depends on whether a prompt chunk or a decode window
    wrote it (as the real kernels' may: DESIGN.md, exactness 2); lose() is a stage started
    again: every window in flight and all KV gone."""

    def receive(self, timeout=None):
        w = self.queue[0]
        result, tensors = super().receive(timeout)
        for s, p in zip(w.slots, w.positions):
            if s >= 0 and not w.chunk:
                self.kv[s][p] += 1000   # a decode row's KV: another value
        return result, tensors

    def lose(self) -> None:
        self.queue.clear()
        for kv in self.kv:
            kv.clear()


def test_a_rebuild_writes_each_position_as_it_was_written_and_the_tokens_go_on_unchanged():
    rng = random.Random(7)
    ps = prompts(6, rng)
    alone = [_alone(p, params(i)) for i, p in enumerate(ps)]
    pipe = KindAwarePipeline(3, 256)
    cfg = SchedulerConfig(slots=3, ctx=256, chunk_rows=8)
    sched = Scheduler(pipe, cfg, frozenset({2}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    steps, losses = 0, 0
    while sched.step():
        steps += 1
        if steps % 9 == 0 and losses < 4:   # mid-prompt and mid-decoding, in flight
            pipe.lose()
            sched.restarted()
            losses += 1
    assert losses == 4
    assert [r.seq.generated for r in reqs] == alone


def _alone(prompt: list[int], p, ctx: int = 256) -> list[int]:
    sched = Scheduler(KindAwarePipeline(1, ctx), SchedulerConfig(slots=1, ctx=ctx, chunk_rows=8),
                      frozenset({2}))
    req = sched.submit(prompt, p)
    sched.run()
    return req.seq.generated


def test_a_prompt_chunk_rewriting_decoded_tokens_would_be_caught():
    """The fake above tells the two apart: a decoded token's KV written by a prompt chunk
    gives other tokens after it (the check of the rebuild can fail)."""
    prompt = [5, 9, 11, 13]
    want = _alone(prompt, params(0, tokens=12))
    assert _alone(prompt + want[:5], params(0, tokens=7)) != want[5:]


# --- the Unix socket's side --------------------------------------------------------------------

def test_a_unix_push_keeps_a_message_for_a_peer_that_binds_again(tmp_path):
    """A message sent after the peer went (before any byte of it went) reaches the next peer
    bound at the path, as ZeroMQ's reconnecting PUSH does; before, it was dropped."""
    os.chmod(tmp_path, 0o700)
    endpoint = f"unix://{tmp_path}/s"
    pull = unixsock.UnixPull(endpoint)
    push = unixsock.UnixPush(endpoint)
    try:
        push.send_multipart([b"one"])
        assert pull.poll(2000) and [bytes(f) for f in pull.recv_multipart()] == [b"one"]
        pull.close()   # the peer goes (a stage killed): the next send meets its closed end
        push.send_multipart([b"two"])
        again = unixsock.UnixPull(endpoint)   # started again, at the same path
        try:
            assert again.poll(5000), "the message for the peer that bound again was dropped"
            assert [bytes(f) for f in again.recv_multipart()] == [b"two"]
        finally:
            again.close()
    finally:
        push.close()


def test_a_stage_that_failed_while_another_started_again_is_heard_when_it_says_hello(tmp_path):
    """Stage 1 was being started again when stage 0 failed: the coordinator then waits for
    stage 0, and stage 1's hello, which comes meanwhile, counts too (it was dropped: stage 1
    then stayed out of the stage table and of the heartbeats)."""
    from strata.coordinator.stages.pipeline import Expect, Pipeline
    from strata.protocol import transport
    from strata.protocol.messages import PROTOCOL_VERSION, Hello

    os.chmod(tmp_path, 0o700)
    pipe = Pipeline(f"unix://{tmp_path}/inbox", f"unix://{tmp_path}/stage0")
    stage = transport.Sockets().push(f"unix://{tmp_path}/inbox")
    try:
        hello = [Hello(PROTOCOL_VERSION, k, 15 * k, 15 * k + 15, "cpu", "f", 100 + k, 1, 64)
                 for k in (0, 1)]
        for h in hello:
            transport.send(stage, h)
        pipe.wait_for_hellos([Expect(k, 15 * k, 15 * k + 15, "f", 1, 64) for k in (0, 1)],
                             timeout=10)
        pipe.hellos.pop(1)   # stage 1 starts again, and before its hello...
        transport.send(stage, Hello(PROTOCOL_VERSION, 1, 15, 30, "cpu", "f", 201, 1, 64))
        transport.send(stage, Hello(PROTOCOL_VERSION, 0, 0, 15, "cpu", "f", 200, 1, 64))
        came = pipe.rejoin(0, timeout=10)   # ...stage 0 fails and starts again
        assert sorted(h.stage for h in came) == [0, 1]
        assert [(s["stage"], s["pid"], s["restarts"]) for s in pipe.stage_table()] == [
            (0, 200, 1), (1, 201, 1)]
    finally:
        pipe.close()


def test_the_rest_of_a_message_begun_for_a_peer_that_went_never_reaches_the_next(tmp_path):
    """peer_gone closes the connection to a peer that went while a message was half sent:
    that message is dropped, so the next peer bound at the path gets whole messages only (it
    got the rest of the half-sent one, and read garbage from there on)."""
    os.chmod(tmp_path, 0o700)
    endpoint = f"unix://{tmp_path}/s"
    pull = unixsock.UnixPull(endpoint)
    push = unixsock.UnixPush(endpoint)
    try:
        with push.lock:   # as the sender thread leaves a message the kernel took in part
            assert push._connected()
            push.backlog.append(unixsock.encode([b"the rest of a half-sent message"]))
            push.begun = True
        pull.close()
        assert push.peer_gone()
        again = unixsock.UnixPull(endpoint)
        try:
            push.send_multipart([b"next"])
            assert again.poll(5000)
            assert [bytes(f) for f in again.recv_multipart()] == [b"next"]
        finally:
            again.close()
    finally:
        push.close()
