"""CurveZMQ keys (protocol/keys.py, strata-keys) and what the sockets do with them and without:
a peer without a trusted key can neither send a stage a window nor read what a stage sends;
TCP without keys is refused beyond loopback and warned about; Unix and ipc sockets live in
private directories."""
from __future__ import annotations

import logging
import shutil
import socket
import stat
import time
from pathlib import Path

import pytest
import torch
import zmq
from click.testing import CliRunner

from strata.coordinator.stages.pipeline import Expect, Pipeline, PipelineError
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.windows import build_window, prompt_chunks
from strata.protocol import transport
from strata.protocol.keys import COORDINATOR, CurveKeys, KeysError, main as keys_main, make_keys
from strata.protocol.messages import Window
from strata.stage_worker import main as worker_main
from strata.stage_worker.worker import StageWorker, WorkerConfig

CTX = 64
GREEDY = SamplingParams(temperature=0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def keys_dir(tmp_path) -> Path:
    """Pairs for the coordinator and two stages."""
    make_keys(tmp_path / "keys", [COORDINATOR, "stage0", "stage1"])
    return tmp_path / "keys"


@pytest.fixture
def stranger(tmp_path, keys_dir) -> Path:
    """Another directory with the launch's public keys but a stage0 pair of its own: a peer
    that knows whom it talks to but holds a key the launch never made."""
    other = tmp_path / "other"
    make_keys(other, ["stage0"])
    for name in (COORDINATOR, "stage1"):
        shutil.copy(keys_dir / f"{name}.key", other)
    return other


def window(window_id: int = 1) -> Window:
    """A prompt chunk for slot 0 that samples one token."""
    (rows,) = prompt_chunks(0, [1, 2, 3], 0, 8, GREEDY)
    return build_window(window_id, rows, 8, [(0, 0)], chunk=True)


def arrives(sock, ms: int = 1000) -> bool:
    return bool(sock.poll(ms))


# --- strata-keys ---

def test_strata_keys_makes_private_pairs(tmp_path):
    out = tmp_path / "k"
    r = CliRunner().invoke(keys_main, [str(out), "--stages", "2", "--name", "extra"])
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    names = ["coordinator", "stage0", "stage1", "extra"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{n}.key" for n in names] + [f"{n}.key_secret" for n in names])
    for n in names:
        assert stat.S_IMODE((out / f"{n}.key_secret").stat().st_mode) == 0o600
        keys = CurveKeys.load(out, n)
        assert keys.peer(n) == keys.public and len(keys.secret) == 40
    assert len(CurveKeys.load(out, "stage0").trusted) == 4


def test_strata_keys_says_what_to_change(tmp_path):
    file = tmp_path / "f"
    file.write_text("")
    r = CliRunner().invoke(keys_main, [str(file / "k"), "--name", "a"])
    assert r.exit_code == 2 and "cannot write keys into" in r.output
    assert "name a directory you can create and write" in r.output
    CliRunner().invoke(keys_main, [str(tmp_path / "k"), "--name", "a"])
    r = CliRunner().invoke(keys_main, [str(tmp_path / "k"), "--name", "a"])
    assert r.exit_code == 2 and "already exists" in r.output   # a pair is never overwritten
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    r = CliRunner().invoke(keys_main, [str(open_dir), "--name", "a"])
    assert r.exit_code == 2 and f"chmod 700 {open_dir}" in r.output
    assert CliRunner().invoke(keys_main, [str(tmp_path / "none")]).exit_code == 2


def test_load_refuses_keys_others_can_read_or_add_to(keys_dir):
    with pytest.raises(KeysError, match="stage7.key_secret is missing"):
        CurveKeys.load(keys_dir, "stage7")
    (keys_dir / "stage0.key_secret").chmod(0o644)
    with pytest.raises(KeysError, match="chmod 600"):
        CurveKeys.load(keys_dir, "stage0")
    keys_dir.chmod(0o777)
    with pytest.raises(KeysError, match="chmod 700"):
        CurveKeys.load(keys_dir, "stage1")


# --- the sockets ---

def test_only_a_trusted_key_gets_a_message_in(keys_dir, stranger):
    server = transport.Sockets(CurveKeys.load(keys_dir, COORDINATOR))
    plain = transport.Sockets()
    wrong = transport.Sockets(CurveKeys.load(stranger, "stage0"))
    right = transport.Sockets(CurveKeys.load(keys_dir, "stage0"))
    try:
        endpoint = tcp()
        inbox = server.pull(endpoint)
        transport.send(plain.push(endpoint), window(1))           # no keys at all
        transport.send(wrong.push(endpoint, peer=COORDINATOR), window(2))  # a key not made here
        assert not arrives(inbox)
        assert server.refused >= 1
        transport.send(right.push(endpoint, peer=COORDINATOR), window(3))
        assert arrives(inbox, 5000)
        msg, _ = transport.recv(inbox)
        assert msg.id == 3 and not arrives(inbox, 200)
    finally:
        for s in (plain, wrong, right, server):
            s.close(linger_ms=0)


def send_or_block(sock, msg, tensors=()) -> None:
    """Send, or give up after a second: once a CURVE handshake has failed, ZeroMQ may keep
    no queue for that peer and a send waits for one (a stage waits so for a next stage that
    cannot prove its key, as for one that stopped reading)."""
    sock.sndtimeo = 1000
    try:
        transport.send(sock, msg, tensors)
    except transport.TransportError:
        pass


def test_a_keyed_push_sends_nothing_to_an_impostor(keys_dir, stranger):
    """What a stage sends (activations, results) goes only to the holder of its peer's secret:
    neither a plain listener nor one with another key pair at that endpoint reads it."""
    sender = transport.Sockets(CurveKeys.load(keys_dir, "stage0"))
    ctx = zmq.Context()
    impostors = [ctx.socket(zmq.PULL) for _ in range(2)]
    curve = CurveKeys.load(stranger, "stage0")   # a CURVE server, but not stage1's key
    curve.serve(impostors[1])
    try:
        for sock in impostors:
            endpoint = tcp()
            sock.bind(endpoint)
            send_or_block(sender.push(endpoint, peer="stage1"), window(),
                          [torch.ones(8, 4).numpy()])
            assert not arrives(sock)
    finally:
        sender.close(linger_ms=0)
        for sock in impostors:
            sock.close(linger=0)
        ctx.term()


@pytest.fixture
def keyed_stage(tiny_model, keys_dir):
    """The tiny model as one stage in this process over TCP with keys, and the coordinator's
    Pipeline with keys, hellos exchanged."""
    listen, inbox = tcp(), tcp()
    worker = StageWorker(WorkerConfig(model=str(tiny_model), stage=0, layer_start=0, layer_end=4,
                                      listen=listen, coordinator=inbox, next=None, ctx=CTX,
                                      keys=str(keys_dir)))
    pipe = Pipeline(inbox, listen, keys=CurveKeys.load(keys_dir, COORDINATOR))
    try:
        transport.send(worker.to_coordinator, worker.hello())
        pipe.wait_for_hellos([Expect(0, 0, 4, worker.fingerprint, 1, CTX)], timeout=5)
        yield worker, pipe, listen
    finally:
        pipe.close()
        worker.close()


def test_a_stage_acts_only_on_windows_from_trusted_keys(keyed_stage):
    worker, pipe, listen = keyed_stage
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.PUSH)
    stranger.connect(listen)
    send_or_block(stranger, window(1))
    try:
        assert not arrives(worker.inbox)   # never reaches the stage's socket
        assert worker.cache.filled[0] == 0
        pipe.submit(window(2))
        with torch.inference_mode():
            assert worker.step()
        result, _ = pipe.receive(timeout=10)   # the trusted window is computed and answered
        assert result.id == 2 and len(result.tokens) == 1
        assert worker.cache.filled[0] == 3
    finally:
        stranger.close(linger=0)
        ctx.term()


def test_a_stage_with_a_wrong_key_cannot_join(tiny_model, keys_dir, stranger):
    listen, inbox = tcp(), tcp()
    pipe = Pipeline(inbox, listen, keys=CurveKeys.load(keys_dir, COORDINATOR))
    worker = StageWorker(WorkerConfig(model=str(tiny_model), stage=0, layer_start=0, layer_end=4,
                                      listen=listen, coordinator=inbox, next=None, ctx=CTX,
                                      keys=str(stranger)))
    try:
        send_or_block(worker.to_coordinator, worker.hello())
        with pytest.raises(PipelineError, match="refused 1 peer"):
            pipe.wait_for_hellos([Expect(0, 0, 4, worker.fingerprint, 1, CTX)], timeout=2)
        # the stage sees its key refused, not a coordinator gone (what it says, exiting)
        deadline = time.monotonic() + 5
        while not worker.coordinator.gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.coordinator.gone() and worker.coordinator.refused
    finally:
        worker.close()
        pipe.close()


# --- without keys ---

def test_tcp_without_keys_is_refused_beyond_loopback(caplog):
    port = free_port()
    sockets = transport.Sockets()
    try:
        with pytest.raises(transport.OpenEndpointError, match="--keys DIR"):
            sockets.pull(f"tcp://0.0.0.0:{port}")
        with caplog.at_level(logging.WARNING, logger="strata.transport"):
            sockets.pull(f"tcp://127.0.0.1:{port}")
        assert "has no keys" in caplog.text
    finally:
        sockets.close(linger_ms=0)
    insecure = transport.Sockets(insecure=True)
    try:
        insecure.pull(f"tcp://*:{free_port()}")
    finally:
        insecure.close(linger_ms=0)


def test_strata_worker_refuses_an_open_tcp_listen_before_loading(tiny_model):
    r = CliRunner().invoke(worker_main.main, [
        "--model", str(tiny_model), "--stage", "0", "--layers", "0:4",
        "--listen", f"tcp://0.0.0.0:{free_port()}", "--coordinator", tcp()])
    assert r.exit_code == 2
    assert "would take windows from any host" in r.output and "--insecure" in r.output


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_a_socket_in_a_directory_open_to_others_is_warned_about(tmp_path, caplog, scheme):
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir()
    shared.chmod(0o755)
    sockets = transport.Sockets()
    try:
        with caplog.at_level(logging.WARNING, logger="strata.transport"):
            sockets.pull(f"{scheme}://{private}/in")
            assert not caplog.records
            sockets.pull(f"{scheme}://{shared}/in")
        assert "mode 755" in caplog.text and "mode 700" in caplog.text
    finally:
        sockets.close(linger_ms=0)


def test_a_launch_keeps_its_sockets_in_a_private_directory(_tiny_stages):
    _, run = _tiny_stages
    run_dir = run.procs.run_dir
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for endpoint in [run.procs.endpoints.inbox, *run.procs.endpoints.stages]:
        assert Path(endpoint.split("://", 1)[1]).parent == run_dir
