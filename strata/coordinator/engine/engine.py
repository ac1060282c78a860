"""The engine: the synchronous Scheduler in a thread of its own, between the HTTP event loop
and the stages.

    event loop --Submit/Cancel/Stop--> queue.Queue --> engine thread: Scheduler.step() --> stages
    event loop <--Token, Finished-- loop.call_soon_threadsafe(job.events.put_nowait, ..)

Only the engine thread touches the Pipeline (ZeroMQ sockets are not thread-safe). Idle, it
waits on its command queue, and each IDLE_CHECK_S asks the Pipeline to check the stages (so a
stage that dies or hangs while no request runs fails /health and the next request); busy, it takes every waiting command between two results, so a
new request joins at the next window. After each step it publishes a snapshot of the slots
for /v1/status, so the event loop never reads the scheduler's live state, and only then posts
the step's Finished events: a client that has its answer finds it in the snapshot. A window that cannot
be built or sent ends only the requests in it (the scheduler's doing); the engine stops only
when the stages cannot go on.

Unless it may start a stage again (`restart`, strata-launch --restart-stages): then a stage
that died or hangs is started again (restart kills what is left of it), the engine waits for
its hello, and every request in a slot writes its KV again on every stage and goes on to the
tokens it would have had (Scheduler.restarted); requests that come meanwhile wait in the
queue. Only a stage that keeps failing (RESTARTS_IN_A_ROW restarts with no window back
between them) or cannot be started again stops the engine. stop() ends the wait for a hello
at once: the requests end as for any stop, and no stage is started again after it.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from strata.coordinator.grammar import Constraint
from strata.coordinator.engine.metrics import Metrics
from strata.coordinator.stages.pipeline import Pipeline, PipelineError, WindowFailed
from strata.coordinator.sampling_params import SamplingParams, TokenLogprob
from strata.coordinator.speculation.draft_choice import DraftChoice
from strata.coordinator.speculation.drafts import DraftCounts
from strata.coordinator.engine.scheduler import (DecodeWindow, Request, Scheduler,
                                                 SchedulerConfig, SlotState)
from strata.protocol.messages import Window

log = logging.getLogger("strata.engine")

IDLE_CHECK_S = 1.0   # an idle engine checks the stages this often (Pipeline.check)
RESTARTS_IN_A_ROW = 3   # restarts with no window come back between them, before giving up


class EngineDown(RuntimeError):
    """The engine cannot take requests: a stage failed, or the server is stopping."""


@dataclass(frozen=True)
class Token:
    """A generated token, as a job's events carry it: its log-probability when the request
    asks for them, and with the first token, the prompt's (a request that scores its prompt;
    position 0's is None)."""
    id: int
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Finished:
    """How a job ended; the last event on its queue."""
    reason: str              # stop | length | cancelled | error
    generated: list[int]
    text: str                # the generated text, cut before a stop string
    error: str | None = None
    down: bool = False       # the error is the engine's own (stages gone), not one window's
    grammar: bool = False    # the error is the request's grammar's (a 400, not a window's)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # one per generated token
    prompt_logprobs: list[TokenLogprob | None] | None = None    # as Token's


@dataclass
class Job:
    """One generation request as the server sees it. `events` receives each generated Token,
    then one Finished (an asyncio.Queue, or what has its put_nowait: choices.py tags each
    choice's). Fields after `grammar` are written by the engine thread only."""
    id: str
    prompt: list[int]
    params: SamplingParams     # with a concrete seed
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    grammar: Constraint | None = None   # structured output (grammar.py), the request's own
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    request: Request | None = None
    finished: bool = False

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass


@dataclass(frozen=True)
class Submit:
    job: Job


@dataclass(frozen=True)
class Cancel:
    job: Job


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class SlotView(SlotState):
    """A slot as /v1/status shows it: the scheduler's view, with its job's id and rate."""
    job: str | None = None
    tok_s: float | None = None  # generated tokens per second since the first


@dataclass(frozen=True)
class Snapshot:
    slots: tuple[SlotView, ...] = ()
    in_flight: tuple[int, ...] = ()   # per group: its windows out
    queued: int = 0
    windows: int = 0
    decode_windows: tuple[DecodeWindow | None, ...] = ()   # per group: its last decode window
    draft_counts: DraftCounts = field(default_factory=DraftCounts)   # since the start
    draft_choices: tuple[DraftChoice | None, ...] = ()   # per group: what its windows carry


def _window_kind(w: Window) -> str:
    """decode: the decoding slots' rows (with any drafts they verify); prefill: a prompt chunk
    of one slot; commit: pad rows only, carrying the commits of slots that went idle."""
    if all(s < 0 for s in w.slots):
        return "commit"
    return "prefill" if w.chunk else "decode"


