"""The same-host transport (protocol/unixsock.py): ZeroMQ's PUSH/PULL contract as strata uses
it. Messages whole and in order per sender, fan-in, large frames, a sender before its
receiver binds, sends that never wait for a busy or absent peer, and strata's own messages
through transport.send / recv on either kind of endpoint."""
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
