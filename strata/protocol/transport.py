"""Framing: a msgpack header frame, then one raw frame per tensor (zero-copy sends).

The header's "tensors" entry lists [dtype, shape] for each extra frame, so a receiver checks
sizes before it trusts a buffer. Tensors travel as numpy arrays; torch code converts at the edge.
zmq is imported only when a ZeroMQ socket is opened, torch only by the tensor helpers at the end.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import stat
import sys
import time

import msgpack
import numpy as np

from strata.protocol import unixsock
from strata.protocol.keys import CurveKeys
from strata.protocol.messages import ProtocolError, claimed_window, decode, encode


log = logging.getLogger("strata.transport")


class TransportError(RuntimeError):
    """A socket failed to send or receive (a peer gone, an endpoint that cannot be used)."""


def _socket_errors() -> tuple[type[BaseException], ...]:
    """What the sockets raise: OSError (Unix sockets), zmq.ZMQError once zmq is in use."""
    zmq = sys.modules.get("zmq")
    return (OSError,) if zmq is None else (OSError, zmq.ZMQError)

_DTYPES = {"float32", "float16", "int64", "int32", "uint16"}  # uint16 carries bf16 bits


def pack(msg, tensors: list[np.ndarray] = ()) -> list:
    header = encode(msg)
    header["tensors"] = [[str(t.dtype), list(t.shape)] for t in tensors]
    return [msgpack.packb(header, use_bin_type=True)] + [np.ascontiguousarray(t) for t in tensors]


def unpack(frames: list) -> tuple[object, list[np.ndarray]]:
    """frames: bytes, memoryviews or zmq.Frame. Raises ProtocolError on anything malformed,
    with the window id and row count it claims where they can be read (claimed_window)."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        header = msgpack.unpackb(_bytes(frames[0]), raw=False, strict_map_key=False)
    except Exception as e:
        raise ProtocolError(f"header is not msgpack ({type(e).__name__})") from e
    try:
        return _unpack(header, frames)
    except ProtocolError as e:
        e.window, e.rows = claimed_window(header)
        raise


def _unpack(header, frames: list) -> tuple[object, list[np.ndarray]]:
    specs = header.pop("tensors", []) if isinstance(header, dict) else []
    msg = decode(header)
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ProtocolError(f"header lists {len(specs) if isinstance(specs, list) else '?'} "
                            f"tensors but {len(frames) - 1} frames came")
    tensors = []
    for spec, frame in zip(specs, frames[1:]):
        try:
            dtype, shape = spec
            if dtype not in _DTYPES:
                raise ProtocolError(f"tensor dtype {dtype!r} is not allowed")
            if any(type(d) is not int or d < 0 for d in shape):  # reshape would infer a -1
                raise ValueError(f"shape {shape!r} is not a list of sizes")
            buf = getattr(frame, "buffer", frame)   # a zmq.Frame's memoryview
            arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
        except ProtocolError:
            raise
        except Exception as e:
            raise ProtocolError(f"tensor frame does not match its spec {spec!r}") from e
        tensors.append(arr)
    return msg, tensors


def _bytes(frame) -> bytes:
    return getattr(frame, "bytes", frame)   # a zmq.Frame's bytes


class OpenEndpointError(ValueError):
    """A TCP endpoint without keys that would take messages from any host."""


def is_loopback(host: str) -> bool:
    """Whether a tcp:// endpoint's host part names this machine's loopback interface only
    (anything else, `*` and interface names included, may face a network)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_tcp(endpoint: str, bind: bool, keyed: bool, insecure: bool, warn: bool = True) -> None:
    """Without keys a tcp:// endpoint is open: anyone who reaches it can send windows to a
    stage, or read the activations and tokens sent to it. A bind on anything but loopback is
    refused unless `insecure`; every other open TCP endpoint gets a warning on stderr."""
    if keyed or not endpoint.startswith("tcp://"):
        return
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    if bind and not insecure and not is_loopback(host):
        raise OpenEndpointError(
            f"{endpoint} would take windows from any host that reaches it; give --keys DIR "
            f"(key pairs made by strata-keys) or, on a network you trust, --insecure")
    if warn:
        log.warning("%s %s has no keys: any process that reaches it can %s; give --keys "
                    "DIR (made by strata-keys) to authenticate and encrypt it",
                    "listening on" if bind else "sending to", endpoint,
                    "send messages here" if bind else "receive what is sent there")


def check_private_dir(path: str) -> None:
    """A warning when the directory of a unix:// or ipc:// socket is open to other users: a
    launch keeps its sockets in a 0700 directory of its own, so only its user can connect."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode = stat.S_IMODE(os.stat(directory).st_mode)
    except OSError:
        return  # the bind itself fails and says why
    if mode & 0o077:
        log.warning("the socket %s lies in %s (mode %o), which other users can enter; put "
                    "it in a directory only you can use (mode 700)", path, directory, mode)


