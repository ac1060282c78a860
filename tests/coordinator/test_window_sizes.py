"""Decode windows sized to the load: a group's window has its decoding slots rounded up to a
multiple of 8 rows, at most window_rows (auto: a group's slots rounded up to 8, at most 64).

Against the fake pipeline of test_scheduler: the sizes as windows go out, turns past the
maximum, drafts only in the rounding's spare rows, the config's and the CLI's sentences, the
strata_window_rows histogram and /v1/status, the bound on prompt chunks before a decode
window, and the 8 pad rows that carry an idle scheduler's commits. Then one real launch of the varied tiny model on
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
from strata.coordinator.engine.engine import Engine, Finished, Job
from strata.coordinator.engine.metrics import Metrics
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.coordinator.windows import DEFAULT_CHUNK_ROWS
from strata.coordinator.api.server import Server
from strata.coordinator.api.connections import ServerConfig
from test_scheduler import FakePipeline, params


def round8(n: int) -> int:
    return (n + 7) // 8 * 8


class Recorder:
    """Wraps a pipeline; keeps each decode window as it is sent: (rows, live slots in order)."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.decodes: list[tuple[int, list[int]]] = []
        self.sched: Scheduler | None = None   # if set: count its decoding slots at each window
        self.decoding: list[int] = []

    def new_window_id(self) -> int:
        return self.pipe.new_window_id()

    def submit(self, w) -> None:
        if not w.chunk and any(s >= 0 for s in w.slots):
            self.decodes.append((len(w.slots), [s for s in w.slots if s >= 0]))
            if self.sched is not None:
                self.decoding.append(sum(not s.free and s.read_pos >= len(s.request.seq.prompt)
                                         for s in self.sched.table.slots))
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
    """n one-chunk prompts at once through n slots (auto window rows: n rounded up to 8).
    Every decode window holds every slot decoding at the time (prompts are read 8 or 9 at a
    time between windows), with their count rounded up to 8 rows; all n decode together, then
    they end (request i after 8 + i tokens) until one is left."""
    cfg = SchedulerConfig(slots=n, ctx=64)
    assert cfg.window_rows == round8(n)
    prompts = [[3 + i % 50, 4] for i in range(n)]
    rec = Recorder(FakePipeline(n, 64))
    sched = rec.sched = Scheduler(rec, cfg, frozenset())
    reqs = [sched.submit(p, SamplingParams(max_tokens=8 + i)) for i, p in enumerate(prompts)]
    sched.run()
    assert [len(live) for _, live in rec.decodes] == rec.decoding
    assert [rows for rows, _ in rec.decodes] == [round8(k) for k in rec.decoding]
    assert max(rec.decoding) == n and rec.decoding[-1] == 1 and rec.decodes[-1][0] == 8
    assert [len(r.seq.generated) for r in reqs] == [8 + i for i in range(n)]


def test_more_decoding_slots_than_the_maximum_take_turns():
    """80 slots in one group: windows of at most 64 rows (the maximum). Slots join (8 read
    between two windows) and 10 leave early; while more than 64 decode, each window starts
    after the slot that ended the last one, so no slot sits out more than one full window;
    every request gets its solo tokens."""
    n = 80
    cfg = SchedulerConfig(slots=n, ctx=256, chunk_rows=8)
    assert cfg.window_rows == MAX_WINDOW_ROWS
    prompts = [[3 + i % 50, 4 + i % 7] for i in range(n)]
    sampling = [params(i, 12 if i % 8 == 3 else 40) for i in range(n)]
    rec, reqs = run_recorded(cfg, prompts, sampling)
    assert all(rows == min(round8(len(live)), 64) for rows, live in rec.decodes)
    full = [set(live) for rows, live in rec.decodes if len(live) == 64]
    assert len(full) >= 10
    for slot in range(n):
        turns = [k for k, live in enumerate(full) if slot in live]
        assert all(b - a <= 2 for a, b in zip(turns, turns[1:])), (slot, turns)
    alone = [run_recorded(SchedulerConfig(slots=1, ctx=256, chunk_rows=8), [p], [sp])[1][0]
             .seq.generated
             for p, sp in zip(prompts, sampling)]
    assert [r.seq.generated for r in reqs] == alone


