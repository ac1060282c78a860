"""A stage that dies or hangs, and a coordinator that dies, on real CPU launches of the tiny
random model (conftest's tiny_model: what is tested is the processes, sockets and messages,
which are the same for any model, and its stages are up in a fraction of SmolLM2's time).

A stage killed (SIGKILL) mid-generation, spawned or started by hand (--external-stage): every
request in flight fails within 5 s with a sentence naming the stage (a 503, or an SSE error
event then the end of the stream), /health says which stage, new requests get a 503, and
strata-launch exits 1 with the sentence and leaves no process. A stage stopped (SIGSTOP): the
same, past --stage-timeout. A stage sent SIGUSR1 writes its threads' stacks to its log and
goes on serving. The launcher killed: every stage exits within a few seconds, the
one started by hand included (its socket to the coordinator closed). Then the parts: the
default stage timeout, heartbeats of a busy stage, a lost window, a heartbeat that waits for
the device, and a socket's peer going.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from strata.bench.loadtest import ServerProcess
from strata.coordinator.stages.liveness import FIRST_S, FLOOR_S, HEARTBEAT_S, MARGIN_S, Liveness
from strata.protocol import transport, unixsock
from strata.protocol.messages import Heartbeat
from strata.protocol.peers import PeerWatch
from test_launch_errors import (alive, assert_no_traceback, assert_one_sentence, children,
                                launch, wait_gone)

START_S = 240.0   # a shared 2-core machine: stages may take a while to start
TOKENS = 1800     # enough to be mid-generation when the stage goes (a few seconds on CPU)


def _split(model: Path) -> list[str]:
    return ["--model", str(model), "--layer-split", "2", "--ctx-size", "2048"]


# --- an HTTP server whose stage dies or hangs ---------------------------------------------------

def _post(url: str, body: dict, timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _health(root: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(root + "/health", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stream_events(url: str, body: dict, started: threading.Event) -> list[str]:
    """The data lines of a streamed completion, as they come; `started` is set at the first."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                started.set()
    return events


def _fail_mid_generation(model: Path, tmp_path: Path, sig: int, extra: list[str],
                         bound: float, *words: str) -> None:
    """Serve with 2 slots, one request streaming and one whole; send `sig` to stage 1 once
    both generate; both must fail within `bound` seconds with a sentence holding `words`."""
    server = ServerProcess([*_split(model), "--batch", "2", "--port", "0", "--log-dir",
                            str(tmp_path), *extra])
    try:
        url = server.wait_ready(START_S)
        root = url.removesuffix("/v1")
        stage1 = json.loads(urllib.request.urlopen(url + "/status").read())["stages"][1]["pid"]
        body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": TOKENS}
        started = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(_stream_events, url + "/completions", body, started)
            whole = pool.submit(_post, url + "/completions", body)
            assert started.wait(60), server.stderr()
            time.sleep(0.3)   # both requests decode
            os.kill(stage1, sig)
            t0 = time.monotonic()
            events, (status, raw) = stream.result(60), whole.result(60)
            took = time.monotonic() - t0
        assert took < bound, f"the requests failed {took:.1f} s after the stage went"
        # the stream: tokens, then one error event, then the end
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "unavailable" and all(w in error["message"] for w in words)
        assert all("choices" in json.loads(e) for e in events[:-2])
        # the whole request: a 503 with the sentence
        assert status == 503, raw
        assert all(w in json.loads(raw)["error"]["message"] for w in words), raw
        code, health = _health(root)
        assert code == 503 and all(w in health["error"] for w in words), health
        status, raw = _post(url + "/completions", {**body, "max_tokens": 2})
        message = json.loads(raw)["error"]["message"]
        assert status == 503 and all(w in message for w in words), raw
        assert "restart strata-launch" in message
    finally:
        t0 = time.monotonic()
        code = server.stop(signal.SIGTERM)
        stopped = time.monotonic() - t0
    stderr = server.stderr()
    assert code == 1, stderr
    assert f"strata-launch: the stages stopped serving: {words[0]}" in stderr, stderr
    assert_no_traceback(stderr)
    assert stopped < 5, f"strata-launch took {stopped:.1f} s to stop"


