"""PUSH/PULL over Unix stream sockets: the same-host transport (`unix://PATH` endpoints).

ZeroMQ hands every message to an I/O thread on each side, and waking those threads is most of
a hop's cost on a VM: a ZeroMQ round trip with spinning receivers takes ~130 us on a 2-core
x86_64 VM and a hop 0.15-0.3 ms on an H200 host, while the same round trip over a
Unix socket that the receiver reads itself takes ~6 us (docs/BENCHMARKS.md). These two classes
keep the part of ZeroMQ's PUSH/PULL contract strata relies on, and nothing else:

  - a PULL socket binds and takes messages from any number of PUSH sockets (fan-in), each
    sender's messages whole and in order;
  - a PUSH socket may connect before its peer binds, and a send does not wait for the peer:
    what the kernel does not take at once goes to a sender thread, in order (ZeroMQ queues
    too), and a message for a peer that never comes is dropped at close, after `linger`;
  - a peer that goes and binds again (a stage started again) gets the messages sent since:
    one that its predecessor had taken in part is lost with it, the next ones wait for the
    new peer as for one that has not bound yet (ZeroMQ reconnects and keeps them too);
  - that queue is bounded as ZeroMQ's is by its high-water mark: with SNDHWM (1000, ZeroMQ's
    default) messages queued, a send blocks until the peer reads (ZeroMQ's PUSH blocks too),
    so a peer that stops reading stops its senders instead of growing their memory;
  - a PUSH socket tells when the process it sent to has gone (peer_gone: its end closed), which
    ZeroMQ tells through a socket monitor (peers.py).

A message is its frames (bytes-like): on the wire a u64 length, a u32 frame count, a u64 size
per frame, then the frames. Received frames are memoryviews of one bytes object.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import selectors
import socket
import struct
import threading
import time
from collections import deque

log = logging.getLogger("strata.unixsock")

_LEN = struct.Struct("<Q")
_COUNT = struct.Struct("<I")
SCHEME = "unix://"


def path_of(endpoint: str) -> str:
    if not endpoint.startswith(SCHEME):
        raise ValueError(f"{endpoint!r} is not a unix:// endpoint")
    return endpoint[len(SCHEME):]


def encode(frames) -> list:
    sizes = [memoryview(f).nbytes for f in frames]
    head = _COUNT.pack(len(frames)) + b"".join(_LEN.pack(n) for n in sizes)
    return [_LEN.pack(len(head) + sum(sizes)) + head, *frames]


def decode(payload: bytes) -> list[memoryview]:
    view = memoryview(payload)
    (count,) = _COUNT.unpack_from(view, 0)
    sizes = [_LEN.unpack_from(view, 4 + 8 * i)[0] for i in range(count)]
    at, frames = 4 + 8 * count, []
    for n in sizes:
        frames.append(view[at:at + n])
        at += n
    return frames


class UnixPull:
    def __init__(self, endpoint: str):
        self.path = path_of(endpoint)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # a file left by a process that died (as ZeroMQ's ipc:// does, bind takes it)
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.listener.bind(self.path)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.buffers: dict[socket.socket, bytearray] = {}
        self.ready: deque[bytes] = deque()   # whole messages, in arrival order
        self.scratch = bytearray(1 << 20)

    def poll(self, timeout_ms: int | None = 0) -> bool:
        """True when a whole message is there; waits up to timeout_ms (None: forever)."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while not self.ready:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            for key, _ in self.selector.select(left):   # one epoll_wait: what is readable
                self._read(key.fileobj)
            if left == 0.0:
                break
        return bool(self.ready)

    def recv_multipart(self, copy: bool = False) -> list[memoryview]:
        self.poll(None)
        return decode(self.ready.popleft())

    def _read(self, sock: socket.socket) -> None:
        """Accept new senders, or read what one connection has, without waiting."""
        if sock is self.listener:
            while True:
                try:
                    conn, _ = self.listener.accept()
                except (BlockingIOError, InterruptedError):
                    return
                conn.setblocking(False)
                self.buffers[conn] = bytearray()
                self.selector.register(conn, selectors.EVENT_READ)
        buf = self.buffers[sock]
        while True:
            try:
                n = sock.recv_into(self.scratch)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                n = 0
            if not n:  # the sender closed: what it sent whole is kept
                self.selector.unregister(sock)
                sock.close()
                del self.buffers[sock]
                return
            buf += memoryview(self.scratch)[:n]
            self._split(buf)
            if n < len(self.scratch):
                return

    def _split(self, buf: bytearray) -> None:
        while len(buf) >= 8:
            (n,) = _LEN.unpack_from(buf, 0)
            if len(buf) < 8 + n:
                return
            self.ready.append(bytes(buf[8:8 + n]))
            del buf[:8 + n]

    def close(self, linger: int = 0) -> None:
        for conn in self.buffers:
            conn.close()
        self.buffers.clear()
        self.selector.close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class UnixPush:
    RETRY_S = 0.005  # a sender thread retries a peer that is not listening yet this often
    SNDHWM = 1000    # messages queued (beyond what the kernel took) before a send blocks

    def __init__(self, endpoint: str):
        self.path = path_of(endpoint)
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.backlog: deque[list] = deque()   # parts the kernel did not take yet, in order
        self.wake = threading.Condition(self.lock)   # the sender thread: work, or closing
        self.room = threading.Condition(self.lock)   # senders: the backlog shrank, or closing
        self.closing = False
        self.thread: threading.Thread | None = None
        self.was_connected = False   # a peer once took this socket's connection
        self.begun = False   # part of the first message in the backlog went (on this connection)

    def send_multipart(self, frames, copy: bool = False) -> None:
        """Blocks while SNDHWM messages wait for the peer; OSError once the socket is closed."""
        parts = encode(frames)
        with self.lock:
            while len(self.backlog) >= self.SNDHWM and not self.closing:
                self.room.wait()
            if self.closing:
                raise OSError(errno.ENOTSOCK, f"the socket to {self.path} is closed")
            if not self.backlog and self._connected():
                parts = self._send_now(parts)
                if not parts:
                    return
            self.backlog.append(parts)
            self._start_thread()
            self.wake.notify()

    def _connected(self) -> bool:
        if self.sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except OSError:  # not bound yet (or gone): the sender thread retries
                sock.close()
                return False
            sock.setblocking(False)
            self.sock = sock
            self.was_connected = True
        return True

    def peer_gone(self) -> bool:
        """True once the peer this socket was connected to has closed its end (the kernel
        closes the sockets of a process that exits, however it dies) and nothing listens at
        the path any more; False while it has never connected (a peer may bind later)."""
        with self.lock:
            if self.sock is not None:
                closed = select.poll()   # the PULL end never writes: readable means closed
                closed.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
                if not closed.poll(0):
                    return False
                if self._disconnect() and self.backlog:   # its rest would reach the next peer
                    self.backlog.popleft()
                    self.room.notify()
            return self.was_connected and not self._connected()

    def _disconnect(self) -> bool:
        """Close the connection to a peer that went (the next attempt connects again: a
        restarted peer); True if a message had begun on it: the rest of it is lost with the
        peer, and the caller drops it."""
        self.sock.close()
        self.sock = None
        lost, self.begun = self.begun, False
        return lost

    def _send_now(self, parts: list) -> list:
        """Send what the kernel takes of the first message without waiting; return what is
        left of it."""
        views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]  # (0, V): none
        while views:
            try:
                n = self.sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                return views
            except OSError as e:  # the peer has gone
                if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                    raise
                # a message begun went with the peer; one not begun waits for the next peer
                return [] if self._disconnect() else views
            self.begun = True
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if n:
                views[0] = views[0][n:]
        self.begun = False
        return []

    def _start_thread(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._drain, name="unix-push", daemon=True)
            self.thread.start()

    def _drain(self) -> None:
        with self.lock:
            while True:
                while not self.backlog and not self.closing:
                    self.wake.wait()
                if not self.backlog:
                    return
                if not self._connected():
                    self.wake.wait(self.RETRY_S)
                    continue
                try:
                    left = self._send_now(self.backlog[0])
                except Exception as e:  # never leave the socket with a dead sender thread
                    log.error("dropping a message for %s: %s", self.path, e)
                    left, self.begun = [], False
                if left and self.sock is None:   # the peer went: this one waits for the next
                    self.backlog[0] = left
                elif left:
                    self.backlog[0] = left
                    writable = select.poll()   # poll, not select: any fd number
                    writable.register(self.sock, select.POLLOUT)
                    self.lock.release()   # let the caller queue more while the peer reads
                    try:
                        writable.poll(50)
                    except OSError:  # closed meanwhile: close() dropped the rest
                        pass
                    finally:
                        self.lock.acquire()
                else:
                    self.backlog.popleft()
                    self.room.notify()

    def close(self, linger: int = 0) -> None:
        """Wait up to linger ms for queued messages to go, then drop the rest and close."""
        deadline = time.monotonic() + linger / 1000
        with self.lock:
            self.closing = True
            self.wake.notify()
            while self.backlog and time.monotonic() < deadline:
                self.wake.wait(0.005)
            self.backlog.clear()
            if self.sock is not None:
                self.sock.close()
                self.sock = None
            self.wake.notify()
            self.room.notify_all()   # a send blocked at the high-water mark raises