class RepeatsTwelveBack(FakePipeline):
    """The next token repeats the one 12 places back: prompt lookup proposes up to 11 right
    drafts, more than any window's pad rows."""

    def token(self, history: list[int], p: int, u: float) -> int:
        return history[-12] if len(history) >= 12 else 3


@pytest.mark.parametrize("slots,decoding,draft_tokens", [(1, 1, 7), (16, 9, 7), (8, 8, 7)])
def test_drafts_fill_only_the_spare_rows_of_the_rounded_size(slots, decoding, draft_tokens):
    """With draft_rows 0, a window with d decoding slots has round8(d) rows whatever the
    maximum (16 here) and the drafts on offer allow: its drafts take exactly the round8(d) - d
    pad rows. 8 decoding slots leave none. (Windows that drafts grow: test_pipelined_mtp.py.)"""
    cfg = SchedulerConfig(slots=slots, window_rows=16, ctx=128, draft_tokens=draft_tokens,
                          draft_rows=0)
    prompts = [list(range(3 + i, 15 + i)) * 2 for i in range(decoding)]
    sampling = [SamplingParams(max_tokens=40)] * decoding
    rec, reqs = run_recorded(cfg, prompts, sampling, pipe=RepeatsTwelveBack(slots, 128))
    steady = [(rows, live) for rows, live in rec.decodes if len(set(live)) == decoding]
    assert len(steady) >= 4
    for rows, live in steady[:-1]:  # the last one: max_tokens leaves room for fewer drafts
        assert rows == round8(decoding) and len(live) == rows, (rows, live)
    for rows, live in rec.decodes:
        assert rows == round8(len(set(live))) and len(live) <= rows, (rows, live)
    drafted = sum(r.drafts.counts.drafted for r in reqs)
    assert drafted == sum(len(live) - len(set(live)) for _, live in rec.decodes)
    assert (drafted > 0) == (decoding % 8 != 0)
    assert sum(r.drafts.counts.accepted for r in reqs) == drafted
    plain = run_recorded(SchedulerConfig(slots=slots, ctx=128), prompts, sampling,
                         pipe=RepeatsTwelveBack(slots, 128))[1]
    assert [r.seq.generated for r in reqs] == [r.seq.generated for r in plain]


def test_auto_window_rows_hold_a_group_of_slots_up_to_64():
    for slots, groups, rows in [(1, 1, 8), (9, 1, 16), (40, 1, 40), (100, 1, 64), (64, 2, 32),
                                (24, 3, 8), (128, 2, 64)]:
        assert SchedulerConfig(slots=slots, groups=groups).window_rows == rows, (slots, groups)
    assert SchedulerConfig(slots=100, window_rows=16).window_rows == 16


@pytest.mark.parametrize("rows,fix", [(0, "use 8"), (12, "use 16"), (72, "use 64"),
                                      (-8, "use 8")])
def test_window_rows_must_be_a_multiple_of_8_up_to_64(rows, fix):
    from strata.launch.options import CHOICES, FLAGS
    with pytest.raises(ValueError) as e:
        SchedulerConfig(window_rows=rows)
    assert str(e.value) == (f"window_rows {rows} is not a multiple of 8 from 8 to 64 (the most "
                            f"rows a stage takes in a decode window); {fix}")
    assert e.value.render(FLAGS, CHOICES).startswith(f"--window-rows {rows} is not")
    assert e.value.render(FLAGS, CHOICES).endswith(f"; {fix} or auto")


def test_draft_tokens_stay_below_the_maximum():
    with pytest.raises(ValueError, match="draft_tokens 8 is not from 0 to 7"):
        SchedulerConfig(slots=9, draft_tokens=8)   # even in windows of 16 rows
    assert SchedulerConfig(slots=9, draft_tokens=7).window_rows == 16


