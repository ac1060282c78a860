"""`strata-bench soak`: its parts (the requests, the schedule of kills and stops, the signals,
the three verdicts), then whole runs: the tiny model's with no fault (passes) and with a stage
killed and no --restart-stages (requests lost: fails), two servers started together, and
SmolLM2's (-m long) without faults and, where strata-launch has --restart-stages, with a kill
and a stop."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import stage_processes
from strata.bench import harness
from strata.bench.loadtest import Answer
from strata.bench.soak import Soak, _inject, is_stage_worker
from strata.bench.soak_checks import (Fault, compare, fault_schedule, memory_verdict, output,
                                      request_pool, why_lost)

# --- the requests -------------------------------------------------------------------------------


def test_the_pool_mixes_sampling_routes_streams_and_lengths():
    pool = request_pool(harness.PROMPTS, 48, 32)
    mixes = {(r.sampled, r.chat, r.stream, r.max_tokens) for r in pool}
    assert len(mixes) == 2 * 2 * 2 * 4, mixes   # every mix
    assert {r.max_tokens for r in pool} == {8, 16, 24, 32}
    assert len({(r.sampled, r.chat, r.stream) for r in pool[:12]}) == 8
    bodies = [r.body() for r in pool]
    seeded = [b for b in bodies if b["temperature"]]
    assert len(seeded) == 24 and all(b["temperature"] == 0.7 and "seed" in b for b in seeded)
    assert len({b["seed"] for b in seeded}) == 24
    assert all(b["stream_options"] == {"include_usage": True} for b in bodies if b["stream"])
    assert all(("messages" in b) != ("prompt" in b) for b in bodies)
    assert len({json.dumps(b, sort_keys=True) for b in bodies}) == 48


# --- the schedule ---------------------------------------------------------------------------------

def test_the_default_schedule_kills_every_minute_and_stops_between_the_kills():
    faults = fault_schedule(300, 30, 2, kill_every=60, stop_every=60, stop_for=10)
    assert [(f.at, f.kind, f.stage) for f in faults] == [
        (60, "stop", 1), (90, "kill", 0), (120, "stop", 0), (150, "kill", 1),
        (180, "stop", 1), (210, "kill", 0), (240, "stop", 0), (270, "kill", 1)]
    assert all(f.hold == 10 for f in faults if f.kind == "stop")
    assert all(f.hold == 0 for f in faults if f.kind == "kill")


def test_the_schedule_goes_round_robin_and_keeps_within_the_load():
    faults = fault_schedule(100, 0, 3, kill_every=20, stop_every=30, stop_for=20)
    assert [(f.at, f.kind, f.stage) for f in faults] == [
        (15, "stop", 2), (20, "kill", 0), (40, "kill", 1), (45, "stop", 1), (60, "kill", 2),
        (75, "stop", 0), (80, "kill", 0)]   # a kill at 100, a stop at 105: past the load
    # a stop must end by the end of the load
    assert [f.at for f in fault_schedule(100, 0, 3, 20, 30, 25)] == [15, 20, 40, 45, 60, 75, 80]
    assert [f.at for f in fault_schedule(100, 0, 3, 20, 30, 26)] == [15, 20, 40, 45, 60, 80]


def test_no_faults_when_kills_and_stops_are_off():
    assert fault_schedule(300, 30, 2, kill_every=0, stop_every=60, stop_for=0) == []
    assert [f.kind for f in fault_schedule(300, 30, 2, 0, 60, 10)] == ["stop"] * 4
    assert [f.kind for f in fault_schedule(300, 30, 2, 60, 60, 0)] == ["kill"] * 4


# --- the signals ----------------------------------------------------------------------------------

def _state(pid: int) -> str:
    """The process's state letter (/proc/PID/stat): T = stopped, Z = dead, not yet reaped."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_for_exec(pid: int, code: str, timeout: float = 10.0) -> None:
    """Until the process's command line holds `code`: a process just spawned may still show
    its parent's until it has exec'd, which a loaded machine can delay."""
    deadline = time.monotonic() + timeout
    while code.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"process {pid} did not start within {timeout} s"
        time.sleep(0.01)


