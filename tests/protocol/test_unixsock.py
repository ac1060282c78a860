"""The same-host transport (protocol/unixsock.py): ZeroMQ's PUSH/PULL contract as strata uses
it. Messages whole and in order per sender, fan-in, large frames, a sender before its
receiver binds, sends that wait for a busy or absent peer only at the high-water mark
(test_protocol_defects.py), and strata's own messages through transport.send / recv on either
kind of endpoint."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from strata.protocol import transport, unixsock
from strata.protocol.messages import Result


@pytest.fixture
def endpoint(tmp_path):
    return f"unix://{tmp_path}/in"


def test_frames_whole_in_order_and_fan_in(endpoint):
    pull = unixsock.UnixPull(endpoint)
    a, b = unixsock.UnixPush(endpoint), unixsock.UnixPush(endpoint)
    for i in range(50):
        a.send_multipart([b"a", str(i).encode()])
        b.send_multipart([b"b", str(i).encode(), b""])
    got = {"a": [], "b": []}
    for _ in range(100):
        frames = pull.recv_multipart()
        got[bytes(frames[0]).decode()].append(int(bytes(frames[1])))
        assert len(frames) == (2 if bytes(frames[0]) == b"a" else 3)
    assert got == {"a": list(range(50)), "b": list(range(50))}
    assert not pull.poll(0)
    for s in (a, b, pull):
        s.close(linger=100)


def test_large_frames_and_a_busy_receiver(endpoint):
    """8 MB frames: more than the kernel takes at once, so the sender thread finishes them
    while the caller goes on; the receiver reads them later, intact and in order."""
    pull = unixsock.UnixPull(endpoint)
    push = unixsock.UnixPush(endpoint)
    arrays = [np.full(2 << 20, i, dtype=np.float32) for i in range(3)]
    t0 = time.perf_counter()
    for arr in arrays:
        push.send_multipart([b"head", arr])
    assert time.perf_counter() - t0 < 2.0   # did not wait for the receiver to read 24 MB
    for i in range(3):
        head, frame = pull.recv_multipart()
        assert bytes(head) == b"head"
        assert np.array_equal(np.frombuffer(frame, dtype=np.float32), arrays[i])
    push.close(linger=1000)
    pull.close()


def test_sender_before_the_receiver_binds(endpoint):
    push = unixsock.UnixPush(endpoint)
    push.send_multipart([b"early"])           # nobody listens yet: queued, not an error
    time.sleep(0.05)
    pull = unixsock.UnixPull(endpoint)
    assert pull.poll(2000)
    assert bytes(pull.recv_multipart()[0]) == b"early"
    push.close(linger=100)
    pull.close()


def test_close_drops_what_no_peer_takes_and_a_gone_peer_is_no_error(endpoint, tmp_path):
    lonely = unixsock.UnixPush(f"unix://{tmp_path}/nobody")
    lonely.send_multipart([b"lost"])
    t0 = time.perf_counter()
    lonely.close(linger=100)                  # waits its linger, no longer
    assert time.perf_counter() - t0 < 1.0
    pull = unixsock.UnixPull(endpoint)
    push = unixsock.UnixPush(endpoint)
    push.send_multipart([b"one"])
    assert bytes(pull.recv_multipart()[0]) == b"one"
    pull.close()
    for _ in range(3):                        # the receiver is gone: sends are dropped quietly
        push.send_multipart([b"x" * 1000])
    push.close(linger=100)


def test_poll_waits_for_its_timeout_or_a_message(endpoint):
    pull = unixsock.UnixPull(endpoint)
    t0 = time.perf_counter()
    assert not pull.poll(50)
    assert 0.04 < time.perf_counter() - t0 < 1.0
    push = unixsock.UnixPush(endpoint)
    threading.Timer(0.05, push.send_multipart, args=([b"late"],)).start()
    assert pull.poll(5000)
    assert bytes(pull.recv_multipart()[0]) == b"late"
    push.close(linger=100)
    pull.close()


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_strata_messages_over_either_endpoint(tmp_path, scheme):
    sockets = transport.Sockets()
    inbox = sockets.pull(f"{scheme}://{tmp_path}/inbox")
    out = sockets.push(f"{scheme}://{tmp_path}/inbox")
    assert isinstance(inbox, unixsock.UnixPull) == (scheme == "unix")
    assert isinstance(inbox, zmq.Socket) == (scheme == "ipc")
    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    transport.send(out, Result(7, [1, 2, 3], [0.5]), [logits])
    msg, tensors = transport.recv(inbox, spin_s=0.001)
    assert msg == Result(7, [1, 2, 3], [0.5])
    assert np.array_equal(tensors[0], logits)
    sockets.close(linger_ms=100)


def test_empty_frames_go_through_both_paths(endpoint):
    """A (0, V) array (a chunk's logits when no row samples) is a frame of no bytes, sent at
    once or by the sender thread (peer not bound yet), and the socket goes on working."""
    push = unixsock.UnixPush(endpoint)
    empty = np.zeros((0, 5), np.float32)
    push.send_multipart([b"queued", empty])          # no receiver yet: the sender thread
    pull = unixsock.UnixPull(endpoint)
    head, frame = pull.recv_multipart()
    assert bytes(head) == b"queued" and memoryview(frame).nbytes == 0
    push.send_multipart([b"direct", empty])
    push.send_multipart([b"after"])
    assert [bytes(f) for f in pull.recv_multipart()] == [b"direct", b""]
    assert bytes(pull.recv_multipart()[0]) == b"after"
    push.close(linger=100)
    pull.close()


def test_a_restarted_receiver_binds_the_same_path_and_gets_later_messages(endpoint):
    pull = unixsock.UnixPull(endpoint)
    push = unixsock.UnixPush(endpoint)
    push.send_multipart([b"one"])
    assert bytes(pull.recv_multipart()[0]) == b"one"
    pull.listener.close()          # dies without cleaning up: its socket file stays
    for conn in pull.buffers:
        conn.close()
    again = unixsock.UnixPull(endpoint)
    deadline = time.monotonic() + 5
    while not again.poll(10) and time.monotonic() < deadline:
        push.send_multipart([b"two"])   # the first sends find the dead peer and are dropped
    assert bytes(again.recv_multipart()[0]) == b"two"
    push.close(linger=100)
    again.close()


def test_launch_over_either_transport_gives_the_same_tokens_and_logits(tiny_model, no_stage_left):
    """Two CPU stages, a prompt longer than one chunk, logits wanted: the first chunk's Result
    carries an empty logits frame. Unix sockets and ZeroMQ give the same tokens and logits."""
    from strata.coordinator.engine.generate import generate_solo
    from strata.coordinator.sampling_params import SamplingParams
    from strata.coordinator.sequence import Sequence
    from strata.launch.plan import plan_stages
    from strata.launch.session import launch_stages
    from strata.model.gguf_file import ModelFile

    file = ModelFile(tiny_model)
    plan = plan_stages("2", ["cpu"], file.config.n_layers)
    prompt = [(7 * i) % file.config.vocab for i in range(45)]   # two chunks of 32 rows
    got = {}
    for transport_name in ("unix", "zmq"):
        with launch_stages(file, plan, slots=1, ctx=128, transport=transport_name,
                           say=lambda s: None) as run:
            assert run.procs.endpoints.inbox.startswith(
                "unix://" if transport_name == "unix" else "ipc://")
            logits = {}
            seq = Sequence(prompt, SamplingParams(max_tokens=6), frozenset(), 128)
            generate_solo(run.pipe, seq, on_logits=lambda p, x: logits.__setitem__(p, x.copy()))
            got[transport_name] = (seq.generated, logits)
    tokens, logits = got["unix"]
    assert len(tokens) == 6 and sorted(logits) == list(range(45, 51))
    assert tokens == got["zmq"][0]
    assert all(np.array_equal(logits[p], got["zmq"][1][p]) for p in logits)