def test_the_cli_takes_auto_or_a_number(tiny_model):
    """64 slots over 2 stages with auto groups: 2 groups of 32-row windows; a window size that
    is not a number gets a sentence before any stage starts."""
    from strata.launch.cli import main
    from strata.launch.options import prepare

    prep = prepare(model=str(tiny_model), layer_split="2", devices="cpu", ctx_size=64, batch=64,
                   batch_groups="auto", window_rows="auto", chunk_rows=32)
    assert len(prep.plan) == 2 and prep.sched.groups == 2 and prep.sched.window_rows == 32
    prep = prepare(model=str(tiny_model), layer_split="2", devices="cpu", ctx_size=64, batch=64,
                   batch_groups="1", window_rows="24", chunk_rows=32)
    assert prep.sched.groups == 1 and prep.sched.window_rows == 24
    r = CliRunner().invoke(main, ["--model", str(tiny_model), "--devices", "cpu",
                                  "--window-rows", "wide", "--prompt", "x"],
                           prog_name="strata-launch")
    assert r.exit_code == 2 and r.stderr == ("strata-launch: --window-rows 'wide' is not a "
                                             "number or auto\n"), (r.output, r.exception)
    r = CliRunner().invoke(main, ["--model", str(tiny_model), "--devices", "cpu",
                                  "--window-rows", "20", "--prompt", "x"],
                           prog_name="strata-launch")
    assert r.exit_code == 2 and r.stderr.startswith("strata-launch: --window-rows 20 is not a "
                                                    "multiple of 8"), (r.output, r.exception)
    assert r.stderr.endswith("; use 24 or auto\n")
    r = CliRunner().invoke(main, ["-h"], prog_name="strata-launch")
    assert "--window-rows TEXT" in r.output and "[default: auto]" in r.output


def test_chunk_rows_auto_follows_the_stages_devices(tiny_model):
    """--chunk-rows auto: 128-row chunks when every stage is on a CUDA device, 32 otherwise
    (CPU stages compute every row of a chunk); a number is taken as given."""
    from strata.launch.options import GPU_CHUNK_ROWS, auto_chunk_rows, prepare
    from strata.launch.plan import StagePlan

    prep = prepare(model=str(tiny_model), layer_split="2", devices="cpu", ctx_size=64, batch=4,
                   batch_groups="1", window_rows="auto", chunk_rows="auto")
    assert prep.sched.chunk_rows == DEFAULT_CHUNK_ROWS == 32
    prep = prepare(model=str(tiny_model), layer_split="2", devices="cpu", ctx_size=64, batch=4,
                   batch_groups="1", window_rows="auto", chunk_rows="16")
    assert prep.sched.chunk_rows == 16
    gpus = [StagePlan(0, 0, 2, "cuda:0"), StagePlan(1, 2, 4, "cuda:1")]
    assert auto_chunk_rows(gpus) == GPU_CHUNK_ROWS == 128
    assert auto_chunk_rows([gpus[0], StagePlan(1, 2, 4, "cpu")]) == DEFAULT_CHUNK_ROWS


def prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_histogram_and_status_show_each_decode_window():
    """Through the engine and the HTTP server: 9 requests in one group of 9 slots decode
    9, 8, ..., 1 at a time (request i: i + 1 windows), so the windows have 16, then eight
    times 8 rows; /metrics counts them, /v1/status shows the last one."""
    from aiohttp.test_utils import TestClient, TestServer

    n = 9
    metrics = Metrics()
    engine = Engine(FakePipeline(n, 64), SchedulerConfig(slots=n, ctx=64), frozenset(),
                    lambda ids: "", metrics)
    server = Server(engine, None, 64, ServerConfig(model="fake"), metrics, lambda: None)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(str(i), [3 + i, 4], SamplingParams(max_tokens=2 + i).with_seed(), loop,
                    asyncio.Queue()) for i in range(n)]
        for job in jobs:
            engine.submit(job)
        engine.start()
        try:
            for job in jobs:
                while not isinstance(await asyncio.wait_for(job.events.get(), 30), Finished):
                    pass
            async with TestClient(TestServer(server.app())) as client:
                status = await (await client.get("/v1/status")).json()
                text = await (await client.get("/metrics")).text()
        finally:
            engine.stop()
        return status, text

    status, text = asyncio.run(main())
    assert status["window_rows"] == 16
    assert status["groups"] == [{"group": 0, "slots": list(range(n)), "window_in_flight": False,
                                 "windows_in_flight": 0, "decode_window": {"rows": 8, "live": 1},
                                 "drafts": None}]   # no drafts: nothing chosen
    m = prometheus(text)
    assert m['strata_window_rows_count{counted="size"}'] == n
    assert m['strata_window_rows_bucket{counted="size",le="8.0"}'] == n - 1
    assert m['strata_window_rows_bucket{counted="size",le="16.0"}'] == n
    assert m['strata_window_rows_sum{counted="size"}'] == 16 + 8 * (n - 1)
    assert m['strata_window_rows_sum{counted="live"}'] == sum(range(1, n + 1))
    assert m['strata_window_rows_bucket{counted="live",le="8.0"}'] == n - 1
    assert m['strata_window_rows_bucket{counted="live",le="64.0"}'] == n


