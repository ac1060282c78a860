"""Three protocol defects, each with the case that showed it: a Unix-socket sender facing a
peer that stops reading, a window header that a stage k > 0 cannot parse while its activations
come over the link, and an Error about no window while the scheduler has windows in flight."""
from __future__ import annotations

import threading
import time

import pytest

from strata.protocol import unixsock

HWM = 4           # the high-water mark these tests give UnixPush
MESSAGES = 64     # sent to a peer that does not read: far past HWM and the kernel's buffer
PAYLOAD = 1 << 16


def _wait_until_still(count, settle_s: float = 0.5, limit_s: float = 10.0) -> int:
    """count() once it has not changed for settle_s (or limit_s has passed)."""
    deadline = time.monotonic() + limit_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
    return last


def test_unix_push_blocks_at_its_high_water_mark(tmp_path, monkeypatch):
    """As ZeroMQ's PUSH at SNDHWM: with HWM messages queued for a peer that does not read, a
    send blocks (the queue stays bounded), and goes on when the peer reads; every message
    then arrives whole and in order."""
    monkeypatch.setattr(unixsock.UnixPush, "SNDHWM", HWM, raising=False)
    endpoint = f"unix://{tmp_path}/in"
    pull = unixsock.UnixPull(endpoint)   # bound, but reads nothing until later
    push = unixsock.UnixPush(endpoint)
    sent: list[int] = []

    def sender():
        for i in range(MESSAGES):
            push.send_multipart([i.to_bytes(4, "little"), bytes([i]) * PAYLOAD])
            sent.append(i)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    blocked_at = _wait_until_still(lambda: len(sent))
    assert thread.is_alive() and blocked_at < MESSAGES, \
        f"all {len(sent)} sends returned to a peer that reads nothing: the queue is unbounded"
    assert len(push.backlog) <= HWM
    for i in range(MESSAGES):   # reading lets the sender go on
        assert pull.poll(10_000), f"message {i} never came"
        index, body = pull.recv_multipart()
        assert int.from_bytes(index, "little") == i
        assert bytes(body) == bytes([i]) * PAYLOAD
    thread.join(10)
    assert not thread.is_alive() and sent == list(range(MESSAGES))
    push.close(linger=100)
    pull.close()


def test_a_send_blocked_at_the_high_water_mark_ends_when_the_socket_closes(tmp_path,
                                                                            monkeypatch):
    """A sender blocked for a peer that never binds is released by close, with an OSError
    (which transport.send turns into a TransportError), not left waiting for ever."""
    monkeypatch.setattr(unixsock.UnixPush, "SNDHWM", HWM, raising=False)
    push = unixsock.UnixPush(f"unix://{tmp_path}/nobody")
    outcome: list = []

    def sender():
        try:
            for i in range(HWM + 1):
                push.send_multipart([bytes([i])])
            outcome.append("returned")
        except OSError as e:
            outcome.append(e)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive(), "the send past the high-water mark did not block"
    push.close(linger=0)
    thread.join(5)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], OSError), \
        outcome