class _TimedPipe:
    """The Pipeline as the scheduler sees it, timing each window for the metrics (engine
    thread only). The scheduler needs three of its methods; check is the idle engine's."""

    def __init__(self, pipe: Pipeline, cfg: SchedulerConfig, metrics: Metrics | None):
        self.pipe, self.cfg, self.metrics = pipe, cfg, metrics
        self.sent: dict[int, tuple[float, str]] = {}   # window id -> (submitted at, kind)
        self.windows = 0   # results of windows in flight (not of windows given up)

    def new_window_id(self) -> int:
        return self.pipe.new_window_id()

    def check(self) -> None:   # the engine's, while idle
        self.pipe.check()

    def submit(self, w: Window) -> None:
        kind = _window_kind(w)
        self.sent[w.id] = (time.perf_counter(), kind)
        try:
            self.pipe.submit(w)
        except Exception:
            del self.sent[w.id]
            raise
        if self.metrics is not None and kind == "decode":
            self.metrics.observe_decode_window(len(w.slots), sum(s >= 0 for s in w.slots))

    def receive(self, timeout: float | None = None):
        try:
            result, tensors = self.pipe.receive(timeout=timeout)
        except WindowFailed as e:
            self.sent.pop(e.error.window, None)
            raise
        t0, kind = self.sent.pop(result.id, (None, "unknown"))
        if t0 is None:   # a window given up by a restart (sent is cleared): no window back
            return result, tensors
        self.windows += 1
        if self.metrics is not None:
            self.metrics.observe_window(kind, time.perf_counter() - t0, result.stage_ms)
        return result, tensors