def test_a_long_prompt_delays_a_large_windows_streams_by_8_chunks_at_most():
    """64 slots (auto: windows of up to 64 rows), one slot decoding, a prompt of 40 chunks
    arrives: the window could take its row, but the stream still gets a window after at most
    8 chunks, then chunks and windows alternate; both get their solo tokens."""
    cfg = SchedulerConfig(slots=64, ctx=512, chunk_rows=8)
    assert cfg.window_rows == 64
    pipe = FakePipeline(64, 512)
    sent = []

    class Kinds(Recorder):
        def submit(self, w) -> None:
            sent.append("chunk" if w.chunk else "decode")
            super().submit(w)

    sched = Scheduler(Kinds(pipe), cfg, frozenset())
    stream = sched.submit([5, 6], SamplingParams(max_tokens=60))
    sched.step()
    prompts = [[5, 6], [3 + i % 50 for i in range(320)]]
    long = sched.submit(prompts[1], SamplingParams(max_tokens=4))
    sched.run()
    decodes = [0] + [i for i, kind in enumerate(sent) if kind == "decode"]  # 0: its chunk
    while_read = [b - a for a, b in zip(decodes, decodes[1:])][:10]
    assert max(while_read) <= 8 + 1 and sent[1:10] == ["chunk"] * 8 + ["decode"]
    alone = [run_recorded(SchedulerConfig(slots=1, ctx=512, chunk_rows=8), [p],
                          [SamplingParams(max_tokens=n)])[1][0].seq.generated
             for p, n in zip(prompts, (60, 4))]
    assert [stream.seq.generated, long.seq.generated] == alone


def test_commits_of_an_idle_scheduler_ride_on_the_smallest_decode_window():
    """A finished request's decoded rows are dropped by a commit; with nothing else to run,
    it rides on a window of 8 pad rows (a size every stage takes), and the stage then holds
    just the prompt."""
    pipe = FakePipeline(1, 64)
    shapes = []

    class Shapes(Recorder):
        def submit(self, w) -> None:
            shapes.append((len(w.slots), [s for s in w.slots if s >= 0], w.commits))
            super().submit(w)

    sched = Scheduler(Shapes(pipe), SchedulerConfig(ctx=64), frozenset())
    sched.submit([5, 6, 7], SamplingParams(max_tokens=4))
    sched.run()
    assert shapes[-1] == (8, [], [[0, 3]]) and pipe.kv[0] == [5, 6, 7]


# --- a real launch: windows that change size during the run give every request its solo tokens

CTX = 256
LONG = 32   # tokens of the requests that come first and end last


@pytest.fixture(scope="module")
def varied_launch(varied_model):
    """The varied tiny model (conftest) on 2 CPU stages with 24 slots; its 24 prompts (the
    harness's set without its long one) and their params (odd ones seeded); each request's
    tokens alone."""
    from strata.launch.plan import plan_stages
    from strata.launch.session import launch_stages
    from strata.model.gguf_file import ModelFile
    from strata.model.tokenizer import Tokenizer

    file = ModelFile(varied_model)
    tok = Tokenizer.from_gguf(file.reader)
    texts = [t for i, t in enumerate(harness.prompt_set(25)) if i != 12]
    prompts = [tok.encode(t) for t in texts]
    sampling = [harness.request_params(i, i % 2 == 1, LONG if i < 3 else 8 + (i % 4) * 3)
                for i in range(24)]
    plan = plan_stages("2", ["cpu"], file.config.n_layers)
    with launch_stages(file, plan, slots=24, ctx=CTX, say=lambda s: None) as run:
        alone = harness.run_alone(run, SchedulerConfig(slots=1, ctx=CTX), tok, prompts,
                                  sampling)
        yield run, tok, prompts, sampling, [r.seq.generated for r in alone]


