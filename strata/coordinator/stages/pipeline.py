"""The coordinator's mechanism: sockets to the stages, the hello handshake, windows out and
results in. Policy (what to run next) lives elsewhere, so a custom coordinator reuses this.

    pipe = Pipeline(inbox="ipc:///tmp/x/inbox", first_stage="ipc:///tmp/x/stage0")
    pipe.wait_for_hellos(expected)           # one Expect per stage
    pipe.submit(Window(...)); result = pipe.receive()

While it waits for hellos or results, it asks the stages heartbeats and watches the windows'
time (liveness.py): a stage that stops answering ends the wait with a PipelineError naming it.
A coordinator that idles calls check() now and then (about once a second) to hear of it then.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from strata.coordinator.stages.liveness import Liveness
from strata.protocol import transport
from strata.protocol.keys import CurveKeys, stage_name
from strata.protocol.messages import (PROTOCOL_VERSION, Error, Heartbeat, Hello, ProtocolError,
                                      Result, Shutdown, Window)
from strata.trace import Trace

log = logging.getLogger("strata.pipeline")


class PipelineError(RuntimeError):
    """The stages cannot go on (a stage died, refused its hello, or stopped answering).
    `stage`: the stage to blame, where one is known (a restart starts it again)."""

    def __init__(self, message: str, stage: int | None = None):
        super().__init__(message)
        self.stage = stage


class WindowFailed(RuntimeError):
    """A stage refused one window; the pipeline itself is fine."""

    def __init__(self, error: Error):
        super().__init__(f"stage {error.stage}: {error.message}")
        self.error = error


@dataclass(frozen=True)
class Expect:
    """What the coordinator expects a stage to say in its hello."""
    stage: int
    layer_start: int
    layer_end: int
    fingerprint: str
    slots: int
    ctx: int


class Pipeline:
    def __init__(self, inbox: str, first_stage: str,
                 check_alive: Callable[[], None] = lambda: None, trace: str | None = None,
                 stage_timeout: float | None = None,
                 keys: CurveKeys | None = None, insecure: bool = False):
        """check_alive raises PipelineError when a stage process is gone (launch provides it).
        trace: a JSON file for the timeline of windows sent and results received.
        stage_timeout: seconds after which a stage that does not answer, or a window that does
        not come back, ends the pipeline (None: the default of liveness.py).
        keys: the coordinator's CURVE identity (CurveKeys.load(DIR, "coordinator")): the
        inbox lets in only stages whose key is in DIR. insecure: without keys, allow a tcp://
        inbox beyond loopback (transport.check_tcp)."""
        self.liveness = Liveness(stage_timeout)
        self.trace = Trace("coordinator", trace)
        self.sockets = transport.Sockets(keys, insecure)   # unix:// or ZeroMQ, by endpoint
        self.inbox = self.sockets.pull(inbox)
        self.to_first = self.sockets.push(first_stage, peer=stage_name(0))
        self.check_alive = check_alive
        self.hellos: dict[int, Hello] = {}
        self.expected: dict[int, Expect] = {}
        self.restarts: dict[int, int] = {}   # stage -> times it said hello again (rejoin)
        self.next_window_id = 0
        # with GPU stages a result is usually a few ms away: poll without sleeping this long
        # before blocking (set from the hellos; CPU stages need the cores a spin would take)
        self.spin_s = 0.0

    def wait_for_hellos(self, expected: list[Expect], timeout: float | None = 120.0,
                        on_wait: Callable[[float], None] = lambda waited: None) -> list[Hello]:
        """Wait until every stage has said hello and matches what was expected."""
        want = self.expected = {e.stage: e for e in expected}
        start = time.monotonic()
        while len(self.hellos) < len(want):
            waited = time.monotonic() - start
            if timeout is not None and waited > timeout:
                missing = sorted(set(want) - set(self.hellos))
                refused = (f"; the inbox refused {self.sockets.refused} peer(s) whose key is "
                           f"not in the keys directory: give each stage its own key from it"
                           if self.sockets.refused else "")
                raise PipelineError(f"stage(s) {missing} did not say hello within "
                                    f"{timeout:.0f}s{refused}")
            on_wait(waited)
            msg = self._poll(0.2)
            if msg is None:
                continue
            if isinstance(msg, Error):
                raise PipelineError(f"stage {msg.stage} failed at start: {msg.message}",
                                    stage=msg.stage)
            if isinstance(msg, Hello):
                self._hello(msg, want)
        if all(h.device.startswith("cuda") for h in self.hellos.values()):
            self.spin_s = transport.SPIN_S
        return [self.hellos[s] for s in sorted(self.hellos)]

    def _hello(self, h: Hello, want: dict[int, Expect]) -> None:
        self._check_hello(h, want)
        self.hellos[h.stage] = h
        if h.listen:
            self.liveness.add(h.stage, self._open_push(h.listen, h.stage))

    def rejoin(self, stage: int, timeout: float | None = 300.0,
               on_wait: Callable[[float], None] = lambda waited: None) -> list[Hello]:
        """Wait for the hello of `stage`, started again (its process was replaced) after a
        PipelineError, and of any other stage started again before it that has not said
        hello yet (a stage that failed while another was starting again); every window in
        flight is given up, and what comes meanwhile from the stages that stayed (the
        Results and Errors of those windows) is dropped. Returns the hellos that came."""
        assert stage in self.expected, stage
        self.liveness.drop(stage)
        self.hellos.pop(stage, None)
        start, came = time.monotonic(), []
        while len(self.hellos) < len(self.expected):
            waited = time.monotonic() - start
            missing = sorted(set(self.expected) - set(self.hellos))
            if timeout is not None and waited > timeout:
                raise PipelineError(f"stage(s) {missing}, started again, did not say hello "
                                    f"within {timeout:.0f}s; their logs may say why",
                                    stage=missing[0])
            on_wait(waited)
            msg = self._poll(0.2)
            if isinstance(msg, Error) and msg.stage in missing and msg.window < 0:
                raise PipelineError(f"stage {msg.stage} failed at start: {msg.message}",
                                    stage=msg.stage)
            if isinstance(msg, Hello) and msg.stage in missing:
                self._hello(msg, self.expected)
                self.restarts[msg.stage] = self.restarts.get(msg.stage, 0) + 1
                came.append(msg)
            elif msg is not None:
                log.info("dropped a %s while stage(s) %s start again: its window was given "
                         "up", type(msg).__name__, missing)
        return came

    def stage_table(self) -> list[dict]:
        """The stages as their hellos describe them, with how often each was started again."""
        return [{"stage": h.stage, "layers": [h.layer_start, h.layer_end], "device": h.device,
                 "pid": h.pid, "restarts": self.restarts.get(h.stage, 0),
                 "weights": h.weights,
                 "memory": dict(zip(("weights", "kv_cache", "scratch", "held"), h.memory))}
                for _, h in sorted(self.hellos.items())]

    @staticmethod
    def _check_hello(h: Hello, want: dict[int, Expect]) -> None:
        if h.version != PROTOCOL_VERSION:
            raise PipelineError(f"stage {h.stage} speaks protocol {h.version}, this coordinator "
                                f"{PROTOCOL_VERSION}; run the same strata version on both")
        e = want.get(h.stage)
        if e is None:
            raise PipelineError(f"a stage {h.stage} said hello, but only stages "
                                f"{sorted(want)} were expected")
        if (h.layer_start, h.layer_end) != (e.layer_start, e.layer_end):
            raise PipelineError(f"stage {h.stage} holds layers [{h.layer_start}, {h.layer_end}) "
                                f"but [{e.layer_start}, {e.layer_end}) was expected; start it "
                                f"with --layers {e.layer_start}:{e.layer_end}")
        if h.fingerprint != e.fingerprint:
            raise PipelineError(f"stage {h.stage} loaded a different model (fingerprint "
                                f"{h.fingerprint}, expected {e.fingerprint}); start it with the "
                                f"same --model file")
        if (h.slots, h.ctx) != (e.slots, e.ctx):
            raise PipelineError(f"stage {h.stage} has {h.slots} slots of {h.ctx} positions, "
                                f"expected {e.slots} of {e.ctx}")

    def _open_push(self, endpoint: str, stage: int):
        try:
            return self.sockets.push(endpoint, peer=stage_name(stage))
        except transport.TransportError as e:
            raise PipelineError(f"cannot reach a stage for its heartbeats: {e}") from None

    def new_window_id(self) -> int:
        self.next_window_id += 1
        return self.next_window_id

    def submit(self, window: Window) -> None:
        self.trace.mark(window.id, "chunk" if window.chunk else "submit")
        try:
            transport.send(self.to_first, window)
        except transport.TransportError as e:  # the first stage's socket is gone
            raise PipelineError(f"cannot send to stage 0: {e}") from None
        self.liveness.submitted(window.id, None if window.chunk else len(window.slots))

    def receive(self, timeout: float | None = None) -> tuple[Result, list[np.ndarray]]:
        """The next result from the last stage. Raises WindowFailed when a stage refused a
        window, PipelineError when a stage died or nothing came within timeout. A message
        that is malformed or not a Result or Error is dropped with a log line."""
        start = time.monotonic()
        if self.spin_s:
            transport.spin(self.inbox, self.spin_s)
        while True:
            got = self._poll(0.2, with_tensors=True)
            if got is not None:
                msg, tensors = got
                if isinstance(msg, Result):
                    self.trace.mark(msg.id, "result")
                    self.liveness.returned(msg.id, result=True)
                    return msg, tensors
                if isinstance(msg, Error):
                    self.liveness.returned(msg.window, result=False)
                    raise WindowFailed(msg)
                log.warning("dropped a %s in the coordinator's inbox: after the hellos only "
                            "Results and Errors come there", type(msg).__name__)
                continue
            if timeout is not None and time.monotonic() - start > timeout:
                raise PipelineError(f"no result from the stages within {timeout:.0f}s")

    def check(self) -> None:
        """Between windows: take the heartbeats' answers that came, ask the next ones, and
        raise PipelineError if a stage is gone or hangs. Anything else in the inbox (nothing
        is in flight) is dropped with a log line."""
        while (got := self._poll(0.0)) is not None:
            log.warning("dropped a %s in the coordinator's inbox: no window is in flight",
                        type(got).__name__)

    def _poll(self, seconds: float, with_tensors: bool = False):
        """The next message that is not a heartbeat's answer, within `seconds`; None when none
        came. With the inbox empty, checks that every stage is alive and answers."""
        self.liveness.ask()
        if self.inbox.poll(int(seconds * 1000)):
            try:
                msg, tensors = transport.recv(self.inbox)
            except ProtocolError as e:  # no stage sends one: a process that is none of them
                log.warning("dropped a malformed message in the coordinator's inbox: %s", e)
                return None
            except transport.TransportError as e:
                raise PipelineError(f"the coordinator's inbox failed: {e}") from e
            if not isinstance(msg, Heartbeat):
                return (msg, tensors) if with_tensors else msg
            self.liveness.heard(msg)
            if self.inbox.poll(0):
                return None
        self.check_alive()
        hung = self.liveness.overdue()
        if hung is not None:
            raise PipelineError(hung, stage=self.liveness.culprit)
        return None

    def shutdown(self, reason: str = "coordinator exit") -> None:
        """Tell the stages to leave: Shutdown to the first, which passes it down the chain
        after its pending answers, and straight to each stage whose predecessor has gone (a
        chain cut by a dead stage would leave the stages after it waiting to be terminated)."""
        cut = self.liveness.cut_off()
        self.liveness.close()   # no more heartbeats: the stages are leaving
        for sock in [self.to_first] + cut:
            try:
                transport.send(sock, Shutdown(reason))
            except transport.TransportError:
                pass

    def close(self) -> None:
        self.trace.close()
        self.liveness.close()
        self.sockets.close(linger_ms=500)
