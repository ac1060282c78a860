"""--restart-stages, the engine's side, against the fake stages of test_stage_restart: a
PipelineError naming a stage starts it again and the requests go on; a stage that keeps
failing stops the engine after RESTARTS_IN_A_ROW restarts (a Result of a window given up is
no window back); every stage that said hello again is counted; stop() ends the wait for a
hello at once.
"""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from strata.coordinator.engine.engine import RESTARTS_IN_A_ROW, Engine
from strata.coordinator.engine.metrics import Metrics
from strata.coordinator.stages.pipeline import PipelineError
from strata.coordinator.engine.scheduler import SchedulerConfig
from strata.protocol.messages import Result
from test_engine import _finish
from test_scheduler import params
from test_stage_restart import KindAwarePipeline, _alone


def _served(engine: Engine, main):
    """main() on an event loop while the engine runs; the engine stopped after."""
    engine.start()
    try:
        return asyncio.run(main())
    finally:
        engine.stop()


def test_a_restart_ends_in_flight_windows_and_waits_for_a_new_hello():
    """The engine's side: a PipelineError naming a stage restarts it; the stage table and
    /health follow; a stage that fails again and again stops the engine."""
    class Restarting(KindAwarePipeline):
        def __init__(self):
            super().__init__(1, 64)
            self.fail, self.rejoined = 2, []

        def receive(self, timeout=None):
            if self.fail:
                self.fail -= 1
                raise PipelineError("stage 1 has gone", stage=1)
            return super().receive(timeout)

        def rejoin(self, stage, on_wait=lambda waited: None):
            self.rejoined.append(stage)
            self.lose()
            return [SimpleNamespace(stage=stage, pid=1234)]

        def stage_table(self):
            return [{"stage": 1, "restarts": len(self.rejoined)}]

    pipe, started = Restarting(), []
    engine = Engine(pipe, SchedulerConfig(slots=1, ctx=64), frozenset({2}), lambda ids: "",
                    restart=started.append)

    async def main():
        return await _finish(engine, "a", [3, 4, 5], params(1))

    tokens, fin = _served(engine, main)
    alone = _alone([3, 4, 5], params(1), ctx=64)
    assert (tokens, fin.reason) == (alone, "length")
    assert started == pipe.rejoined == [1, 1]
    assert engine.stages == [{"stage": 1, "restarts": 2}] and engine.restarting is None

    pipe, started = Restarting(), []
    pipe.fail = 99
    engine = Engine(pipe, SchedulerConfig(slots=1, ctx=64), frozenset({2}), lambda ids: "",
                    restart=started.append)
    _, fin = _served(engine, main)
    assert fin.reason == "error" and "restarts in a row" in fin.error, fin
    assert len(started) == 3


def test_a_result_of_a_window_given_up_is_no_window_back():
    """A stage that fails on every window after it starts again stops the engine after
    RESTARTS_IN_A_ROW restarts, though the Result of a window given up comes back between
    them (it was taken for progress, and the engine started the stage again for ever)."""
    class FailsAgain(KindAwarePipeline):
        def __init__(self):
            super().__init__(2, 64)
            self.stale: list[int] = []   # windows given up whose Results still come

        def receive(self, timeout=None):
            if self.stale:
                return Result(self.stale.pop(0), []), []
            if len(started) < 10:   # (then it gives up failing: the test ends either way)
                raise PipelineError("stage 1 has gone", stage=1)
            return super().receive(timeout)

        def rejoin(self, stage, on_wait=lambda waited: None):
            self.stale = [w.id for w in self.queue]
            self.lose()
            return [SimpleNamespace(stage=stage, pid=1234)]

    started = []
    pipe = FailsAgain()
    engine = Engine(pipe, SchedulerConfig(slots=2, groups=2, ctx=64), frozenset({2}),
                    lambda ids: "", restart=started.append)

    async def main():
        return [fin for _, fin in await asyncio.gather(
            *[_finish(engine, str(i), [3, 4, 5 + i], params(i)) for i in range(2)])]

    ends = _served(engine, main)
    assert len(started) == RESTARTS_IN_A_ROW, started
    assert all(f.reason == "error" and "restarts in a row" in f.error for f in ends), ends


def test_a_stage_that_said_hello_before_another_failed_counts_as_started_again():
    """Stage 1 starts again and says hello; stage 0 fails before the wait ends (it hangs)
    and starts again too: strata_stage_restarts_total counts both, as /v1/status does (stage
    1's hello came in the wait that failed, and was not counted)."""
    class TwoFail(KindAwarePipeline):
        def __init__(self):
            super().__init__(1, 64)
            self.fail, self.restarts = True, {0: 0, 1: 0}

        def receive(self, timeout=None):
            if self.fail:
                self.fail = False
                raise PipelineError("stage 1 has gone", stage=1)
            return super().receive(timeout)

        def rejoin(self, stage, on_wait=lambda waited: None):
            self.lose()
            self.restarts[stage] += 1   # its hello came
            if stage == 1:
                raise PipelineError("stage 0 has not answered for 6.0 s", stage=0)
            return [SimpleNamespace(stage=stage, pid=1234)]

        def stage_table(self):
            return [{"stage": k, "pid": 100 + k, "restarts": n}
                    for k, n in self.restarts.items()]

    started, metrics = [], Metrics()
    engine = Engine(TwoFail(), SchedulerConfig(slots=1, ctx=64), frozenset({2}),
                    lambda ids: "", metrics, restart=started.append)

    async def main():
        return (await _finish(engine, "a", [3, 4, 5], params(1)))[1]

    fin = _served(engine, main)
    assert fin.reason == "length" and started == [1, 0]
    assert [row["restarts"] for row in engine.stages] == [1, 1]
    assert [metrics.stage_restarts.labels(k)._value.get() for k in "01"] == [1, 1]


def test_stopping_while_a_stage_starts_again_ends_at_once():
    """Engine.stop() while the engine waits for a stage's hello: the wait ends, the requests
    end with "the server is stopping" (not as a failure of the stages), no stage is started
    again after it, and stop() returns at once (it waited for the hello, then gave up after
    its grace, with the engine thread still running)."""
    class SlowHello(KindAwarePipeline):
        def __init__(self):
            super().__init__(1, 64)
            self.fail, self.waiting = True, threading.Event()

        def receive(self, timeout=None):
            if self.fail:
                self.fail = False
                raise PipelineError("stage 1 has gone", stage=1)
            return super().receive(timeout)

        def rejoin(self, stage, on_wait=lambda waited: None):
            self.waiting.set()
            start = time.monotonic()
            while time.monotonic() - start < 10:   # a stage that takes long to load
                on_wait(time.monotonic() - start)
                time.sleep(0.02)
            raise PipelineError("stage 1 did not say hello", stage=1)

    pipe, started = SlowHello(), []
    engine = Engine(pipe, SchedulerConfig(slots=1, ctx=64), frozenset({2}), lambda ids: "",
                    stop_grace=0.5, restart=started.append)

    async def main():
        job = asyncio.create_task(_finish(engine, "a", [3, 4, 5], params(1)))
        await asyncio.get_running_loop().run_in_executor(None, pipe.waiting.wait, 10)
        t0 = time.monotonic()
        engine.stop()
        stopped = time.monotonic() - t0
        return stopped, (await job)[1]

    stopped, fin = _served(engine, main)
    assert not engine._thread.is_alive() and stopped < 2, stopped
    assert (fin.reason, fin.error, fin.down) == ("error", "the server is stopping", True)
    assert engine.failure is None and started == [1]