@pytest.mark.parametrize("groups,most", [(1, 24), (2, 16)])
def test_windows_that_grow_and_shrink_give_solo_tokens(varied_launch, groups, most):
    """3 requests decode (8-row windows); 21 more arrive in three waves, shorter ones, so the
    windows grow to their maximum (24 rows, or 16 with 2 groups of 12 slots), then shrink back
    to 8 as they end; one is cancelled. Greedy and seeded requests alike get their tokens
    alone (where the stages' arithmetic is batch-invariant: windows of 8 to 24 rows)."""
    run, tok, prompts, sampling, alone = varied_launch
    rec = Recorder(run.pipe)
    cfg = SchedulerConfig(slots=24, groups=groups, ctx=CTX)
    assert cfg.window_rows == most
    sched = Scheduler(rec, cfg, tok.stop_ids, tok.decode)
    reqs = [sched.submit(prompts[i], sampling[i]) for i in range(3)]
    while min(len(r.seq.generated) for r in reqs) < 3:
        sched.step()
    for wave in (range(3, 10), range(10, 17), range(17, 24)):
        reqs += [sched.submit(prompts[i], sampling[i]) for i in wave]
        for _ in range(4):
            sched.step()
    cancelled = reqs[5]
    while len(cancelled.seq.generated) < 3:
        sched.step()
    sched.cancel(cancelled)
    sched.run()
    assert sched.idle
    sizes = [rows for rows, _ in rec.decodes]
    assert all(rows == round8(len(live)) for rows, live in rec.decodes)
    assert sizes[0] == 8 and most in sizes and sizes[-1] == 8, sizes   # 8 -> most -> 8
    assert cancelled.seq.finish_reason == "cancelled"
    for i, r in enumerate(reqs):
        want = alone[i][:len(r.seq.generated)] if r is cancelled else alone[i]
        at = harness.first_mismatch(want, r.seq.generated)
        assert at is None, (f"request {i} differs at token {at}: alone {want[at:at + 4]}, "
                            f"in varying windows {r.seq.generated[at:at + 4]}")
    assert sum(len(t) >= 8 for t in alone) >= 16   # real, long texts were compared


@pytest.mark.parametrize("n,rows", [(1, 1), (2, 2), (3, 4), (4, 4), (6, 8), (9, 16)])
def test_min_window_rows_1_gives_up_to_4_rows_windows_of_1_2_or_4(n, rows):
    """n slots decoding together: their windows take the smallest of 1, 2 and 4 rows that
    holds them, else a multiple of 8, as SchedulerConfig.window_shape says."""
    cfg = SchedulerConfig(slots=n, ctx=64, min_window_rows=1)
    rec, reqs = run_recorded(cfg, [[3 + i, 4] for i in range(n)],
                             [SamplingParams(max_tokens=6) for _ in range(n)])
    assert max(size for size, _ in rec.decodes) == rows
    assert all(size == cfg.window_shape(len(live)) for size, live in rec.decodes)
    assert rec.decodes[-1][0] == cfg.window_shape(len(rec.decodes[-1][1]))
    assert SchedulerConfig(min_window_rows=2).window_shape(1) == 2


def test_min_window_rows_is_1_2_4_or_8():
    from strata.config_error import ConfigError
    from strata.launch.options import FLAGS
    with pytest.raises(ConfigError) as e:
        SchedulerConfig(min_window_rows=3)
    assert e.value.render(FLAGS) == ("--min-window-rows 3 is not one of 1, 2, 4 or 8; use 8 "
                                     "(the default) or 1")


def test_small_windows_give_the_tokens_of_8_row_windows(varied_launch):
    """Each request alone in 1-row windows, and 3 at a time in 4-row ones (then 2 and 1 as they
    end): the tokens of 8-row windows alone, on two CPU stages."""
    run, tok, prompts, sampling, alone = varied_launch
    small = SchedulerConfig(slots=3, ctx=CTX, min_window_rows=1)
    rec = Recorder(run.pipe)
    sched = Scheduler(rec, small, tok.stop_ids, tok.decode)
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts[3:9], sampling[3:9])]
    sched.run()
    assert {size for size, _ in rec.decodes} >= {4, 2}, rec.decodes
    one = harness.run_alone(run, small, tok, prompts[:3], sampling[:3])
    assert [r.seq.generated for r in one] == alone[:3]
    assert [r.seq.generated for r in reqs] == alone[3:9]
