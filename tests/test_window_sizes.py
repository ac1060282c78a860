"""Decode windows sized to the load: a group's window has its decoding slots rounded up to a
multiple of 8 rows, at most window_rows (auto: a group's slots rounded up to 8, at most 64).

Against the fake pipeline of test_scheduler: the sizes as windows go out, rotation past the
maximum, drafts only in the rounding's spare rows, the config's sentences, the
strata_window_rows histogram and /v1/status. Then one real launch of the varied tiny model on
two CPU stages, whose windows grow from 8 to 24 rows and shrink back while requests arrive,
end and are cancelled: every request's tokens equal its tokens alone.
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from click.testing import CliRunner

from strata.bench import harness
from strata.coordinator.config import MAX_WINDOW_ROWS
from strata.coordinator.engine import Engine, Finished, Job
from strata.coordinator.metrics import Metrics
from strata.coordinator.sampling import SamplingParams
from strata.coordinator.scheduler import Scheduler, SchedulerConfig
from strata.coordinator.server import Server
from strata.coordinator.connections import ServerConfig
from test_scheduler import STOP, FakePipeline, RepeatingPipeline, params, run_alone


def round8(n: int) -> int:
    return (n + 7) // 8 * 8


class Recorder:
    """Wraps a pipeline; keeps each decode window as it is sent: (rows, live slots in order)."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.decodes: list[tuple[int, list[int]]] = []

    def new_window_id(self) -> int:
        return self.pipe.new_window_id()

    def submit(self, w) -> None:
        if not w.chunk and any(s >= 0 for s in w.slots):
            self.decodes.append((len(w.slots), [s for s in w.slots if s >= 0]))
        self.pipe.submit(w)

    def receive(self, timeout=None):
        return self.pipe.receive(timeout)


def run_recorded(cfg: SchedulerConfig, prompts, sampling, pipe=None, stop=frozenset()):
    rec = Recorder(pipe or FakePipeline(cfg.slots, cfg.ctx))
    sched = Scheduler(rec, cfg, stop)
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts, sampling)]
    sched.run()
    assert sched.idle
    return rec, reqs


@pytest.mark.parametrize("n", [1, 9, 40])
def test_a_window_has_its_decoding_slots_rounded_up_to_8(n):
    """n one-chunk prompts at once through n slots (auto window rows): all n are read first
    (the window can take them), then request i decodes i + 1 windows, so the windows hold
    n, n - 1, ..., 1 decoding slots, with those counts rounded up to 8 rows."""
    cfg = SchedulerConfig(slots=n, ctx=64)
    assert cfg.window_rows == round8(n)
    prompts = [[3 + i % 50, 4] for i in range(n)]
    rec, reqs = run_recorded(cfg, prompts, [SamplingParams(max_tokens=2 + i) for i in range(n)])
    assert [len(live) for _, live in rec.decodes] == list(range(n, 0, -1))
    assert [rows for rows, _ in rec.decodes] == [round8(k) for k in range(n, 0, -1)]
    assert [len(r.seq.generated) for r in reqs] == [2 + i for i in range(n)]


def test_more_decoding_slots_than_the_maximum_take_turns():
    """70 slots in one group: windows of at most 64 rows (the maximum); while more than 64
    slots decode, each window starts where the last one stopped, so no slot sits out more than
    one full window; every request gets its solo tokens."""
    n = 70
    cfg = SchedulerConfig(slots=n, ctx=256, chunk_rows=8)
    assert cfg.window_rows == MAX_WINDOW_ROWS
    prompts = [[3 + i % 50, 4 + i % 7] for i in range(n)]
    rec, reqs = run_recorded(cfg, prompts, [params(i) for i in range(n)], stop=frozenset({STOP}))
    assert all(rows == min(round8(len(live)), 64) for rows, live in rec.decodes)
    full = [set(live) for rows, live in rec.decodes if len(live) == 64]
    assert len(full) >= 10
    for slot in range(n):
        turns = [k for k, live in enumerate(full) if slot in live]
        assert all(b - a <= 2 for a, b in zip(turns, turns[1:])), (slot, turns)
    assert [r.seq.generated for r in reqs] == run_alone(prompts)
