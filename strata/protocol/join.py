"""The sockets of a join: a launch that waits for stages from other hosts answers their
questions on a ZeroMQ REP socket (JoinDesk, in a thread of its own); a stage asks one question
at a time on a REQ socket (ask). The messages are messages.JoinAsk and the others after it.

    desk = JoinDesk("tcp://10.0.0.5:7600", answer)   # answer(message) -> reply, in the thread
    ...
    desk.close()

    reply = ask("tcp://10.0.0.5:7600", JoinAsk(PROTOCOL_VERSION, 1), timeout_s=60)

With keys (keys.py) both sides speak CurveZMQ: the desk is a CURVE server with the launch's
coordinator identity and a ZAP handler that lets in only the keys of its directory, and a
stage asks with its own key, checking the desk's against its coordinator.key. A handshake
that fails (keys on one side only, an unknown key, another coordinator.key) is said on both
sides: the desk calls on_refused, ask raises JoinHandshakeError.

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
from strata.protocol.keys import COORDINATOR, CurveKeys
from strata.protocol.messages import JoinRefused, ProtocolError

log = logging.getLogger("strata.join")
POLL_MS = 100   # how often the desk's thread looks whether it is closed


def _handshake_failures() -> int:
    import zmq
    return (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class JoinHandshakeError(ConnectionError):
    """The desk and the stage could not agree on CurveZMQ: keys on one side only, or keys
    the other side does not trust."""


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

    def __init__(self, endpoint: str, answer: Callable[[object], object],
                 keys: CurveKeys | None = None,
                 on_refused: Callable[[], None] = lambda: None):
        """keys: the launch's coordinator identity (CURVE server, its directory's keys let
        in); on_refused() runs in the desk's thread for each peer whose handshake failed."""
        import zmq
        self._zmq = zmq.Context()
        self._auth = keys.authenticator(self._zmq) if keys is not None else None
        self._sock = self._zmq.socket(zmq.REP)
        self._monitor = self._sock.get_monitor_socket(_handshake_failures())
        self._on_refused = on_refused
        if keys is not None:
            keys.serve(self._sock)
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        try:
            if port == "0":
                port = str(self._sock.bind_to_random_port(f"tcp://{host}"))
            else:
                self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise transport.TransportError(f"cannot listen on {endpoint}: {e}") from None
        self.endpoint = f"tcp://{host}:{port}"
        self._answer = answer
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="join-desk", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # the socket is this thread's alone from here on (ZeroMQ sockets are not thread-safe)
        import zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._closing.is_set():
            ready = dict(poller.poll(POLL_MS))
            if self._monitor in ready:
                self._monitor.recv_multipart()   # a handshake failed (the event's two frames)
                self._on_refused()
            if self._sock not in ready:
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
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._zmq.term()

    def close(self) -> None:
        self._closing.set()
        self._thread.join()


def ask(endpoint: str, question, timeout_s: float, keys: CurveKeys | None = None):
    """Send one question to the desk at endpoint and return its answer, or None when none
    came within timeout_s (no launch there yet, or it has gone). keys: this stage's identity;
    the desk must hold the secret of the directory's coordinator.key. JoinHandshakeError when
    the handshake fails."""
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    monitor = sock.get_monitor_socket(_handshake_failures())
    try:
        if keys is not None:
            keys.connect_to(sock, COORDINATOR)
        sock.connect(endpoint)
        # a send waits for a peer; after a failed handshake ZeroMQ may drop it: bounded
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        try:
            transport.send(sock, question)
        except (zmq.Again, transport.TransportError):
            if monitor.poll(0):
                raise JoinHandshakeError(endpoint) from None
            return None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000)))
        if sock in ready:
            msg, _ = transport.recv(sock)
            return msg
        if monitor in ready:
            raise JoinHandshakeError(endpoint)
        return None
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
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