def test_a_stop_is_continued_after_its_hold_and_a_kill_kills(tmp_path):
    # two processes that look like stage workers (their command line names the module)
    code = "import time; time.sleep(120)"
    procs = [subprocess.Popen([sys.executable, "-c", code, "strata.stage_worker"])
             for _ in range(2)]
    other = subprocess.Popen([sys.executable, "-c", code])   # not a stage worker
    try:
        for p in procs + [other]:   # each past its exec (until then /proc shows our command line)
            _wait_for_exec(p.pid, code)
        assert all(is_stage_worker(p.pid) for p in procs) and not is_stage_worker(other.pid)
        soak = Soak([], "", {}, say=lambda s: None,
                    pids={0: procs[0].pid, 1: procs[1].pid, 2: other.pid})
        faults = [Fault(0.1, "stop", 1, hold=1.0), Fault(0.3, "kill", 0), Fault(0.4, "kill", 2)]
        seen = {}

        async def run():
            soak.start = time.monotonic()
            task = asyncio.create_task(_inject(soak, faults))
            await asyncio.sleep(0.7)
            seen["mid"] = _state(procs[1].pid), procs[0].poll(), set(soak.stopped)
            await task

        asyncio.run(run())
        assert seen["mid"] == ("T", -signal.SIGKILL, {procs[1].pid})
        assert _state(procs[1].pid) in "SR" and not soak.stopped   # continued
        assert other.poll() is None   # never signalled: it is no stage worker
        assert [(f["kind"], f["stage"], f["pid"], f["sent"]) for f in soak.faults] == [
            ("stop", 1, procs[1].pid, True), ("kill", 0, procs[0].pid, True),
            ("kill", 2, None, False)]
        assert (soak.count("stop"), soak.count("kill")) == (1, 1)
    finally:
        for p in [*procs, other]:
            p.kill()
            p.wait()


def test_restarts_are_seen_as_a_stage_pid_that_changes():
    from aiohttp import web

    from strata.bench.soak import _read_pids
    tables = [[{"stage": 0, "pid": 10}, {"stage": 1, "pid": 11}],
              [{"stage": 0, "pid": 10}, {"stage": 1, "pid": 12}],   # stage 1 restarted
              [{"stage": 0, "pid": 10}],                             # stage 1 restarting
              [{"stage": 0, "pid": 14}, {"stage": 1, "pid": 13}]]    # both again
    seen = []

    async def status(request):
        return web.json_response({"stages": tables[len(seen)]})

    async def run():
        import aiohttp
        app = web.Application()
        app.router.add_get("/v1/status", status)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        notes = []
        soak = Soak([], f"http://127.0.0.1:{port}/v1", {}, say=notes.append)
        async with aiohttp.ClientSession() as session:
            for _ in tables:
                await _read_pids(soak, session)
                seen.append((dict(soak.pids), soak.restarts))
        await runner.cleanup()
        return notes

    notes = asyncio.run(run())
    assert seen == [({0: 10, 1: 11}, 0), ({0: 10, 1: 12}, 1), ({0: 10, 1: 12}, 1),
                    ({0: 14, 1: 13}, 3)]
    assert [n.split(" s  ", 1)[1] for n in notes] == [
        "stage 1 restarted: pid 11 -> 12", "stage 0 restarted: pid 10 -> 14",
        "stage 1 restarted: pid 12 -> 13"]


# --- the verdicts ---------------------------------------------------------------------------------

def test_an_answer_is_lost_on_an_error_a_missing_usage_or_an_unfinished_reason():
    assert why_lost(Answer("hi", 2, "stop")) is None
    assert why_lost(Answer("hi", 2, "length")) is None
    assert why_lost(Answer(error="503: stage 1 exited")) == "503: stage 1 exited"
    assert why_lost(Answer("hi", None, "stop")) == "no usage in the answer"
    assert why_lost(Answer("hi", 2, None)) == "finish_reason None"
    assert why_lost(Answer("hi", 2, "abort")) == "finish_reason 'abort'"


