"""External stages joining a launch from other hosts (strata-launch --external-stage K --listen
HOST:PORT, and strata-worker --join tcp://HOST:PORT --stage K there).

The launch answers each joining stage from its own plan: the model to check (a file with
another fingerprint is refused), then the strata-worker arguments the stage would have been
spawned with, its own tcp:// endpoint put in. Every endpoint of such a launch is ZeroMQ tcp on
HOST; the local stages start once every external stage has joined (a stage's --next must be
known when it starts). A stage whose next stage is external and has not joined yet is told to
wait; a join for a stage the launch runs itself, a second join for a stage, and a wrong model
are refused with a sentence, said on both sides.

With keys the desk speaks CurveZMQ as the launch's coordinator (protocol/join.py), and the
arguments handed over carry no --keys or --insecure: the stage gives its own (its keys
directory on its host holds its secret; the launcher's path means nothing there).

With a torch.distributed link (--stage-link nccl|gloo) the launcher hosts the link's
rendezvous, a TCPStore on a free port of HOST, and every stage, spawned or joined, is given
`--link-init tcp://HOST:PORT`: it works wherever stage 0 runs, even when every stage joins.
Only this path imports torch in the launcher. The store and the link's connections are
neither authenticated nor encrypted, so such a launch has no --keys (cli.check_security).
"""
from __future__ import annotations

import shlex
import socket
import threading
import time

from strata.coordinator.stages.pipeline import PipelineError
from strata.launch.plan import PlanError
from strata.launch.processes import StageProcesses
from strata.protocol.join import JoinDesk, free_ports, parse_tcp
from strata.protocol.keys import CurveKeys
from strata.protocol.transport import TransportError
from strata.protocol.messages import (PROTOCOL_VERSION, JoinAsk, JoinConfirm, JoinModel,
                                      JoinPlan, JoinRefused, JoinWait)

NOTE_S = 30.0   # how often the launcher says what it still waits for


