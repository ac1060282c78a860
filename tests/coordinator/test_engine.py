"""The engine thread against the fake pipeline of test_scheduler (no model, no processes)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from strata.coordinator.engine.engine import IDLE_CHECK_S, Engine, EngineDown, Finished, Job
from strata.coordinator.stages.pipeline import PipelineError
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import SchedulerConfig
from test_scheduler import STOP, FakePipeline, params, run_alone


async def _finish(engine: Engine, name: str, prompt: list[int], p: SamplingParams):
    """Submits a job and waits for its Finished; returns (tokens streamed, Finished)."""
    job = Job(name, prompt, p.with_seed(), asyncio.get_running_loop(), asyncio.Queue())
    engine.submit(job)
    tokens = []
    while True:
        item = await asyncio.wait_for(job.events.get(), 30)
        if isinstance(item, Finished):
            return tokens, item
        tokens.append(item.id)


def test_the_engine_survives_a_window_that_cannot_be_sent():
    """A job whose sampling parameters the wire cannot carry (submitted past the HTTP parser)
    ends with an error; the jobs beside it and after it are served exactly, and the engine
    stays alive with every slot idle."""
    ps = [[5, 6, 7], list(range(3, 30)), [9, 8, 7, 6]]

    async def main():
        engine = Engine(FakePipeline(2, 256), SchedulerConfig(slots=2, groups=2, chunk_rows=8,
                                                              ctx=256), frozenset({STOP}),
                        lambda ids: "")
        engine.start()
        try:
            bad = SamplingParams(temperature=0.5, top_k=2**64, seed=3)
            results = await asyncio.gather(
                _finish(engine, "a", ps[0], params(0)),
                _finish(engine, "bad", list(range(3, 40)), bad),
                _finish(engine, "b", ps[1], params(1)))
            later = await _finish(engine, "c", ps[2], params(2))
            return engine, results, later
        finally:
            engine.stop()

    engine, (a, bad, b), c = asyncio.run(main())
    assert bad[1].reason == "error" and not bad[1].down and "could not send" in bad[1].error
    assert [a[0], b[0], c[0]] == run_alone(ps)
    assert all(f.reason in ("stop", "length") for _, f in (a, b, c))
    assert engine.failure is None
    assert [s.state for s in engine.snapshot.slots] == ["idle", "idle"]



class HangingPipeline(FakePipeline):
    """The stages hang once `hung` is set: Pipeline.check says so."""
    hung = False

    def check(self) -> None:
        if self.hung:
            raise PipelineError("stage 1 has not answered for 12.0 s")


def test_an_idle_engine_hears_of_a_stage_that_hangs():
    """With no request running, a hung stage still stops the engine (so /health fails and a
    new request gets the sentence at once, not after a window of its own)."""
    import time

    async def main():
        pipe = HangingPipeline(1, 64)
        engine = Engine(pipe, SchedulerConfig(slots=1, ctx=64), frozenset(), lambda ids: "")
        engine.start()
        try:
            _, fin = await _finish(engine, "a", [5, 6, 7], SamplingParams(max_tokens=3))
            assert fin.reason == "length" and engine.alive
            pipe.hung = True
            deadline = time.monotonic() + 3 * IDLE_CHECK_S
            while engine.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return engine
        finally:
            engine.stop()

    engine = asyncio.run(main())
    assert engine.failure == "the stages stopped serving: stage 1 has not answered for 12.0 s"
    with pytest.raises(EngineDown, match="stage 1 has not answered"):
        engine.submit(None)


def test_the_engine_and_server_import_neither_torch_nor_zmq():
    code = ("import sys, strata.coordinator.engine.engine, strata.coordinator.api.server; "
            "print(sorted({'torch', 'zmq'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_finished_request_is_in_the_snapshot_before_its_client_hears():
    """When a job's Finished reaches the event loop, /v1/status (the snapshot) already shows
    its slot idle, however slowly the engine thread takes its snapshot."""
    import time

    async def main():
        engine = Engine(FakePipeline(1, 64), SchedulerConfig(slots=1, ctx=64), frozenset(),
                        lambda ids: "")
        snapshot = engine.scheduler.snapshot

        def slow_snapshot():
            time.sleep(0.2)   # the loop gets the Finished first, if it was posted before
            return snapshot()

        engine.scheduler.snapshot = slow_snapshot
        engine.start()
        try:
            _, fin = await _finish(engine, "a", [5, 6, 7], SamplingParams(max_tokens=3))
            return fin, [s.state for s in engine.snapshot.slots]
        finally:
            engine.stop()

    fin, states = asyncio.run(main())
    assert fin.reason == "length" and states == ["idle"]