def test_answers_under_load_are_compared_with_the_solo_run():
    solo = {0: Answer("The sea is calm", 4, "length"), 1: Answer("Paris.", 2, "stop"),
            2: Answer(error="503: gone")}
    same = output(solo[0])
    assert compare({0: [same, same], 1: [output(solo[1])]}, solo) == []
    # a different text, then the same text with a different token count
    moved = ("The sea is wild", 4, "length")
    longer = ("Paris.", 3, "length")
    bad = compare({0: [same, moved, same, moved], 1: [longer]}, solo)
    assert [(m.index, m.times, m.got, m.at) for m in bad] == [(0, 2, moved, 11),
                                                              (1, 1, longer, 0)]
    assert "2 answer(s) under load differ from its solo run at character 11" in bad[0].sentence()
    assert "'calm'" in bad[0].sentence() and "'wild'" in bad[0].sentence()
    # a solo run that got no answer cannot vouch for anything
    [m] = compare({2: [same]}, solo)
    assert m.solo is None and m.sentence() == "request 2: its solo run got no complete answer"


def test_memory_past_the_tolerance_fails_each_process_and_the_total():
    start = {"server": 200.0, "stage 0": 1000.0, "stage 1": 1000.0}
    assert memory_verdict(start, {"server": 220.0, "stage 0": 1090.0, "stage 1": 900.0},
                          10, 32) == []   # server: +20 under the 32 MiB floor; stage 0: +9%
    bad = memory_verdict(start, {"server": 240.0, "stage 0": 1101.0, "stage 1": 1000.0}, 10, 32)
    assert bad == ["server: 200 MiB -> 240 MiB, 40 MiB more (allowed 32)",
                   "stage 0: 1000 MiB -> 1101 MiB, 101 MiB more (allowed 100)"]
    # each process within its allowance, the total too (2200 -> 2300 of 220 allowed)
    assert memory_verdict(start, {"server": 230.0, "stage 0": 1035.0, "stage 1": 1035.0},
                          10, 32) == []
    # the total is checked on its own: each process within its allowance (32, 100, 100), the
    # total past its 220
    assert memory_verdict(start, {"server": 231.0, "stage 0": 1099.0, "stage 1": 1099.0},
                          10, 32) == ["total: 2200 MiB -> 2429 MiB, 229 MiB more (allowed 220)"]
    bad = memory_verdict(start, {n: v * 1.04 for n, v in start.items()}, 1, 10)
    assert bad == ["stage 0: 1000 MiB -> 1040 MiB, 40 MiB more (allowed 10)",
                   "stage 1: 1000 MiB -> 1040 MiB, 40 MiB more (allowed 10)",
                   "total: 2200 MiB -> 2288 MiB, 88 MiB more (allowed 22)"]
    assert memory_verdict(start, {**start, "stage 1": None}, 10, 32) == [
        "stage 1: no process to measure at end"]
    # a stage missing from the last /v1/status: no process to measure either
    assert memory_verdict(start, {"server": 200.0, "stage 0": 1000.0}, 10, 32) == [
        "stage 1: no process to measure at end"]


# --- whole runs -----------------------------------------------------------------------------------

