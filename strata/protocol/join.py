"""The sockets of a join: a launch that waits for stages from other hosts answers their
questions on a ZeroMQ REP socket (JoinDesk, in a thread of its own); a stage asks one question
at a time on a REQ socket (ask). The messages are messages.JoinAsk and the others after it.

    desk = JoinDesk("tcp://10.0.0.5:7600", answer)   # answer(message) -> reply, in the thread
    ...
    desk.close()

    reply = ask("tcp://10.0.0.5:7600", JoinAsk(PROTOCOL_VERSION, 1), timeout_s=60)

And the two TCP facts a joining stage needs: the address this host has toward the launch's
host, and a free port there.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
from typing import Callable

from strata.protocol import transport
from strata.protocol.messages import JoinRefused, ProtocolError

log = logging.getLogger("strata.join")
POLL_MS = 100   # how often the desk's thread looks whether it is closed


def parse_tcp(endpoint: str) -> tuple[str, int]:
    """tcp://HOST:PORT -> (HOST, PORT); ValueError with a sentence otherwise."""
    m = re.fullmatch(r"tcp://([^:/\s]+):(\d{1,5})", endpoint)   # IPv4 or a host name
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"{endpoint!r} is not a tcp://HOST:PORT endpoint "
                         f"(e.g. tcp://10.0.0.5:7600)")
    return m.group(1), int(m.group(2))


class JoinDesk:
    """Binds `endpoint` (tcp://ADDRESS:PORT; port 0: any free one, see `endpoint` after) and
    answers each question with answer(message) in a thread, until close()."""

    def __init__(self, endpoint: str, answer: Callable[[object], object]):
        import zmq
        self._zmq = zmq.Context()
        self._sock = self._zmq.socket(zmq.REP)
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        try:
            if port == "0":
                port = str(self._sock.bind_to_random_port(f"tcp://{host}"))
            else:
                self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._zmq.term()
            raise transport.TransportError(f"cannot listen on {endpoint}: {e}") from None
        self.endpoint = f"tcp://{host}:{port}"
        self._answer = answer
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="join-desk", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # the socket is this thread's alone from here on (ZeroMQ sockets are not thread-safe)
        while not self._closing.is_set():
            if not self._sock.poll(POLL_MS):
                continue
            try:
                msg, _ = transport.recv(self._sock)
                reply = self._answer(msg)
            except ProtocolError as e:  # not a stage of this strata version: say so, go on
                reply = JoinRefused(-1, f"the launch could not read the question: {e}; run "
                                        f"the same strata version on both hosts")
            except Exception as e:      # a bug must not leave later joins unanswered
                log.exception("answering a join failed")
                reply = JoinRefused(-1, f"the launch failed to answer: {e!r}")
            transport.send(self._sock, reply)   # REP: one answer per question, in order
        self._sock.close(linger=0)

    def close(self) -> None:
        self._closing.set()
        self._thread.join()
        self._zmq.term()


def ask(endpoint: str, question, timeout_s: float):
    """Send one question to the desk at endpoint and return its answer, or None when none
    came within timeout_s (no launch there yet, or it has gone)."""
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    try:
        sock.connect(endpoint)
        transport.send(sock, question)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        msg, _ = transport.recv(sock)
        return msg
    finally:
        sock.close(linger=0)
        ctx.term()


def address_toward(host: str, port: int) -> str:
    """The address of this host on the route to host:port (a UDP socket's connect sends
    nothing: it only picks the route and the source address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def free_ports(address: str, n: int = 1) -> list[int]:
    """n distinct TCP ports free on `address` now (another process may take one before it is
    bound: the sockets that found them are held together, then closed)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((address, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