class Engine:
    def __init__(self, pipe: Pipeline, cfg: SchedulerConfig, stop_ids: frozenset[int],
                 detokenize, metrics: Metrics | None = None, stop_grace: float = 10.0,
                 restart: Callable[[int], None] | None = None):
        """restart(stage): replace the stage's process by a new one (the launcher's); None:
        a stage that fails stops the engine."""
        self.cfg, self.metrics, self.stop_grace = cfg, metrics, stop_grace
        self.restart = restart
        self.stages: list[dict] = pipe.stage_table()   # for /v1/status; new after a restart
        self.restarting: str | None = None   # which stage starts again, and why (for /health)
        self._restarts = (0, -1)   # (restarts in a row, results received at the last one)
        self.pipe = _TimedPipe(pipe, cfg, metrics)
        self.scheduler = Scheduler(self.pipe, cfg, stop_ids, detokenize)
        self.commands: queue.Queue = queue.Queue()
        self.failure: str | None = None      # why the engine stopped serving, once it has
        self.snapshot = Snapshot()
        self._jobs: dict[int, Job] = {}      # scheduler request id -> job (engine thread)
        self._lock = threading.Lock()        # submit vs the thread's last drain
        self._accepting = True
        self._stopping = False               # the engine thread took the Stop
        self._stop_asked = threading.Event()   # stop() was called (any thread)
        # a step's Finished events wait here until the snapshot shows them: a client that
        # has its answer finds its request gone from /v1/status and counted in /metrics
        self._held: list[tuple[Job, Finished]] | None = None
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._publish()

    # --- the event loop's side ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None and self._accepting

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self._accepting:
                raise EngineDown(self.failure or "the server is stopping")
            self.commands.put(Submit(job))

    def cancel(self, job: Job) -> None:
        """The job ends at its slot's next window; no token of it is delivered after that."""
        self.commands.put(Cancel(job))

    def stop(self, wait: bool = True) -> None:
        """Refuse new jobs, cancel every job, let the windows in flight return, end the thread;
        wait: until the thread has ended (or stop_grace has passed)."""
        with self._lock:
            self._accepting = False
        self._stop_asked.set()   # a wait for a stage started again ends too
        self.commands.put(Stop())
        if wait and self._thread.is_alive():
            self._thread.join(self.stop_grace + 2)

    @property
    def queued(self) -> int:
        return self.snapshot.queued + self.commands.qsize()

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                try:
                    # idle (no commits left to carry either): sleep until a command comes
                    self._take_commands(block=self.scheduler.idle and not self._stopping)
                    if self._stopping and self.scheduler.idle:
                        return
                    # stopping, a stage that never answers must not hold the server up for ever
                    self._held = []
                    self.scheduler.step(timeout=self.stop_grace if self._stopping else None)
                except PipelineError as e:
                    self._start_again(e)
                self._publish()
        except Exception as e:  # PipelineError mostly: a stage is gone
            if not self._stop_asked.is_set():   # only a failure before the stop counts
                self.failure = f"the stages stopped serving: {e}"
                log.error("%s", self.failure)
        finally:
            with self._lock:
                self._accepting = False
            reason = self.failure or "the server is stopping"
            for job in list(self._jobs.values()):
                self._end(job, Finished("error", list(job.request.seq.generated), "", reason,
                                        down=True))
            while not self.commands.empty():
                command = self.commands.get_nowait()
                if isinstance(command, Submit):
                    self._end(command.job, Finished("error", [], "", reason, down=True))
            self._publish()

    def _start_again(self, error: PipelineError) -> None:
        """Start the stage that `error` names again and let the requests in slots rebuild
        their KV; raises a PipelineError when that cannot be done."""
        before = {row["stage"]: row["restarts"] for row in self.stages}
        while True:
            if self.restart is None or error.stage is None or self._stop_asked.is_set():
                raise error
            in_a_row, at = self._restarts
            in_a_row = in_a_row + 1 if self.pipe.windows == at else 1
            if in_a_row > RESTARTS_IN_A_ROW:
                raise PipelineError(f"{error} (after {RESTARTS_IN_A_ROW} restarts in a row "
                                    f"with no window back between them)")
            self._restarts = (in_a_row, self.pipe.windows)
            stage = error.stage
            self.restarting = f"stage {stage} is starting again: {error}"
            log.warning("%s; starting stage %d again", error, stage)
            try:
                self.restart(stage)
                self.pipe.pipe.rejoin(stage, on_wait=self._unless_stopping)
            except PipelineError as again:   # it failed again, or another stage did
                error = again
                continue
            break
        self.pipe.sent.clear()   # the windows in flight are given up
        self.scheduler.restarted()
        self.stages = self.pipe.pipe.stage_table()
        self.restarting = None
        # every stage that said hello again, in this wait or in one that another stage's
        # failure ended
        for row in self.stages:
            again = row["restarts"] - before.get(row["stage"], 0)
            if again <= 0:
                continue
            if self.metrics:
                self.metrics.stage_restarts.labels(str(row["stage"])).inc(again)
            log.warning("stage %d started again (pid %s)", row["stage"], row.get("pid"))
        log.warning("the requests in slots rebuild their KV")

    def _unless_stopping(self, waited: float) -> None:
        """While a stage starts again: a stop ends the wait for its hello."""
        if self._stop_asked.is_set():
            raise PipelineError("the server is stopping")

    def _take_commands(self, block: bool) -> None:
        while True:
            try:
                command = self.commands.get(block=block, timeout=IDLE_CHECK_S if block else None)
            except queue.Empty:
                if not block:
                    return
                self.pipe.check()   # raises PipelineError when a stage is gone
                continue
            block = False
            if isinstance(command, Submit):
                self._submit(command.job)
            elif isinstance(command, Cancel):
                req = command.job.request
                if req is not None and not req.done:
                    self.scheduler.cancel(req)
            else:
                assert isinstance(command, Stop), command
                self._stopping = True
                with self._lock:
                    self._accepting = False
                for j in list(self._jobs.values()):
                    self.scheduler.cancel(j.request)

    def _submit(self, job: Job) -> None:
        if self._stopping:
            self._end(job, Finished("error", [], "", "the server is stopping", down=True))
            return
        try:
            job.request = self.scheduler.submit(
                job.prompt, job.params, on_token=functools.partial(self._on_token, job),
                on_done=functools.partial(self._on_done, job), grammar=job.grammar)
        except ValueError as e:  # RequestError: the server checks first, so this is a backstop
            self._end(job, Finished("error", [], "", str(e)))
            return
        self._jobs[job.request.id] = job
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(job.prompt))

    def _on_token(self, job: Job, token: int) -> None:
        now = time.monotonic()
        if job.first_token is None:
            job.first_token = now
            if self.metrics:
                self.metrics.ttft.observe(now - job.submitted)
        job.last_token, job.tokens = now, job.tokens + 1
        if self.metrics:
            self.metrics.generated_tokens.inc()
        seq = job.request.seq
        prompt = (list(seq.prompt_logprobs) if job.tokens == 1
                  and seq.params.prompt_logprobs is not None else None)
        job.post(Token(token, seq.logprobs[-1] if seq.params.logprobs is not None else None,
                       prompt))

    def _on_done(self, job: Job, req: Request) -> None:
        seq = req.seq
        prompt = list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None
        self._end(job, Finished(seq.finish_reason, list(seq.generated), seq.final_text(),
                                req.error, grammar=seq.grammar_failed,
                                logprobs=list(seq.logprobs), prompt_logprobs=prompt))

    def _end(self, job: Job, fin: Finished) -> None:
        if job.finished:
            return
        job.finished = True
        if job.request is not None:
            self._jobs.pop(job.request.id, None)
        if self.metrics:
            self.metrics.finished.labels(fin.reason).inc()
            self.metrics.request_seconds.observe(time.monotonic() - job.submitted)
        if self._held is not None:  # in a step: posted by _publish
            self._held.append((job, fin))
        else:
            job.post(fin)

    def _publish(self) -> None:
        snap = self.scheduler.snapshot()
        now = time.monotonic()
        if self.metrics:  # the drafts verified since the last snapshot
            last = self.snapshot
            self.metrics.observe_drafts(snap.draft_counts.since(last.draft_counts))
        self.snapshot = Snapshot(tuple(self._view(s, now) for s in snap.slots), snap.in_flight,
                                 snap.queued, self.pipe.windows, snap.decode_windows,
                                 snap.draft_counts, snap.draft_choices)
        held, self._held = self._held or [], None
        for job, fin in held:
            job.post(fin)

    def _view(self, s: SlotState, now: float) -> SlotView:
        job = self._jobs.get(s.request) if s.request is not None else None
        rate = None
        if job is not None and job.tokens > 1 and job.last_token > job.first_token:
            # until now, so a stalled slot's rate falls
            rate = (job.tokens - 1) / (now - job.first_token)
        return SlotView(**vars(s), job=job.id if job else None, tok_s=rate)

