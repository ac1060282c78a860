"""Serving over HTTP as a process: bind the port before the stages start, run the server until
SIGINT or SIGTERM, and say so on the console. The server itself (routes, limits, the engine
thread) is strata.coordinator.api.server; this module holds only the process's concerns."""
from __future__ import annotations

import asyncio
import errno
import signal
import socket
from typing import Callable

from strata.coordinator.engine.engine import Engine
from strata.coordinator.engine.metrics import Metrics
from strata.coordinator.api.server import Server, ServerConfig, serve


class ServeError(ValueError):
    """The server cannot listen as asked; the message says which option to change."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before the stages start (a taken port fails fast); listen once they are ready."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"--host {host!r} does not resolve ({e.strerror}); use an address "
                         f"such as 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}); stop what uses "
                             f"it or choose another --port") from None
        if e.errno == errno.EACCES:
            raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}); choose a --port "
                             f"of 1024 or above") from None
        raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}); --host must be an "
                         f"address of this machine, such as 127.0.0.1 or 0.0.0.0") from None
    return sock


def run_server(pipe, check_alive: Callable[[], None], sched_cfg, tok, vocab: int,
               cfg: ServerConfig, sock: socket.socket, say: Callable[[str], None],
               restart: Callable[[int], None] | None = None) -> str | None:
    """Serve until SIGINT or SIGTERM; then stop taking requests, cancel the running ones and
    wait for the windows in flight. The caller stops the stages afterwards. Returns why the
    stages stopped serving before the signal came, if they did. restart(stage): start a stage
    that died or hangs again (--restart-stages)."""
    metrics = Metrics()
    engine = Engine(pipe, sched_cfg, tok.stop_ids, tok.decode, metrics, cfg.stop_grace,
                    restart=restart)
    server = Server(engine, tok, vocab, cfg, metrics, check_alive)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    async def until_signal() -> str | None:
        stop = asyncio.Event()

        def on_signal() -> None:
            if not stop.is_set():
                stop.set()
                say("strata: stopping")

        for sig in previous:
            asyncio.get_running_loop().add_signal_handler(sig, on_signal)
        return await serve(server, sock, stop, lambda url: say(
            f"strata: serving {cfg.model} on {url} ({len(engine.stages)} stages, batch "
            f"{sched_cfg.slots}, groups {sched_cfg.groups})"))

    engine.start()
    try:
        return asyncio.run(until_signal())
    finally:
        engine.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