def test_a_killed_stage_fails_every_request_within_5s(tiny_model, tmp_path, no_stage_left):
    _fail_mid_generation(tiny_model, tmp_path, signal.SIGKILL, [], 5.0,
                         "stage 1 exited, killed by SIGKILL", "stage1.log")


def test_a_stopped_stage_is_taken_for_hung_past_the_stage_timeout(tiny_model, tmp_path,
                                                                  no_stage_left):
    # SIGSTOP: the process lives and holds its sockets; only its silence tells
    _fail_mid_generation(tiny_model, tmp_path, signal.SIGSTOP, ["--stage-timeout", "2"], 2.0 + 3.0,
                         "stage 1 has not answered for", "--stage-timeout")


def test_a_stage_sent_sigusr1_writes_its_stacks_to_its_log_and_goes_on(tiny_model, tmp_path,
                                                                    no_stage_left):
    server = ServerProcess([*_split(tiny_model), "--batch", "2", "--port", "0", "--log-dir",
                            str(tmp_path)])
    try:
        url = server.wait_ready(START_S)
        stage1 = json.loads(urllib.request.urlopen(url + "/status").read())["stages"][1]["pid"]
        os.kill(stage1, signal.SIGUSR1)
        log = tmp_path / "stage1.log"
        deadline = time.monotonic() + 30
        while "in _run_module_as_main" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        stacks = log.read_text()
        assert "Current thread" in stacks and 'worker.py", line' in stacks, stacks
        status, raw = _post(url + "/completions", {"model": server.model,
                                                   "prompt": "Once upon a time", "max_tokens": 4})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4, raw
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.stderr()


# --- a stage started by hand, and the launcher killed -------------------------------------------

