"""Telling a stage that hangs from one that is busy: heartbeats and a window deadline.

The coordinator asks every stage that said hello a Heartbeat, one at a time: the next goes
once the stage has answered the last, and HEARTBEAT_S after it went. A stage answers from its main loop when it takes
the heartbeat from its inbox, after the windows queued before it; so a stage busy with a long
window answers late, and one that is stopped (SIGSTOP, a debugger) or stuck on its device never
does. Past the stage timeout, a stage that has not answered is taken for hung, and so is a
window that has not come back (lost by a stage that still answers). A stage whose socket
closed has died: that needs no timeout (an --external-stage's process is not the launcher's to
watch).

The stage timeout is --stage-timeout, or by default twice the slowest window seen so far (from
its submission to its Result, queueing behind other windows included) plus MARGIN_S, and at
least FLOOR_S: a long prompt chunk is not a hang. Until a window has come back, FIRST_S: the
first windows compile kernels and may read a long prompt on a slow device, and a stage answers
heartbeats only between windows. FIRST_S again while a decode window of a row count not seen
back yet is in flight: a stage may compile kernels for its tiles (on a cold Triton cache,
several seconds each) and capture a CUDA graph for it.

Only the thread that reads the inbox asks and judges (Pipeline._poll), and it judges only when
the inbox is empty: a coordinator that did not read for a while (paused in a debugger, or busy
elsewhere) first reads the answers waiting there.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from strata.config_error import ConfigError
from strata.protocol import transport
from strata.protocol.messages import Heartbeat
from strata.protocol.peers import PeerWatch

log = logging.getLogger("strata.liveness")

HEARTBEAT_S = 0.5   # a stage that answered is asked again after this long
FLOOR_S = 10.0      # the default stage timeout is at least this...
MARGIN_S = 5.0      # ...and twice the slowest window seen plus this
FIRST_S = 120.0     # the default stage timeout until a window has come back


@dataclass
class _Asked:
    """One stage's heartbeats: the socket to it and the last question."""
    sock: object
    watch: PeerWatch              # on sock: the stage's process has gone
    seq: int = 0
    sent: float = float("-inf")   # when heartbeat `seq` went (clock)
    answered: bool = True         # heartbeat `seq` has its answer


class Liveness:
    def __init__(self, stage_timeout: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """stage_timeout: seconds; None: the default (see the module's docstring)."""
        if stage_timeout is not None and not 0 < stage_timeout < float("inf"):
            raise ConfigError("stage_timeout", f"{{stage_timeout}} {stage_timeout:g} is not a "
                              f"positive number of seconds", "give e.g. 30, or leave it out "
                              "for the default")
        self.fixed, self.clock = stage_timeout, clock
        self.stages: dict[int, _Asked] = {}
        self.windows: dict[int, float] = {}   # window id in flight -> when it was submitted
        self.kinds: dict[int, int] = {}       # decode window id in flight -> its rows
        self.seen: set[int] = set()           # the rows of the decode windows returned so far
        self.slowest: float | None = None     # seconds: the slowest window returned so far
        self.culprit: int | None = None       # the stage that overdue() last named, if any

    @property
    def timeout(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if self.slowest is None or any(k not in self.seen for k in self.kinds.values()):
            return FIRST_S
        return max(FLOOR_S, 2 * self.slowest + MARGIN_S)

    def add(self, stage: int, sock) -> None:
        """Ask `stage` heartbeats through `sock` (a PUSH socket to its input) from now on."""
        self.stages[stage] = _Asked(sock, PeerWatch(sock))

    def drop(self, stage: int) -> None:
        """`stage` is being replaced: no heartbeats to it until add() (its new hello), and
        every window in flight is given up."""
        asked = self.stages.pop(stage, None)
        if asked is not None:
            asked.watch.close()
            asked.sock.close(linger=0)
        self.windows.clear()
        self.kinds.clear()

    def submitted(self, window: int, kind: int | None = None) -> None:
        """Window `window` went; kind: a decode window's rows (None: a prompt chunk's, or
        a window that needs no grace of its own)."""
        self.windows[window] = self.clock()
        if kind is not None:
            self.kinds[window] = kind

    def returned(self, window: int, result: bool) -> None:
        """The window's Result came (result=True: its time counts), or a stage's Error."""
        sent = self.windows.pop(window, None)
        kind = self.kinds.pop(window, None)
        if result and sent is not None:
            self.slowest = max(self.slowest or 0.0, self.clock() - sent)
            if kind is not None:
                self.seen.add(kind)

    def heard(self, answer: Heartbeat) -> None:
        asked = self.stages.get(answer.stage)
        if asked is None:
            log.warning("dropped a heartbeat from stage %d, which has not said hello",
                        answer.stage)
        elif answer.seq == asked.seq:   # (else: an answer to an older question)
            asked.answered = True

    def ask(self) -> None:
        """Send each stage that answered its last heartbeat HEARTBEAT_S ago the next one."""
        now = self.clock()
        for asked in self.stages.values():
            if asked.answered and now - asked.sent >= HEARTBEAT_S:
                asked.seq += 1
                asked.sent, asked.answered = now, False
                try:
                    transport.send(asked.sock, Heartbeat(asked.seq))
                except transport.TransportError as e:   # judged as unanswered
                    log.warning("cannot send a heartbeat: %s", e)

    def overdue(self) -> str | None:
        """Why the stages cannot go on: a stage has gone, or has not answered within the stage
        timeout, or a window has not come back within it; None while all is well. Call with
        the inbox empty. `culprit` is then the stage named, if one is."""
        self.culprit = None
        for stage, asked in self.stages.items():
            if asked.watch.gone():
                self.culprit = stage
                return (f"stage {stage} has gone (its socket closed): it exited or was killed; "
                        f"its log may say why")
        now, limit = self.clock(), self.timeout
        # stages that owe an answer for longer than a stage that takes its messages takes
        owing = sorted((now - a.sent, k) for k, a in self.stages.items()
                       if not a.answered and now - a.sent > HEARTBEAT_S)
        late = sorted((sent, w) for w, sent in self.windows.items() if now - sent > limit)
        if owing and (owing[-1][0] > limit or late):
            waited, stage = owing[-1]
            self.culprit = stage
            window = f" (window {late[0][1]} went {now - late[0][0]:.1f} s ago)" if late else ""
            return (f"stage {stage} has not answered for {waited:.1f} s{window}, past the stage "
                    f"timeout of {limit:.1f} s: it hangs, stopped or stuck on its device; its "
                    f"log may say why, and a stage that is only slow needs a larger "
                    f"--stage-timeout")
        if late:
            sent, window = late[0]
            return (f"window {window} has not come back in {now - sent:.1f} s (stage timeout "
                    f"{limit:.1f} s), though every stage answers its heartbeats: a stage lost "
                    f"it; the stage logs may say why")
        return None

    def cut_off(self) -> list:
        """The sockets to the stages (past the first) whose predecessor has gone or is not
        there: a message passed down the chain cannot reach them."""
        return [asked.sock for stage, asked in sorted(self.stages.items())
                if stage > 0 and (stage - 1 not in self.stages
                                  or self.stages[stage - 1].watch.gone())]

    def close(self) -> None:
        """No more heartbeats (the stages are told to leave); before the sockets close."""
        for asked in self.stages.values():
            asked.watch.close()
        self.stages.clear()