class Sockets:
    """The sockets of one process, by endpoint: `unix://PATH` over Unix stream sockets
    (unixsock.py: same host, no I/O threads), anything else (ipc://, tcp://) over ZeroMQ.
    Both give PUSH/PULL with send_multipart, recv_multipart, poll(ms) and close(linger).

    keys: this process's CURVE identity (keys.py); every ZeroMQ socket then authenticates
    its peers and encrypts, a push naming the process it connects to. Without keys a TCP
    endpoint is open (check_tcp): insecure allows binding one beyond loopback."""

    def __init__(self, keys: CurveKeys | None = None, insecure: bool = False):
        self.keys, self.insecure = keys, insecure
        self._zmq = None   # the zmq.Context, once a ZeroMQ socket is opened
        self._auth = None  # its ZAP handler (keys.py) once a CURVE server is opened
        self._open: list = []

    def pull(self, endpoint: str):
        return self._open_socket(endpoint, pull=True)

    def push(self, endpoint: str, peer: str | None = None):
        """peer: the key name of the process bound at `endpoint` (needed with keys)."""
        return self._open_socket(endpoint, pull=False, peer=peer)

    @property
    def refused(self) -> int:
        """Peers the ZAP handler refused so far (an unknown or missing key)."""
        return self._auth.credentials_providers["*"].refused if self._auth else 0

    def _open_socket(self, endpoint: str, pull: bool, peer: str | None = None):
        check_tcp(endpoint, bind=pull, keyed=self.keys is not None, insecure=self.insecure)
        try:
            if endpoint.startswith(unixsock.SCHEME):
                if pull:
                    check_private_dir(unixsock.path_of(endpoint))
                sock = (unixsock.UnixPull if pull else unixsock.UnixPush)(endpoint)
            else:
                sock = self._zmq_socket(endpoint, pull, peer)
        except _socket_errors() as e:
            raise TransportError(f"cannot {'bind' if pull else 'connect to'} {endpoint}: "
                                 f"{e}") from e
        self._open.append(sock)
        return sock

    def _zmq_socket(self, endpoint: str, pull: bool, peer: str | None):
        import zmq
        if self._zmq is None:
            self._zmq = zmq.Context()
        if pull and endpoint.startswith("ipc://"):
            check_private_dir(endpoint[len("ipc://"):])
        sock = self._zmq.socket(zmq.PULL if pull else zmq.PUSH)
        try:
            if self.keys is not None and pull:
                if self._auth is None:  # before the first bind: no peer gets in unchecked
                    self._auth = self.keys.authenticator(self._zmq)
                self.keys.serve(sock)
            elif self.keys is not None:
                assert peer is not None, f"a keyed push to {endpoint} must name its peer"
                self.keys.connect_to(sock, peer)
            (sock.bind if pull else sock.connect)(endpoint)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def close(self, linger_ms: int = 1000) -> None:
        for sock in self._open:
            sock.close(linger=linger_ms)
        self._open.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None


def send(sock, msg, tensors: list[np.ndarray] = ()) -> None:
    """Raises TransportError when the socket fails (the message is encoded first: a value the
    wire cannot carry raises from msgpack before anything is sent)."""
    frames = pack(msg, tensors)
    try:
        sock.send_multipart(frames, copy=False)
    except _socket_errors() as e:
        raise TransportError(f"cannot send a {type(msg).__name__}: {e}") from e


# How long a process driving GPUs polls for its next message before it blocks: longer than
# a decode window (llama3-8b over two H200s: ~5 ms), so the coordinator's wait for a result
# does not end in a blocking wake-up. The price: each such process keeps a core busy for up
# to this long after every message (a GPU host has cores to spare; CPU stages never spin).
SPIN_S = 0.05


def spin(sock, seconds: float) -> None:
    """Poll without sleeping for up to `seconds` (or until a message is there): a message
    that comes meanwhile skips the receiving thread's wake-up, which costs ~0.1 ms (more in a
    VM) per hop; for processes whose next message is usually that close (a GPU stage between
    windows, a coordinator of GPU stages). CPU stages do not: they need the cores."""
    deadline = time.perf_counter() + seconds
    while not sock.poll(0) and time.perf_counter() < deadline:
        pass


def recv(sock, spin_s: float = 0.0) -> tuple[object, list[np.ndarray]]:
    """The next message, after spin(sock, spin_s) when spin_s > 0; then block as usual."""
    if spin_s > 0:
        spin(sock, spin_s)
    try:
        frames = sock.recv_multipart(copy=False)
    except _socket_errors() as e:
        raise TransportError(f"cannot receive: {e}") from e
    return unpack(frames)


# --- torch tensors at the edge: bf16 has no numpy dtype, so it travels as its bits in uint16 ---

def tensor_frame(t) -> np.ndarray:
    """A torch tensor (any device) as a frame array: bf16 as uint16 bits, others as they are."""
    import torch
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    return t.cpu().numpy()


def frame_tensor(arr: np.ndarray):
    """A received frame array as a writable CPU torch tensor; uint16 frames are bf16 bits."""
    import torch
    if arr.dtype == np.uint16:
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())