class ExternalLaunch:
    """strata-launch --external-stage 1 --prompt, and stage 1 started by hand from the command
    it prints: a process of its own session, which no parent's death signal reaches."""

    def __init__(self, model: Path, log_dir: Path):
        self.log_dir = log_dir
        self.lines: list[str] = []
        self.command = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata.launch.cli", *_split(model), "--external-stage", "1",
             "--prompt", "Once upon a time", "--max-tokens", str(TOKENS), "--log-dir",
             str(log_dir)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.worker: subprocess.Popen | None = None

    def start_worker(self) -> None:
        assert self.command.wait(START_S), self.stderr()
        argv = self.printed.split()
        assert argv[0] == "strata-worker", self.printed
        with open(self.log_dir / "stage1.log", "w") as log:
            self.worker = subprocess.Popen(
                [sys.executable, "-m", "strata.stage_worker", *argv[1:]], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("  strata-worker "):
                self.printed = line.strip()
                self.command.set()

    def wait_generating(self) -> None:
        self.start_worker()
        started = time.monotonic()
        while not any(line.startswith("stage 1: layers") for line in self.lines):
            assert time.monotonic() - started < START_S, self.stderr()
            assert self.proc.poll() is None, self.stderr()
            time.sleep(0.1)
        time.sleep(0.5)   # into the decode loop
        assert self.proc.poll() is None and self.worker.poll() is None, self.stderr()

    def stderr(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        for p in (self.proc, self.worker):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.wait()


@pytest.mark.long   # the default run kills a spawned stage, and the launcher under an external one
def test_a_killed_external_stage_fails_the_launch_within_5s(tiny_model, tmp_path,
                                                            no_stage_left):
    run = ExternalLaunch(tiny_model, tmp_path)
    try:
        run.wait_generating()
        run.worker.kill()   # not the launcher's child: only its socket tells
        t0 = time.monotonic()
        code = run.proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        run.close()
    assert code == 1, run.stderr()
    assert took < 5, f"strata-launch took {took:.1f} s to fail"
    assert "strata-launch: stage 1 has gone (its socket closed)" in run.stderr(), run.stderr()
    assert_no_traceback(run.stderr())


def test_a_killed_launcher_takes_every_stage_down_the_external_one_too(tiny_model, tmp_path,
                                                                        no_stage_left):
    run = ExternalLaunch(tiny_model, tmp_path)
    stages = []
    try:
        run.wait_generating()
        stages = [*children(run.proc.pid), run.worker.pid]   # stage 0 is the launcher's child
        assert len(stages) == 2, stages
        run.proc.kill()
        run.proc.wait()
        left = wait_gone(stages, 5.0)   # stage 0: its death signal; stage 1: its socket
        log = (tmp_path / "stage1.log").read_text()
    finally:
        for pid in stages:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        run.close()
    assert left == [], f"stages {left} outlived the killed launcher"
    assert "the coordinator has gone (its socket closed): exiting" in log, log


# --- the parts ----------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def stage_socket():
    """A stage's input (a Unix PULL socket) and a PUSH socket to it, as the coordinator holds."""
    run = tempfile.mkdtemp(prefix="stl", dir="/tmp")
    pull = unixsock.UnixPull(f"unix://{run}/s0")
    push = unixsock.UnixPush(f"unix://{run}/s0")
    yield pull, push
    push.close()
    pull.close()
    os.rmdir(run)


def _answer(pull, stage: int = 0) -> Heartbeat:
    assert pull.poll(2000)
    msg, _ = transport.recv(pull)
    assert isinstance(msg, Heartbeat) and msg.stage == -1
    return Heartbeat(msg.seq, stage)


def test_the_default_stage_timeout_follows_the_slowest_window():
    clock = Clock()
    live = Liveness(clock=clock)
    assert live.timeout == FIRST_S   # no window back yet: the first ones compile and read
    live.submitted(1)
    clock.now += 30.0                # a long prompt chunk
    live.returned(1, result=True)
    assert live.timeout == 2 * 30.0 + MARGIN_S
    live.submitted(2)
    clock.now += 60.0
    live.returned(2, result=False)   # a stage's Error: its time does not count
    assert live.timeout == 2 * 30.0 + MARGIN_S
    assert Liveness(3.5).timeout == 3.5


def test_a_decode_window_of_rows_not_seen_before_gets_the_first_windows_timeout():
    """A decode window of a row count no window has come back with may compile its tiles'
    kernels and capture a graph: FIRST_S while it is in flight, the slowest window's rule once
    it is back, and then for more windows of that count; prompt chunks and a fixed
    --stage-timeout get no such grace."""
    clock = Clock()
    live = Liveness(clock=clock)
    live.submitted(1, 8)
    clock.now += 1.0
    live.returned(1, result=True)
    assert live.timeout == FLOOR_S
    live.submitted(2, 32)              # 32 rows: not seen yet
    assert live.timeout == FIRST_S
    live.submitted(3, 8)               # beside it, one of a count seen: still in the grace
    clock.now += 1.0
    live.returned(3, result=True)
    assert live.timeout == FIRST_S
    live.returned(2, result=False)     # a stage's Error: the count stays unseen
    assert live.timeout == FLOOR_S
    live.submitted(4, 32)
    assert live.timeout == FIRST_S
    clock.now += 4.0
    live.returned(4, result=True)
    live.submitted(5, 32)
    assert live.timeout == 2 * 4.0 + MARGIN_S
    live.submitted(6)                  # a prompt chunk of any length
    assert live.timeout == 2 * 4.0 + MARGIN_S
    fixed = Liveness(3.5, clock=clock)
    fixed.submitted(1, 64)
    assert fixed.timeout == 3.5


def test_a_first_window_longer_than_the_floor_is_no_hang(stage_socket):
    """A stage busy with the launch's first window (a long prompt chunk on a slow device)
    answers no heartbeat for 30 s: not a hang before any window has come back; afterwards,
    silence past twice the slowest window plus the margin is."""
    pull, push = stage_socket
    clock = Clock()
    live = Liveness(clock=clock)
    live.add(0, push)
    live.ask()
    live.submitted(1)
    _answer(pull)              # asked; the stage computes window 1 and cannot answer
    clock.now += 30.0
    assert live.overdue() is None
    live.returned(1, result=True)
    assert live.timeout == max(FLOOR_S, 2 * 30.0 + MARGIN_S)
    clock.now += live.timeout + 1.0
    assert live.overdue().startswith("stage 0 has not answered for")


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan")])
def test_a_stage_timeout_that_is_no_duration_is_refused(value):
    with pytest.raises(ValueError, match="is not a positive number of seconds"):
        Liveness(value)


def test_strata_launch_names_the_flag_of_a_bad_stage_timeout(no_stage_left):
    r = launch(["--stage-timeout", "0", "--prompt", "hi"], None)
    assert r.returncode == 2, r.stderr
    assert_one_sentence(r.stderr, "--stage-timeout 0 is not a positive number of seconds")


def test_a_stage_that_answers_late_is_busy_and_one_that_never_answers_hangs(stage_socket):
    pull, push = stage_socket
    clock = Clock()
    live = Liveness(4.0, clock=clock)
    live.add(0, push)
    live.ask()
    live.ask()   # one question at a time: nothing more until it is answered
    answer = _answer(pull)
    assert not pull.poll(100)
    clock.now += 3.9   # a long window: the answer comes late, but within the timeout
    assert live.overdue() is None
    live.heard(answer)
    clock.now += HEARTBEAT_S
    live.ask()
    _answer(pull)      # asked again; this one is never answered
    clock.now += 4.0
    assert live.overdue() is None
    clock.now += 0.1
    why = live.overdue()
    assert why.startswith("stage 0 has not answered for 4.1 s, past the stage timeout of 4.0 s"), \
        why


def test_a_window_lost_by_a_stage_that_answers_is_named(stage_socket):
    pull, push = stage_socket
    clock = Clock()
    live = Liveness(2.0, clock=clock)
    live.add(0, push)
    live.submitted(7)
    for _ in range(6):   # the stage answers every heartbeat; window 7 never comes
        live.ask()
        live.heard(_answer(pull))
        clock.now += HEARTBEAT_S
    why = live.overdue()
    assert why.startswith("window 7 has not come back in 3.0 s"), why
    assert "every stage answers its heartbeats" in why


def test_a_stage_whose_socket_closes_has_gone_at_once(stage_socket):
    pull, push = stage_socket
    live = Liveness(60.0)
    live.add(1, push)
    live.ask()
    _answer(pull)
    assert live.overdue() is None   # alive, not answering yet: within the timeout
    pull.close()                    # what the kernel does when the stage's process dies
    assert live.overdue().startswith("stage 1 has gone (its socket closed)")


def test_a_stage_answers_a_heartbeat_only_once_its_device_is_past_the_windows(tiny_model):
    """A CUDA stage keeps a greedy window's answer until its device is done (PendingAnswer):
    a heartbeat that comes meanwhile waits for the device, so a device that never finishes
    leaves it unanswered. The order, on a CPU stage given such an answer in hand."""
    from inprocess import in_process_worker
    from strata.stage_worker.last_stage import PendingAnswer

    class Busy:   # a device event not reached yet
        def query(self) -> bool:
            return False

    answered = []
    with in_process_worker(tiny_model, layer_end=4, slots=1, ctx=64) as stage:
        pending = stage.worker.last.pending = PendingAnswer(None, 0.0, None, done=Busy())
        stage.worker.last._answer = answered.append   # its Result (it waits for the device)
        stage.send(transport.pack(Heartbeat(5)))
        stage.step()
        assert answered == [pending]   # before the heartbeat's answer is sent
        (answer,) = stage.answers(1)
    assert answer == Heartbeat(5, 0) and stage.worker.last.pending is None


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_a_push_socket_tells_when_its_peer_has_gone(scheme, tmp_path):
    sockets = transport.Sockets()
    endpoint = f"{scheme}://{tmp_path}/inbox"
    pull = sockets.pull(endpoint)
    push = sockets.push(endpoint)
    watch = PeerWatch(push)
    try:
        transport.send(push, Heartbeat(1, 0))
        assert pull.poll(2000)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:   # a peer that only does not read is there
            assert not watch.gone()
            time.sleep(0.1)
        pull.close(linger=0)
        deadline = time.monotonic() + 5.0
        while not watch.gone():
            assert time.monotonic() < deadline, "the closed peer was not noticed"
            time.sleep(0.05)
    finally:
        watch.close()
        sockets.close(linger_ms=0)