class SoakRun:
    """`strata-bench soak ARGS` as a child process, started at once; result() waits for it. Its
    stages' run directories lie under a directory of its own, so result() can tell that none of
    its stage processes is left behind (as conftest's no_stage_left does for a test)."""

    def __init__(self, tmp_path: Path, *args: str):
        self.tmp_path = tmp_path
        self.own = tempfile.mkdtemp(prefix="sk", dir="/tmp")   # short: ipc paths <= 107 bytes
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata.bench", "soak", *args, "--log-dir", str(tmp_path),
             "--json-out", str(tmp_path / "soak.json"), "--progress-every", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "TMPDIR": self.own})

    def result(self, timeout: float = 600) -> tuple[int, str, dict]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            self.close()
        deadline = time.monotonic() + 5   # a worker told to shut down may take a moment
        while stage_processes(self.own) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = stage_processes(self.own)
        shutil.rmtree(self.own, ignore_errors=True)
        assert not left, f"stage processes left behind: {left}"
        return self.proc.returncode, out, json.loads((self.tmp_path / "soak.json").read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


TINY = ["--layer-split", "2", "--devices", "cpu", "--ctx-size", "256", "--batch", "4",
        "--batch-groups", "2", "--clients", "8", "--max-tokens", "8", "--distinct-requests", "12"]


@pytest.fixture(scope="module")
def tiny_soaks(varied_model, tmp_path_factory):
    """The tiny model's two whole runs, started together: each spends most of its time waiting
    (on its load's clock, on its server's start and stop), so they share the machine's cores.
    They are separate servers with separate stages: neither sees the other's requests."""
    runs = {
        "no faults": SoakRun(tmp_path_factory.mktemp("soak"), "--model", str(varied_model),
                             *TINY, "--duration", "2.5", "--warmup", "1", "--kill-every", "0",
                             "--stop-for", "0"),
        "a kill": SoakRun(tmp_path_factory.mktemp("soak"), "--model", str(varied_model), *TINY,
                          "--duration", "2.5", "--warmup", "0.5", "--kill-every", "1",
                          "--stop-for", "0", "--no-restart-stages")}
    yield runs
    for run in runs.values():
        run.close()


def test_a_soak_without_faults_passes(tiny_soaks):
    run = tiny_soaks["no faults"]
    code, out, r = run.result()
    assert code == 0, out
    assert r["lost"] == 0 and r["mismatches"] == 0 and r["memory_failures"] == []
    assert r["requests"] == r["completed"] > 24   # every distinct request, sent several times
    assert (r["kills"], r["stops"], r["restarts"]) == (0, 0, 0)
    assert set(r["memory_mib"]) == {"server", "stage 0", "stage 1"}
    assert all(m["start"] and m["end"] and m["pid_start"] == m["pid_end"]
               for m in r["memory_mib"].values())
    assert r["tok_s"] > 0
    assert "strata: serving" in (run.tmp_path / "strata-launch.log").read_text()
    for words in ("# no faults", "warm: server", "0 lost",
                  "# solo runs: 12 distinct requests", "mismatches          0", "total",
                  "soak passed", "server stopped with exit code 0"):
        assert words in out, out


def test_a_killed_stage_without_restarts_loses_requests_and_fails(tiny_soaks):
    code, out, r = tiny_soaks["a kill"].result()
    assert code == 1, out
    assert r["kills"] == 1 and r["faults"][0]["stage"] == 0 and r["faults"][0]["sent"]
    assert r["lost"] > 0 and "stage 0 exited, killed by SIGKILL" in r["lost_samples"][0]
    assert r["restarts"] == 0 and not r["healthy"]
    assert r["memory_failures"] == ["stage 0: no process to measure at end"]
    assert "SIGKILL at 1.5 s (stage 0)" in out and "soak FAILED" in out, out


def _has_restart_stages() -> bool:
    from strata.launch.cli import main
    return any("--restart-stages" in p.opts for p in main.params)


SMOL = ["--layer-split", "15", "--devices", "cpu", "--ctx-size", "512", "--batch", "8",
        "--batch-groups", "2", "--clients", "8", "--duration", "20", "--warmup", "5",
        "--max-tokens", "12", "--distinct-requests", "16"]


@pytest.mark.long   # SmolLM2's stages on CPU: about two minutes on a loaded 2-core machine
@pytest.mark.parametrize("faults", [
    "none",
    pytest.param("kill and stop", marks=pytest.mark.skipif(
        not _has_restart_stages(), reason="needs strata-launch --restart-stages"))])
def test_a_short_soak_of_smollm2(faults, tmp_path, no_stage_left):
    # faults: a stop of stage 1 at 10 s for 4 s (stage timeout 2 s: a hang), a kill of stage
    # 0 at 15 s
    args = ["--kill-every", "0", "--stop-for", "0"] if faults == "none" else \
        ["--kill-every", "10", "--stop-for", "4"]
    code, out, r = SoakRun(tmp_path, *SMOL, *args).result(timeout=900)
    assert code == 0, out
    assert r["lost"] == 0 and r["mismatches"] == 0 and r["memory_failures"] == []
    assert r["completed"] >= 16
    if faults == "none":
        assert (r["kills"], r["stops"], r["restarts"]) == (0, 0, 0)
    else:
        assert (r["kills"], r["stops"]) == (1, 1) and r["restarts"] >= 2, out
        assert {m["pid_start"] != m["pid_end"] for m in r["memory_mib"].values()} == {False, True}


def test_a_server_that_exits_at_start_is_said_so(tiny_model):
    from strata.bench.loadtest import ServerProcess
    server = ServerProcess(["--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                            "--port", "0", "--batch", "0"])
    with pytest.raises(RuntimeError, match="strata-launch exited with code 2 before serving"):
        server.wait_ready(120)
    assert server.stop() == 2
