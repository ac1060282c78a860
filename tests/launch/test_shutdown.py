"""The end of a launch: every stage leaves by itself on the coordinator's Shutdown, also the
stages after one that died (the Shutdown that goes down the chain cannot pass a dead stage)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.launch.plan import plan_stages
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelFile

CTX = 64


@pytest.mark.parametrize("dead", [None, 0, 1], ids=["none-dead", "stage0-dead", "stage1-dead"])
def test_the_stages_after_a_dead_one_leave_on_the_shutdown(tiny_model, tmp_path, dead):
    """Three stages serve a request; then one is killed (or none), and the launch ends: every
    stage left alive exits by itself, well within the grace after which it would be
    terminated (5 s)."""
    file = ModelFile(tiny_model)
    plan = plan_stages("1,2", ["cpu"], file.config.n_layers)
    with launch_stages(file, plan, slots=1, ctx=CTX, log_dir=tmp_path, say=lambda s: None) as run:
        sched = Scheduler(run.pipe, SchedulerConfig(slots=1, ctx=CTX), [], str)
        req = sched.submit([5, 6, 7], SamplingParams(max_tokens=4))
        sched.run()
        assert req.error is None and len(req.seq.generated) == 4
        procs = run.procs.procs
        if dead is not None:
            os.kill(procs[dead].pid, signal.SIGKILL)
            procs[dead].wait()
            deadline = time.monotonic() + 5   # the coordinator's watch sees the socket close
            while not run.pipe.liveness.stages[dead].watch.gone():
                assert time.monotonic() < deadline, "the dead stage's socket never closed"
                time.sleep(0.05)
        start = time.monotonic()
    took = time.monotonic() - start
    alive = [k for k in procs if k != dead]
    assert {k: procs[k].returncode for k in alive} == {k: 0 for k in alive}, took
    assert took < 4, took
    for k in alive:
        assert "shutting down" in (tmp_path / f"stage{k}.log").read_text()
