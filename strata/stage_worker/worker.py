"""The stage worker: receive a window, commit, compute this stage's layers, pass it on.

Stage k binds `listen` (a PULL socket) and pushes to stage k+1's `listen`; the last stage pushes
results to the coordinator's inbox. Hellos and errors also go to the inbox. Activations never
pass through the coordinator.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from strata.config_error import ConfigError
from strata.kernels.sampling import SamplingRow, sample_row
from strata.model.gguf_file import ModelFile
from strata.protocol import transport
from strata.protocol.messages import (PROTOCOL_VERSION, Error, Hello, ProtocolError, Result,
                                      Shutdown, Window)
from strata.stage_worker.graphs import WindowRunner
from strata.stage_worker.link import StageLink
from strata.stage_worker.model import KVCache, Rows, StageModel
from strata.trace import Trace

log = logging.getLogger("strata.worker")
ACTIVATION_DTYPES = ("float32", "uint16")  # fp32 from CPU stages, bf16 bits from CUDA stages
WARM_SHAPES = ((8, False), (32, True))  # (rows, chunk): the default decode window and chunk


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    stage: int
    layer_start: int
    layer_end: int
    listen: str            # endpoint this stage binds for its input
    coordinator: str       # the coordinator's inbox (hello, errors, and results if last)
    next: str | None       # the next stage's listen endpoint; None on the last stage
    device: str = "cpu"
    slots: int = 1
    ctx: int = 2048
    graph_cache: int = 8   # CUDA graphs kept (one per window shape); 0 = eager
    link: str = "zmq"      # activations to/from neighbours: zmq frames, or nccl / gloo
    link_init: str = ""    # torch.distributed init method of the link (e.g. file://...)
    link_world: int = 1    # stages in the link (every stage of the launch)
    trace: str = ""        # write a timeline of the windows here on exit (strata/trace.py)

    def __post_init__(self):
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"layer range {self.layer_start}:{self.layer_end} is empty")
        check_stage_settings(self.slots, self.ctx, self.graph_cache)
        if self.link != "zmq" and not self.link_init:
            raise ConfigError("link_init", f"{{link}} {self.link} needs {{link_init}} "
                              f"(e.g. file:///tmp/run/link)")


def check_stage_settings(slots: int, ctx: int, graph_cache: int) -> None:
    """The settings every stage of a launch shares; a launcher checks them before it spawns."""
    for name, value in (("slots", slots), ("ctx", ctx)):
        if value < 1:
            raise ConfigError(name, f"{{{name}}} {value} is below 1", "use 1 or more")
    if graph_cache < 0:
        raise ConfigError("graph_cache", f"{{graph_cache}} {graph_cache} is below 0",
                          "use 0 to run windows eagerly")


class RowError(ValueError):
    """A window whose rows this stage cannot run (the coordinator gets the sentence)."""


class StageWorker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        t0 = time.perf_counter()
        file = ModelFile(cfg.model)
        if cfg.layer_end > file.config.n_layers:
            raise ValueError(f"layer range {cfg.layer_start}:{cfg.layer_end} exceeds the model's "
                             f"{file.config.n_layers} layers")
        self.fingerprint = file.fingerprint()
        if torch.device(cfg.device).type == "cuda":
            torch.cuda.set_device(cfg.device)  # Triton launches and graphs go to this device
        self.model = StageModel(file, cfg.layer_start, cfg.layer_end, ctx=cfg.ctx,
                                device=cfg.device)
        self.cache = KVCache(cfg.layer_end - cfg.layer_start, cfg.slots, file.config, cfg.ctx,
                             self.model.device, self.model.dtype,
                             trash_slot=self.model.row_tensors)
        self.runner = WindowRunner(self.model, self.cache, cfg.graph_cache)
        # CPU stages compute on the cores a spinning neighbour would take: they block at once
        self.spin_s = transport.SPIN_S if self.model.device.type == "cuda" else 0.0
        warm_s = self.warm_up()
        self.trace = Trace(f"stage{cfg.stage}", cfg.trace or None, self.model.device)
        self.unsent = None  # (event, window, t0, host tokens, frames) of a last-stage window
        self.link = None
        if cfg.link != "zmq":
            self.link = StageLink(cfg.link, cfg.link_init, cfg.stage, cfg.link_world,
                                  self.model.device)
            self.link.warm_up(file.config.d_model, self.model.dtype)
            log.info("stage %d: activations over %s (%d stages)", cfg.stage, cfg.link,
                     cfg.link_world)
        log.info("stage %d: layers [%d, %d) on %s (%s, graph cache %d) loaded in %.1fs "
                 "(graphs warmed in %.1fs); KV cache %.1f MiB", cfg.stage, cfg.layer_start,
                 cfg.layer_end, cfg.device, str(self.model.dtype).removeprefix("torch."),
                 self.runner.capacity, time.perf_counter() - t0, warm_s,
                 self.cache.nbytes() / 2**20)
        self.sockets = transport.Sockets()   # unix:// or ZeroMQ, by endpoint
        self.inbox = self.sockets.pull(cfg.listen)
        self.to_coordinator = self.sockets.push(cfg.coordinator)
        self.to_next = self.sockets.push(cfg.next) if cfg.next else None

    def warm_up(self) -> float:
        """Compile the kernels and capture the graphs of the usual window shapes before the
        hello, so that no request pays for them. Pad rows only: nothing but the cache's trash
        slot is written. Returns the seconds it took."""
        t0 = time.perf_counter()
        if not self.runner.capacity:
            return 0.0
        m = self.model
        with torch.inference_mode():
            for n, chunk in WARM_SHAPES:
                inputs = (torch.zeros(n, dtype=torch.long) if m.first
                          else torch.zeros(n, m.cfg.d_model, dtype=m.dtype))
                hidden = self.runner.layers(inputs, Rows([-1] * n, [0] * n), chunk=chunk)
                if m.last and self.runner.window_head is None:
                    self.runner.logits(hidden[:1])
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def hello(self) -> Hello:
        c = self.cfg
        return Hello(PROTOCOL_VERSION, c.stage, c.layer_start, c.layer_end, c.device,
                     self.fingerprint, os.getpid(), c.slots, c.ctx)

    def serve(self) -> None:
        transport.send(self.to_coordinator, self.hello())
        with torch.inference_mode():  # entered once: ~14 us a window on the lent VMs
            self._serve()
        self.close()

    def _serve(self) -> None:
        while True:
            self._await_unsent()
            try:
                msg, tensors = transport.recv(self.inbox, self.spin_s)
            except ProtocolError as e:
                self._error(-1, f"malformed message: {e}")
                continue
            if isinstance(msg, Shutdown):
                self._send_unsent()
                if self.to_next is not None:
                    transport.send(self.to_next, msg)
                log.info("stage %d: shutting down (%s)", self.cfg.stage, msg.reason)
                break
            if not isinstance(msg, Window):
                self._error(-1, f"stage {self.cfg.stage} does not accept {type(msg).__name__}")
                continue
            self.trace.mark(msg.id, "came")
            try:
                self.run_window(msg, tensors)
            except (RowError, ProtocolError) as e:
                self._error(msg.id, str(e))

    def run_window(self, w: Window, tensors: list[np.ndarray]) -> None:
        """Runs inside serve()'s inference mode (as greedy_tokens and sample do)."""
        t0 = time.perf_counter()
        receiving = None
        if self.link is not None and not self.model.first:
            # posted first of all (the previous stage sent these whatever this stage decides);
            # waited for only when needed, so the checks below overlap the transfer
            receiving = self.link.recv(len(w.slots), self.model.cfg.d_model, self.model.dtype)
        try:
            self._check(w, tensors)
            self._check_gaps(w)
        except RowError:
            if receiving is not None:
                receiving.wait()  # complete the transfer: the link stays in step
            raise
        for slot, length in w.commits:
            self.cache.trim(slot, length)
        self.trace.mark(w.id, "checked")
        rows = Rows(w.slots, w.positions)
        if self.model.first:
            inputs = w.tokens   # the runner writes them into its staging buffer
        elif receiving is not None:
            inputs = receiving.wait()
        else:
            inputs = transport.frame_tensor(tensors[0])  # bf16 bits or fp32, on the host

        def launching() -> None:  # host work done, the kernels go next
            self.trace.mark(w.id, "launching")
            self.trace.gpu_begin(w.id)

        hidden = self.runner.layers(inputs, rows, chunk=w.chunk, launching=launching)
        self.trace.gpu_end()
        self.trace.mark(w.id, "queued")
        for s, p in zip(w.slots, w.positions):
            if s >= 0:
                self.cache.filled[s] = max(self.cache.filled[s], p + 1)
        if not self.model.last:
            if self.link is not None:
                self.link.send(hidden)  # posted before the header goes (see link.py); stage_ms
                frames = []             # is then host time: nothing waits for the device
            else:
                frames = [transport.tensor_frame(hidden)]  # waits for the device
            w.stage_ms.append((time.perf_counter() - t0) * 1e3)
            self.trace.mark(w.id, "sent")   # marked as it goes: the receiver may be quicker
            transport.send(self.to_next, w, frames)
            return
        self._send_unsent()  # the previous window: computed before this one, which is enqueued
        if self.model.device.type == "cuda" and not w.want_logits and all(
                t <= 0.0 for t in w.temperature):
            # Greedy rows (or none): their tokens come from the device's argmax, copied into
            # pinned memory behind the window's kernels. The Result waits until the next window
            # is enqueued or this stage is idle, so the GPU does not idle while this host
            # syncs, answers and takes the next window (a Result says the window is computed).
            tokens = self.greedy_tokens(w, hidden)
            done = torch.cuda.Event()
            done.record()
            self.unsent = (done, w, t0, tokens, [])
            return
        tokens, logits = self.sample(w, hidden)
        extra = [logits.cpu().numpy()] if w.want_logits else []
        w.stage_ms.append((time.perf_counter() - t0) * 1e3)
        self.trace.mark(w.id, "sent")
        transport.send(self.to_coordinator, Result(w.id, tokens, w.stage_ms), extra)

    def _await_unsent(self) -> None:
        """Answer the window in hand once the device has computed it, unless another window
        comes first: that one is enqueued behind it (run_window answers this one then), so a
        header that comes while the device works is taken at once, not after the answer."""
        if self.unsent is None:
            return
        done = self.unsent[0]
        while not self.inbox.poll(0):
            if done.query():
                self._send_unsent()
                return

    def _send_unsent(self) -> None:
        if self.unsent is None:
            return
        done, w, t0, tokens, extra = self.unsent  # tokens: a function, read after the sync
        self.unsent = None
        done.synchronize()
        w.stage_ms.append((time.perf_counter() - t0) * 1e3)
        result = Result(w.id, tokens(), w.stage_ms)
        self.trace.mark(w.id, "sent")
        transport.send(self.to_coordinator, result, extra)

    def greedy_tokens(self, w: Window, hidden: torch.Tensor) -> Callable[[], list[int]]:
        """The argmax of each sampled row, copied without waiting into pinned host memory;
        the returned function reads them (call it once the device is past this point). No
        pageable copy to the device either: that would wait for the window's kernels."""
        if not w.sample_rows:
            return list
        if self.runner.window_head is not None:   # argmax of every row, from the graph
            every = torch.empty(len(w.slots), dtype=torch.long, pin_memory=True)
            every.copy_(self.runner.window_head[1], non_blocking=True)

            def read() -> list[int]:
                got = every.tolist()
                return [got[r] for r in w.sample_rows]
            return read
        index = torch.tensor(w.sample_rows, dtype=torch.long).pin_memory()
        picked = hidden[index.to(hidden.device, non_blocking=True)]
        host = torch.empty(len(w.sample_rows), dtype=torch.long, pin_memory=True)
        host.copy_(self.runner.logits(picked)[1], non_blocking=True)
        return host.tolist

    def sample(self, w: Window, hidden: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """Tokens of the sampled rows, and (if the window wants them) their fp32 logits [N, V].
        Greedy rows take the device's argmax (first index of the maximum, as sample_row);
        sampled rows go to sample_row (with top_k, only the k candidates leave the device)."""
        if not w.sample_rows:
            return [], torch.zeros(0, self.model.cfg.vocab)
        params = [SamplingRow(*p) for p in zip(w.temperature, w.top_k, w.top_p, w.min_p, w.u)]
        if self.runner.window_head is not None:   # every row's logits, from the window's graph
            logits, argmax = self.runner.window_head
            rows = w.sample_rows
        else:
            picked = hidden[torch.tensor(w.sample_rows, dtype=torch.long, device=hidden.device)]
            logits, argmax = self.runner.logits(picked)
            rows = range(len(w.sample_rows))
        greedy = argmax.tolist()
        tokens = [greedy[r] if p.temperature <= 0.0 else sample_row(logits[r], p)
                  for r, p in zip(rows, params)]
        return tokens, (logits[list(rows)] if w.want_logits else None)

    def _check_gaps(self, w: Window) -> None:
        """Rows may extend a slot only without leaving a gap; checked before anything changes,
        so a refused window leaves the KV as it was."""
        reach = list(self.cache.filled)
        for slot, length in w.commits:
            reach[slot] = min(reach[slot], length)
        for s, p in zip(w.slots, w.positions):
            if s >= 0:
                if p > reach[s]:
                    raise RowError(f"window {w.id}: slot {s} holds {reach[s]} positions, so "
                                   f"position {p} would leave a gap")
                reach[s] = max(reach[s], p + 1)

    def _check(self, w: Window, tensors: list[np.ndarray]) -> None:
        c, d = self.cfg, self.model.cfg.d_model
        if not w.slots:
            raise RowError(f"window {w.id} has no rows; send at least one (pad rows have slot -1)")
        for s, p, t in zip(w.slots, w.positions, w.tokens):
            if s >= c.slots:
                raise RowError(f"window {w.id}: slot {s} does not exist (this stage has {c.slots})")
            if s >= 0 and not 0 <= p < c.ctx:
                raise RowError(f"window {w.id}: position {p} is outside the context of {c.ctx}")
            if s >= 0 and self.model.first and not 0 <= t < self.model.cfg.vocab:
                raise RowError(f"window {w.id}: token {t} is outside the vocabulary")
        if w.chunk and len({s for s in w.slots if s >= 0}) > 1:
            raise RowError(f"window {w.id} is marked as a prompt chunk but holds rows of several "
                           f"slots; a chunk reads one slot's prompt")
        for commit in w.commits:
            if len(commit) != 2:
                raise RowError(f"window {w.id}: commit {commit} is not a [slot, length] pair")
            slot, length = commit
            if not (0 <= slot < c.slots and 0 <= length <= c.ctx):
                raise RowError(f"window {w.id}: commit ({slot}, {length}) is out of range")
        if self.link is not None and tensors:
            raise RowError(f"window {w.id}: {len(tensors)} tensor frame(s) came, but this stage "
                           f"takes activations over its {self.cfg.link} link")
        if not self.model.first and self.link is None:
            if len(tensors) != 1 or tensors[0].shape != (len(w.slots), d):
                raise RowError(f"window {w.id}: expected activations of shape "
                               f"({len(w.slots)}, {d})")
            if str(tensors[0].dtype) not in ACTIVATION_DTYPES:
                raise RowError(f"window {w.id}: activations of dtype {tensors[0].dtype}; send "
                               f"float32 or bf16 bits as uint16")

    def _error(self, window: int, message: str) -> None:
        self._send_unsent()  # answers keep the windows' order
        log.warning("stage %d: %s", self.cfg.stage, message)
        transport.send(self.to_coordinator, Error(self.cfg.stage, window, message))

    def close(self) -> None:
        self.trace.close()
        if self.link is not None:
            self.link.close()
        self.sockets.close(linger_ms=1000)