def parse_listen(text: str) -> tuple[str, int]:
    """--listen HOST:PORT -> (this host's IPv4 address, port; 0 = any free port)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise PlanError(f"--listen {text!r} is not HOST:PORT (e.g. --listen 10.0.0.5:7600)")
    if host in ("*", "0.0.0.0"):
        raise PlanError(f"--listen {text} does not say where other hosts reach this one: every "
                        f"stage is told the address; give this host's (e.g. --listen "
                        f"10.0.0.5:{port})")
    try:
        address = socket.gethostbyname(host)
    except OSError:
        raise PlanError(f"--listen {text}: {host!r} is not an address or a known host name; "
                        f"give this host's address (e.g. --listen 10.0.0.5:{port})") from None
    try:
        free_ports(address)   # every endpoint of the launch binds there
    except OSError as e:
        raise PlanError(f"--listen {text}: {address} is not an address of this host "
                        f"({e.strerror}); give one of this host's addresses") from None
    return address, int(port)


class StageJoins:
    """The desk where the external stages of `procs` join, and what it has heard. `procs` must
    have tcp endpoints (StageProcesses(listen_host=...)); its external stages' endpoints are
    filled in as they join."""

    def __init__(self, procs: StageProcesses, port: int, fingerprint: str,
                 keys: CurveKeys | None = None, say=print):
        """keys: the launch's coordinator identity, for the desk (None: no keys)."""
        assert procs.listen_host is not None, "a joinable launch has tcp endpoints"
        self.procs, self.fingerprint, self.say = procs, fingerprint, say
        self.joined: dict[int, str] = {}   # stage -> its endpoint
        self.lock = threading.Lock()
        self.all_joined = threading.Event()
        self.refused = 0   # peers whose CurveZMQ handshake with the desk failed
        try:
            self.desk = JoinDesk(f"tcp://{procs.listen_host}:{port}", self.answer, keys=keys,
                                 on_refused=self.handshake_failed)
        except TransportError as e:
            raise PlanError(f"{e}; choose another --listen port, or an address of this "
                            f"host") from None
        self.endpoint = self.desk.endpoint
        self.store = None   # the link's rendezvous, while the launch runs
        if procs.link != "zmq":
            self.store = host_rendezvous(procs.listen_host)
            procs.link_init = f"tcp://{procs.listen_host}:{self.store.port}"

    def command(self, stage: int) -> str:
        """What to run on the stage's host (--keys: the launcher's path, where that host
        keeps its copy of the directory)."""
        security = (["--keys", str(self.procs.keys)] if self.procs.keys is not None else
                    ["--insecure"] if self.procs.insecure else [])
        return shlex.join(["strata-worker", "--join", self.endpoint, "--stage", str(stage),
                           "--model", str(self.procs.model), *security])

    def handshake_failed(self) -> None:
        """A peer failed the desk's handshake (runs in the desk's thread): said the first
        time (the stage says why on its side too)."""
        self.refused += 1
        if self.refused > 1:
            return
        if self.procs.keys is not None:
            self.say(f"strata-launch: refused a join whose CurveZMQ handshake failed; start "
                     f"the stage with --keys and a copy of {self.procs.keys} (its own "
                     f"secret, this launch's coordinator.key)")
        else:
            self.say("strata-launch: refused a join whose CurveZMQ handshake failed (the "
                     "stage has keys, this launch none); start the stage without --keys, or "
                     "this launch with --keys")

    def waiting(self) -> list[int]:
        with self.lock:
            return sorted(self.procs.external - set(self.joined))

    def wait(self, timeout: float | None = None, check=lambda: None,
             by_hand: bool = True) -> None:
        """Say what to run on each external stage's host (`by_hand`; else a cluster starts
        them), then wait until every one has joined; PipelineError past `timeout` seconds
        (None: wait for ever), or from `check` (called every second: a stage that a cluster
        started may have exited)."""
        for k in sorted(self.procs.external) if by_hand else ():
            self.say(f"stage {k} is external: waiting for it to join at {self.endpoint}; on "
                     f"its host run:\n  {self.command(k)}")
        start = last_note = time.monotonic()
        while not self.all_joined.wait(1.0):
            check()
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                missing = self.waiting()
                commands = "; ".join(f"`{self.command(k)}`" for k in missing)
                todo = (f"run {commands} on its host" if by_hand else
                        "its log on its node says why")
                raise PipelineError(f"no stage {', '.join(map(str, missing))} joined at "
                                    f"{self.endpoint} within {timeout:g}s; {todo}, or raise "
                                    f"--join-timeout")
            if now - last_note > NOTE_S:
                commands = "; ".join(self.command(k) for k in self.waiting())
                self.say(f"still waiting for stage(s) {self.waiting()} to join at "
                         f"{self.endpoint} ({now - start:.0f}s)"
                         + (f"; on its host run: {commands}" if by_hand else ""))
                last_note = now

    def answer(self, msg):
        """A JoinAsk or JoinConfirm -> the reply (runs in the desk's thread)."""
        if not isinstance(msg, (JoinAsk, JoinConfirm)):
            return JoinRefused(-1, f"a {type(msg).__name__} is no question a joining stage "
                                   f"asks; start the stage with strata-worker --join")
        with self.lock:
            if isinstance(msg, JoinAsk) and msg.version != PROTOCOL_VERSION:
                return JoinRefused(msg.stage, f"this launch speaks protocol {PROTOCOL_VERSION}, "
                                              f"the stage {msg.version}; run the same strata "
                                              f"version on both hosts")
            refusal = self._place(msg.stage)
            if refusal is not None:
                return refusal
            if isinstance(msg, JoinAsk):
                return JoinModel(msg.stage, str(self.procs.model), self.fingerprint)
            return self._confirm(msg)

    def _place(self, stage: int) -> JoinRefused | JoinWait | None:
        """Why `stage` cannot join now, or None."""
        external = sorted(self.procs.external)
        if stage not in self.procs.external:
            runs = ("the launcher runs it" if 0 <= stage < len(self.procs.plan) else
                    f"this launch has stages 0..{len(self.procs.plan) - 1}")
            return JoinRefused(stage, f"stage {stage} does not join this launch ({runs}); "
                                      f"join as stage {' or '.join(map(str, external))}, or "
                                      f"start the launch with --external-stage {stage}")
        if stage in self.joined:
            return JoinRefused(stage, f"stage {stage} has already joined this launch (from "
                                      f"{self.joined[stage]}); each external stage joins once")
        after = stage + 1
        if after in self.procs.external and after not in self.joined:
            return JoinWait(stage, f"stage {after} joins first: stage {stage} sends to it")
        return None

    def _confirm(self, msg: JoinConfirm) -> JoinPlan | JoinRefused:
        k = msg.stage
        if msg.fingerprint != self.fingerprint:
            sentence = (f"stage {k} has a different model file (fingerprint {msg.fingerprint}, "
                        f"this launch's {self.fingerprint}); start it with --model and a copy "
                        f"of {self.procs.model}")
            self.say(f"strata-launch: refused a join: {sentence}")
            return JoinRefused(k, sentence)
        try:
            host, _ = parse_tcp(msg.listen)
        except ValueError as e:
            return JoinRefused(k, f"stage {k}'s endpoint {e}; give --listen tcp://ADDRESS:PORT")
        if host in ("*", "0.0.0.0"):   # the others connect to the address they are told
            return JoinRefused(k, f"stage {k}'s endpoint {msg.listen} does not say where the "
                                  f"other stages reach it; give --listen tcp://ADDRESS:PORT "
                                  f"with its host's address")
        self.procs.endpoints.stages[k] = msg.listen
        self.joined[k] = msg.listen
        self.say(f"stage {k} joined from {msg.listen}")
        if set(self.joined) == self.procs.external:
            self.all_joined.set()
        return JoinPlan(k, self.procs.command(k, security=False)[1:])

    def close(self) -> None:
        self.desk.close()
        self.store = None   # its server stops with it (every stage has stopped by now)


def host_rendezvous(host: str, timeout_s: float = 600.0):
    """A torch.distributed TCPStore serving on a free port of `host` (see .port) and nowhere
    else, which the stages of a torch.distributed link meet through (stage_worker/link.py)."""
    from datetime import timedelta

    from torch.distributed import TCPStore   # only a launch with such a link imports torch

    # a TCPStore binds every interface on its own: it is handed a socket bound to host only
    listening = socket.create_server((host, 0), backlog=128)
    port = listening.getsockname()[1]
    return TCPStore(host, port, None, True, timedelta(seconds=timeout_s),
                    wait_for_workers=False, master_listen_fd=listening.detach())   # it owns it
