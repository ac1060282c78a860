"""A stage joining a launch from another host: strata-launch --external-stage 1 --listen
HOST:PORT, and strata-worker --join tcp://HOST:PORT --stage 1 started as a process of its own.

The joined launch gives the tokens of a plain one (varied_model: its greedy text changes with
every token of its context); a join for a stage the launch runs, a second join for a stage and
a wrong model file are refused with a sentence on both sides; a launch nobody joins gives up
after --join-timeout; no process is left. With keys (each host its own copy of the directory)
the tokens are the same, and a launch beyond loopback needs keys or --insecure. Over a gloo
link (--stage-link gloo, its rendezvous hosted by the launcher) the tokens are the same too.
Then two Linux network namespaces joined by a veth pair stand in for two hosts (root only),
with keys, with --insecure, and over a gloo link. The launch's answers, the join sockets and the worker's
own mistakes are tested in-process in test_join_answers.py.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import nullcontext
from pathlib import Path

import pytest

from strata.protocol.join import JoinDesk, address_toward
from test_join_answers import hosts_keys  # noqa: F401 (a fixture)
from test_launch_errors import (LAUNCH, LONG_CTX, assert_no_traceback, assert_one_sentence,
                                launch, launch_in_process, long_tiny)

WORKER = (shutil.which("strata-worker", path=os.path.dirname(sys.executable))
          or shutil.which("strata-worker"))
START_S = 120.0   # a shared 2-core machine
ARGS = ["--layer-split", "2", "--devices", "cpu", "--ctx-size", "64", "--prompt",
        "The lighthouse keeper wrote", "--max-tokens", "12"]


class JoinableLaunch:
    """strata-launch ... --external-stage 1 --listen ADDRESS:0, its stderr read as it comes;
    `endpoint` is where it waits (the command it prints names the port)."""

    def __init__(self, args: list[str], prefix: list[str] = (), address: str = "127.0.0.1"):
        self.lines: list[str] = []
        self.workers: list[subprocess.Popen] = []
        self.proc = subprocess.Popen(
            [*prefix, LAUNCH, *args, "--external-stage", "1", "--listen", f"{address}:0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        try:
            self.endpoint = self.wait_for("strata-worker --join ").split()[2]
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str) -> str:
        """The first stderr line holding text."""
        deadline = time.monotonic() + START_S
        while True:
            exited = self.proc.poll() is not None
            for line in list(self.lines):
                if text in line:
                    return line
            assert not exited and time.monotonic() < deadline, \
                f"no {text!r} on stderr:\n{self.stderr()}"
            time.sleep(0.05)

    def finish(self, timeout: float = START_S) -> str:
        """Its stdout, once it has exited (its stderr is read all along); a launch still
        running after `timeout` fails the test with its stderr and its workers'."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            workers = "\n".join(f"worker {i}:\n{w.stderr.read() if w.stderr else ''}"
                                 for i, w in enumerate(self.workers))
            pytest.fail(f"the launch did not end within {timeout:.0f} s; its stderr:\n"
                        f"{self.stderr()}\n{workers}")
        self.reader.join(timeout=10)
        return self.proc.stdout.read()

    def worker(self, *args: str, prefix: list[str] = (), stderr: Path | None = None
               ) -> subprocess.Popen:
        """strata-worker --join ENDPOINT *args; its stderr a pipe, or the file `stderr`."""
        with open(stderr, "w") if stderr else nullcontext(subprocess.PIPE) as err:
            proc = subprocess.Popen([*prefix, WORKER, "--join", self.endpoint, *args],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err, text=True)
        self.workers.append(proc)
        return proc

    def stderr(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        for p in (self.proc, *self.workers):
            if p.poll() is None:
                p.kill()
            p.wait()


def refused(worker: subprocess.Popen) -> str:
    """The one sentence a worker that could not join says, after its exit code 2."""
    err = worker.stderr.read()
    assert worker.wait(timeout=START_S) == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("strata-worker: stage "), err
    assert_no_traceback(err)
    return lines[0]


@pytest.mark.long   # the default run joins with keys below, the same tokens
def address_beyond_loopback() -> str:
    """This host's address on its default route; the test skips where it has none beyond
    loopback."""
    try:
        address = address_toward("192.0.2.1", 9)
    except OSError:
        pytest.skip("this host has no route beyond loopback")
    if address.startswith("127."):
        pytest.skip("this host has no address beyond loopback")
    return address


@pytest.fixture(scope="module")
def plain_text(varied_model) -> str:
    """What a plain launch of ARGS prints on stdout, the text each joined launch must give."""
    plain = launch(["--model", str(varied_model), *ARGS], None)
    assert plain.returncode == 0, plain.stderr
    assert len(plain.stdout.strip()) > 6
    return plain.stdout


def test_a_joined_stage_gives_the_tokens_of_a_plain_launch(varied_model, plain_text,
                                                          no_stage_left):
    args = ["--model", str(varied_model), *ARGS]
    run = JoinableLaunch(args)
    try:
        assert f"--model {varied_model}" in run.wait_for("strata-worker --join ")
        worker = run.worker("--stage", "1")   # no --model: the launch's path
        out = run.finish()
        assert run.proc.returncode == 0, run.stderr()
        assert worker.wait(timeout=30) == 0, worker.stderr.read()   # the Shutdown reached it
    finally:
        run.close()
    assert out == plain_text
    assert "stage 1 joined from tcp://127.0.0.1:" in run.stderr()
    assert not list(Path(no_stage_left).glob("strata-*"))   # the run directory is removed


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keys"])
def test_a_joined_stage_that_fails_at_start_ends_the_launch_with_its_reason(
        varied_model, hosts_keys, keyed, no_stage_left):
    """The launch cannot see a joined stage's process: the stage tells it why it could not
    start, and the launch ends at once with that sentence (not after the hello timeout),
    over CurveZMQ too."""
    launch_dir, stage_dir = hosts_keys
    security = ["--keys", str(launch_dir)] if keyed else []
    run = JoinableLaunch(["--model", str(varied_model), *ARGS, *security])
    try:
        t0 = time.monotonic()
        worker = run.worker("--stage", "1", *(["--keys", str(stage_dir)] if keyed else []),
                            prefix=["env", "STRATA_FAULT=crash-at-start:1"])
        run.finish(timeout=60)
        took = time.monotonic() - t0
        assert run.proc.returncode == 1, run.stderr()
        assert worker.wait(timeout=30) != 0
    finally:
        run.close()
    said = [line for line in run.stderr().splitlines() if "failed at start" in line]
    assert said and "stage 1 failed at start: RuntimeError: stage 1: crash at start " \
                    "requested by STRATA_FAULT" in said[0], run.stderr()
    assert took < 45, took   # the hello timeout is 300 s
    assert_no_traceback(run.stderr())


def test_a_stage_joined_with_keys_gives_the_tokens_of_a_plain_launch(varied_model, hosts_keys,
                                                                     plain_text, no_stage_left):
    """The launcher's host holds the coordinator's and stage 0's secrets, the joining stage's
    host its own: the stage starts with its own --keys, not the launcher's path."""
    launch_dir, stage_dir = hosts_keys
    args = ["--model", str(varied_model), *ARGS]
    run = JoinableLaunch([*args, "--keys", str(launch_dir)])
    try:
        assert f"--keys {launch_dir}" in run.wait_for("strata-worker --join ")
        worker = run.worker("--stage", "1", "--keys", str(stage_dir))
        out = run.finish()
        assert run.proc.returncode == 0, run.stderr()
        assert worker.wait(timeout=30) == 0
        err = worker.stderr.read()
    finally:
        run.close()
    assert out == plain_text
    started = next(line for line in err.splitlines() if "starting with:" in line)
    assert f"--keys {stage_dir}" in started and str(launch_dir) not in started, started
    assert "has no keys" not in run.stderr() + err   # every socket keyed, the desk's too


def test_a_stage_joined_over_a_gloo_link_gives_the_tokens_of_a_plain_launch(varied_model,
                                                                           plain_text,
                                                                           no_stage_left):
    """--stage-link gloo with --listen: the launcher hosts the link's rendezvous on its
    address and hands it to the joining stage with its other arguments; stage 1 then takes
    its activations over gloo, not as frames (a frame would be refused)."""
    args = ["--model", str(varied_model), *ARGS]
    run = JoinableLaunch([*args, "--stage-link", "gloo"])
    try:
        worker = run.worker("--stage", "1")
        out = run.finish()
        assert run.proc.returncode == 0, run.stderr()
        assert worker.wait(timeout=30) == 0
        err = worker.stderr.read()
    finally:
        run.close()
    assert out == plain_text
    started = next(line for line in err.splitlines() if "starting with:" in line)
    assert "--link gloo --link-init tcp://127.0.0.1:" in started, started
    assert "stage 1: activations over gloo (2 stages)" in err, err


def test_refused_joins_are_said_on_both_sides(varied_model, tiny_model, no_stage_left):
    """While it serves (no --prompt): a join for stage 0, which it runs, and one with another
    model file, both at once; then the right one, then a second for stage 1; SIGTERM stops
    both stages."""
    run = JoinableLaunch(["--model", str(varied_model), "--layer-split", "2", "--devices",
                          "cpu", "--ctx-size", "64", "--port", "0"])
    try:
        for_stage_0 = run.worker("--stage", "0")
        other_model = run.worker("--stage", "1", "--model", str(tiny_model))
        assert "(the launcher runs it); join as stage 1" in refused(for_stage_0)
        wrong = refused(other_model)
        assert f"the model file {tiny_model} is not the launch's" in wrong
        assert "pass --model with a copy of that file" in wrong
        told = run.wait_for("strata-launch: refused a join: stage 1 has a different model")
        assert f"start it with --model and a copy of {varied_model}" in told
        joined = run.worker("--stage", "1")
        run.wait_for("strata: serving ")
        second = refused(run.worker("--stage", "1"))
        assert "stage 1 has already joined this launch (from tcp://127.0.0.1:" in second
        assert "each external stage joins once" in second
        assert run.proc.poll() is None and joined.poll() is None
        run.proc.send_signal(signal.SIGTERM)
        run.proc.wait(timeout=60)
        assert joined.wait(timeout=30) == 0, joined.stderr.read()
    finally:
        run.close()
    assert "every stage has exited" in run.stderr()
    assert_no_traceback(run.stderr())


def test_a_launch_nobody_joins_gives_up_after_the_join_timeout(tiny_model, no_stage_left):
    r = launch(["--model", str(tiny_model), *ARGS, "--external-stage", "1", "--listen",
                "127.0.0.1:0", "--join-timeout", "1"], None)
    assert r.returncode == 1, r.stderr
    # the coordinator's warnings about its open (keyless) tcp endpoints aside
    *waiting, last = [line for line in r.stderr.strip().splitlines() if " WARNING " not in line]
    assert waiting[0].startswith("stage 1 is external: waiting for it to join at tcp://"), waiting
    endpoint = waiting[0].split(" at ")[1].split(";")[0]
    assert waiting[1].strip() == f"strata-worker --join {endpoint} --stage 1 --model {tiny_model}"
    assert last == (f"strata-launch: no stage 1 joined at {endpoint} within 1s; run "
                    f"`{waiting[1].strip()}` on its host, or raise --join-timeout")
    assert not list(Path(no_stage_left).glob("strata-*"))   # nothing ran: nothing is kept


def _generating(run: JoinableLaunch) -> subprocess.Popen:
    """Stage 1 joined and the launch past its hellos, decoding."""
    worker = run.worker("--stage", "1")
    run.wait_for("stage 1: layers [2, 4) on cpu")
    time.sleep(1.0)   # into the decode loop
    assert run.proc.poll() is None and worker.poll() is None, run.stderr()
    return worker


# long_tiny: generation until the stage or the launcher is killed
LONG = ["--layer-split", "2", "--devices", "cpu", "--ctx-size", str(LONG_CTX), "--prompt", "hi",
        "--max-tokens", str(LONG_CTX)]


@pytest.mark.long   # the default run: test_stage_failure's killed stage
def test_a_killed_joined_stage_fails_the_launch_within_5s(long_tiny, no_stage_left):
    run = JoinableLaunch(["--model", str(long_tiny), *LONG])
    try:
        _generating(run).kill()
        t0 = time.monotonic()
        code = run.proc.wait(timeout=30)
        took = time.monotonic() - t0
        run.reader.join(timeout=10)
    finally:
        run.close()
    assert code == 1, run.stderr()
    assert took < 5, f"strata-launch took {took:.1f} s to fail"
    assert "strata-launch: stage 1 has gone (its socket closed)" in run.stderr(), run.stderr()
    assert_no_traceback(run.stderr())


@pytest.mark.long   # the default run: test_stage_failure's stopped stage
def test_a_stopped_joined_stage_is_taken_for_hung_past_the_stage_timeout(long_tiny,
                                                                         no_stage_left):
    """SIGSTOP: the joined stage's sockets stay open; only its unanswered heartbeats tell."""
    run = JoinableLaunch(["--model", str(long_tiny), *LONG, "--stage-timeout", "2"])
    try:
        _generating(run).send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        code = run.proc.wait(timeout=30)
        took = time.monotonic() - t0
        run.reader.join(timeout=10)
    finally:
        run.close()
    assert code == 1, run.stderr()
    assert took < 2 + 3, f"strata-launch took {took:.1f} s to fail"
    assert "strata-launch: stage 1 has not answered for" in run.stderr(), run.stderr()


@pytest.mark.long   # the default run: test_stage_failure's killed launcher
def test_a_joined_stage_leaves_when_the_launcher_is_killed(long_tiny, no_stage_left):
    run = JoinableLaunch(["--model", str(long_tiny), *LONG])
    try:
        worker = _generating(run)
        run.proc.kill()
        code = worker.wait(timeout=10)   # its socket to the coordinator closed
        err = worker.stderr.read()
    finally:
        run.close()
    assert code == 0, err
    assert "the coordinator has gone (its socket closed): exiting" in err, err


def test_a_joined_stage_leaves_when_the_launcher_is_killed_before_the_others_join(
        varied_model, tmp_path, no_stage_left):
    """Stages 1 and 2 external: stage 2 joins and starts, stage 1 never comes, the launcher is
    killed; stage 2, connected to the coordinator's inbox, sees it go and leaves."""
    run = JoinableLaunch(["--model", str(varied_model), "--layer-split", "1,2", "--devices",
                          "cpu", "--ctx-size", "64", "--prompt", "hi", "--external-stage", "2"])
    log = tmp_path / "stage2.log"
    try:
        worker = run.worker("--stage", "2", stderr=log)
        run.wait_for("stage 2 joined from tcp://127.0.0.1:")
        deadline = time.monotonic() + START_S
        while "INFO stage 2: layers [2, 4)" not in log.read_text():
            assert time.monotonic() < deadline and worker.poll() is None, log.read_text()
            time.sleep(0.1)
        time.sleep(1.0)   # its hello sent, its socket to the inbox connected
        run.proc.kill()
        code = worker.wait(timeout=10)
    finally:
        run.close()
    assert code == 0, log.read_text()
    assert "the coordinator has gone (its socket closed): exiting" in log.read_text()


MISTAKES = {   # strata-launch arguments after the tiny model's ARGS -> words of the sentence
    "listen-without-external": (["--listen", "127.0.0.1:0"],
                                ["--listen waits for external stages", "add --external-stage K"]),
    "listen-not-host-port": (["--external-stage", "1", "--listen", "127.0.0.1"],
                             ["--listen '127.0.0.1' is not HOST:PORT"]),
    "listen-everywhere": (["--external-stage", "1", "--listen", "0.0.0.0:7600"],
                          ["does not say where other hosts reach this one"]),
    "listen-elsewhere": (["--external-stage", "1", "--listen", "192.0.2.1:7600"],  # TEST-NET-1
                         ["192.0.2.1 is not an address of this host"]),
    "link-with-keys": (["--external-stage", "1", "--listen", "127.0.0.1:0", "--stage-link",
                        "gloo", "--keys", "k"],
                       ["--stage-link gloo sends activations between hosts through "
                        "torch.distributed", "use --stage-link zmq (or auto) with --keys"]),
    "insecure-without-listen": (["--insecure"], ["--insecure lets a launch that others join",
                                                 "there is no --listen; leave it out"]),
    "insecure-with-keys": (["--external-stage", "1", "--listen", "127.0.0.1:0", "--keys", "k",
                            "--insecure"], ["--insecure opens the tcp endpoints that --keys",
                                            "give one of them"]),
    "join-timeout-without-listen": (["--join-timeout", "5"], ["add --listen HOST:PORT"]),
    "join-timeout-zero": (["--external-stage", "1", "--listen", "127.0.0.1:0",
                           "--join-timeout", "0"], ["--join-timeout 0 is no duration"]),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_launch_mistake_gets_one_sentence(case, tiny_model, no_stage_left):
    """In-process (test_launch_errors runs such mistakes as the console script does)."""
    args, words = MISTAKES[case]
    r = launch_in_process(["--model", str(tiny_model), *ARGS, *args])
    assert r.returncode == 2, r.stderr
    assert_one_sentence(r.stderr, *words)


@pytest.mark.parametrize("link", ["auto", "gloo"])
def test_a_launch_joined_beyond_loopback_needs_keys_or_insecure(link, tiny_model,
                                                                no_stage_left):
    """gloo: torch.distributed has no keys, so only --insecure (or --stage-link zmq)."""
    address = address_beyond_loopback()
    r = launch_in_process(["--model", str(tiny_model), *ARGS, "--external-stage", "1",
                           "--listen", f"{address}:0", "--stage-link", link])
    assert r.returncode == 2, r.stderr
    if link == "auto":
        assert_one_sentence(r.stderr, f"--listen {address} would take windows from any host",
                            "give --keys DIR", "--insecure")
    else:
        assert_one_sentence(r.stderr, f"--listen {address} with --stage-link gloo would take "
                            f"windows and activations from any host", "give --insecure",
                            "use --stage-link zmq (or auto) with --keys DIR")


def test_a_taken_listen_port_gets_one_sentence(tiny_model, no_stage_left):
    desk = JoinDesk("tcp://127.0.0.1:0", lambda msg: msg)
    try:
        taken = desk.endpoint.rsplit(":", 1)[1]
        r = launch(["--model", str(tiny_model), *ARGS, "--external-stage", "1", "--listen",
                    f"127.0.0.1:{taken}"], None, timeout=60)
    finally:
        desk.close()
    assert r.returncode == 2, r.stderr
    assert_one_sentence(r.stderr, f"cannot listen on tcp://127.0.0.1:{taken}",
                        "choose another --listen port")


# --- two hosts: network namespaces joined by a veth pair ---------------------------------------

def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces, a veth pair between them with 10.231.0.1 (launch) and
    10.231.0.2 (worker), each with its loopback; deleted afterwards (with the pair)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = uuid.uuid4().hex[:6]
    hosts = [f"strata-a-{tag}", f"strata-b-{tag}"]
    made = []
    try:
        for ns in hosts:
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", f"sa{tag}", "netns", hosts[0], "type", "veth", "peer", "name",
            f"sb{tag}", "netns", hosts[1])
        for ns, dev, address in ((hosts[0], f"sa{tag}", "10.231.0.1/24"),
                                 (hosts[1], f"sb{tag}", "10.231.0.2/24")):
            _ip("-n", ns, "addr", "add", address, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield [["ip", "netns", "exec", ns] for ns in hosts]
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.mark.parametrize("security", ["keys", pytest.param("insecure", marks=pytest.mark.long),
                                      "gloo"])
def test_a_stage_joins_from_another_network_namespace(varied_model, two_hosts, hosts_keys,
                                                      security, plain_text, no_stage_left):
    """The launch and its stage 0 in one namespace, stage 1 in the other: the tokens of a
    plain launch, the activations and results over the veth pair, with each host's keys or,
    without, --insecure on both sides (a bind beyond loopback needs one of them); gloo: the
    activations over a gloo link (--insecure: it has no keys), its rendezvous on the
    launcher's address, each stage's gloo bound to its own address on the pair."""
    launcher_host, worker_host = two_hosts
    args = ["--model", str(varied_model), *ARGS]
    launch_dir, stage_dir = hosts_keys
    mine, its = ((["--keys", str(launch_dir)], ["--keys", str(stage_dir)]) if security == "keys"
                 else (["--insecure"], ["--insecure"]))
    if security == "gloo":
        mine += ["--stage-link", "gloo"]
    run = JoinableLaunch([*args, *mine], prefix=launcher_host, address="10.231.0.1")
    try:
        assert run.endpoint.startswith("tcp://10.231.0.1:")
        worker = run.worker("--stage", "1", *its, prefix=worker_host)
        out = run.finish()
        assert run.proc.returncode == 0, run.stderr()
        assert worker.wait(timeout=30) == 0
        err = worker.stderr.read()
    finally:
        run.close()
    assert "stage 1 joined from tcp://10.231.0.2:" in run.stderr()
    assert out == plain_text
    assert ("has no keys" in run.stderr()) == (security != "keys")
    if security == "gloo":
        assert "link rendezvous at 10.231.0.1:" in err and "this stage at 10.231.0.2" in err, err
        assert "stage 1: activations over gloo (2 stages)" in err, err
