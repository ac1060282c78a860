"""The stage worker: take a window, check it, commit, compute this stage's layers, then pass it
on or (last stage) answer with its sampled tokens.

Stage k binds `listen` and pushes to stage k+1's `listen`; the last stage pushes results to the
coordinator's inbox. Hellos and errors also go to the inbox. Activations never pass through the
coordinator.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import numpy as np
import torch

from strata.kernels.policy import KernelPolicy
from strata.model.gguf_file import ModelFile
from strata.protocol import transport
from strata.protocol.keys import COORDINATOR, CurveKeys, stage_name
from strata.protocol.messages import (PROTOCOL_VERSION, Error, Heartbeat, Hello, ProtocolError,
                                      Result, Shutdown, Window)
from strata.protocol.peers import PeerWatch
from strata.stage_worker.checks import RowError, check_window
from strata.stage_worker.config import WorkerConfig
from strata.stage_worker.last_stage import LastStage
from strata.stage_worker.link import StageLink
from strata.stage_worker.model import KVCache, Rows, StageModel
from strata.stage_worker.runner import WindowRunner
from strata.trace import Trace

__all__ = ["RowError", "StageWorker", "WorkerConfig"]
log = logging.getLogger("strata.worker")
# (rows, chunk): graphs captured before the hello: the 1-client decode window and the prompt
# chunk of CUDA stages (strata-launch's --chunk-rows auto); other shapes when they first come
WARM_SHAPES = ((8, False), (128, True))
WARM_TILES = (1, 32, 64)   # decode windows run eagerly before the hello: the kernels' other
                           # row tiles compile then (16 rows share the 8-row window's tile; a
                           # 1-row window, of --min-window-rows 1, is a variant of its own)
A8_TILES = (2, 4, 16)   # and with int8 activations the GEMV's other row tiles, and the
                        # MMA's 16 (there 8 rows take a GEMV tile of their own)


def describe_memory(memory: list[int]) -> str:
    """'weights 4.52 GiB, KV cache 1.00 GiB, scratch 0.22 GiB; 5.91 GiB held in all'."""
    weights, kv, scratch, held = (b / 2**30 for b in memory)
    out = f"weights {weights:.2f} GiB, KV cache {kv:.2f} GiB, scratch {scratch:.2f} GiB"
    return out + (f"; {held:.2f} GiB held in all" if held else "")


class StageWorker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        t0 = time.perf_counter()
        # a keys directory that cannot be used fails before the model loads
        keys = CurveKeys.load(cfg.keys, stage_name(cfg.stage)) if cfg.keys else None
        file = ModelFile(cfg.model)
        if cfg.layer_end > file.config.n_layers:
            raise ValueError(f"layer range {cfg.layer_start}:{cfg.layer_end} exceeds the model's "
                             f"{file.config.n_layers} layers")
        self.fingerprint = file.fingerprint()
        if torch.device(cfg.device).type == "cuda":
            torch.cuda.set_device(cfg.device)  # Triton launches and graphs go to this device
        policy = replace(KernelPolicy.for_device(cfg.device),
                         int8_activations=cfg.activations == "int8")
        self.model = StageModel(file, cfg.layer_start, cfg.layer_end, ctx=cfg.ctx,
                                device=cfg.device, weights=cfg.weights, policy=policy)
        self.cache = KVCache(cfg.layer_end - cfg.layer_start, cfg.slots, file.config, cfg.ctx,
                             self.model.device, self.model.dtype)
        self.runner = WindowRunner(self.model, self.cache, cfg.graph_cache)
        # the last stage's tokens, answers and drafts (last_stage.py)
        self.last = (LastStage(cfg, file, self.model, self.runner.capacity > 0,
                               self._send_result) if self.model.last else None)
        # CPU stages compute on the cores a spinning neighbour would take: they block at once
        self.spin_s = transport.SPIN_S if self.model.device.type == "cuda" else 0.0
        warm_s = self.warm_up()
        self.trace = Trace(f"stage{cfg.stage}", cfg.trace or None, self.model.device)
        if self.last is not None:
            self.last.mark = self.trace.mark
        self.link = None
        if cfg.link != "zmq":
            self.link = StageLink(cfg.link, cfg.link_init, cfg.stage, cfg.link_world,
                                  self.model.device)
            self.link.warm_up(file.config.d_model, self.model.dtype)
            log.info("stage %d: activations over %s (%d stages)", cfg.stage, cfg.link,
                     cfg.link_world)
        self.memory = self.measure_memory()
        log.info("stage %d: layers [%d, %d) on %s (%s, graph cache %d) loaded in %.1fs "
                 "(graphs warmed in %.1fs); %s", cfg.stage, cfg.layer_start, cfg.layer_end,
                 cfg.device, str(self.model.dtype).removeprefix("torch."),
                 self.runner.capacity, time.perf_counter() - t0, warm_s,
                 describe_memory(self.memory))
        log.info("stage %d: matrices %s", cfg.stage, self.matrices())
        self.sockets = transport.Sockets(keys, cfg.insecure)   # unix:// or ZeroMQ, by endpoint
        self.inbox = self.sockets.pull(cfg.listen)
        self.to_coordinator = self.sockets.push(cfg.coordinator, peer=COORDINATOR)
        self.to_next = (self.sockets.push(cfg.next, peer=stage_name(cfg.stage + 1))
                        if cfg.next else None)
        self.coordinator = PeerWatch(self.to_coordinator)

    def warm_up(self) -> float:
        """Compile the kernels and capture the graphs of the usual window shapes (and the
        head's) before the hello, and compile the kernels of the other decode sizes' row tiles
        (their graphs are captured when a window of that size first comes), so that no
        request pays for a compilation. Pad rows only: nothing but the cache's trash slot is
        written. Returns the seconds it took."""
        t0 = time.perf_counter()
        if not self.runner.capacity:
            return 0.0
        m = self.model

        def pads(n: int) -> tuple[torch.Tensor, Rows]:
            inputs = (torch.zeros(n, dtype=torch.long) if m.first
                      else torch.zeros(n, m.cfg.d_model, dtype=m.dtype))
            return inputs, Rows([-1] * n, [0] * n)

        with torch.inference_mode():
            for n, chunk in WARM_SHAPES:
                self.runner.run(*pads(n), chunk=chunk, sample_rows=[0])
            for n in WARM_TILES + (A8_TILES if m.policy.int8_activations else ()):
                inputs, rows = pads(n)
                hidden = m(inputs.to(m.device), rows, self.cache)
                if m.last:
                    m.logits(hidden)
            if m.last:   # the Triton pick of sampled rows: the head's logits, the drafter's
                from strata.kernels.sampling.sample_triton import compile_picks
                dtypes = (torch.float32,) if m.dtype == torch.float32 else (torch.float32, m.dtype)
                compile_picks(m.cfg.vocab, m.device, dtypes)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def measure_memory(self) -> list[int]:
        """Bytes on the device: [weights, KV cache, scratch, all the process holds] (the last:
        on CUDA what torch reserved, graph pools and workspaces included; on a CPU 0)."""
        weights = self.model.weights
        held = (torch.cuda.memory_reserved(self.model.device)
                if self.model.device.type == "cuda" else 0)
        drafter = self.last.nbytes() if self.last is not None else 0
        return [weights.report.weight_bytes, self.cache.nbytes() + drafter,
                weights.scratch.nbytes, held]

    def hello(self) -> Hello:
        c = self.cfg
        return Hello(PROTOCOL_VERSION, c.stage, c.layer_start, c.layer_end, c.device,
                     self.fingerprint, os.getpid(), c.slots, c.ctx, c.listen,
                     self.matrices(), self.memory)

    def matrices(self) -> str:
        """What the stage's weights are and, with int8 activations, that decode windows take
        them (the hello's summary)."""
        text = self.model.weights.report.summary(self.model.dtype)
        return text + ("; decode windows multiply them with int8 activations"
                       if self.model.policy.int8_activations else "")

    def serve(self) -> None:
        transport.send(self.to_coordinator, self.hello())
        with torch.inference_mode():  # entered once: ~14 us a window saved on an H200 host
            while self.step():
                pass
        self.close()

    def step(self) -> bool:
        """Take the next message and act on it; False once it was a Shutdown, or a header
        that leaves the link out of step (_refuse_malformed), or the coordinator has gone.
        Runs inside serve()'s inference mode."""
        self._await_pending()
        if self.spin_s:
            transport.spin(self.inbox, self.spin_s)
        while not self.inbox.poll(1000):   # idle: each second, is the coordinator still there?
            if self.coordinator.gone():
                if self.coordinator.refused:
                    log.error("stage %d: the coordinator refused this stage's key: exiting; "
                              "give it --keys DIR with the stage%d.key_secret of the launch's "
                              "keys directory", self.cfg.stage, self.cfg.stage)
                else:
                    log.error("stage %d: the coordinator has gone (its socket closed): "
                              "exiting", self.cfg.stage)
                return False
        try:
            msg, tensors = transport.recv(self.inbox)
        except ProtocolError as e:
            return self._refuse_malformed(e)
        if isinstance(msg, Heartbeat):
            # answered once the device is past the windows before it: a device that never
            # finishes leaves the heartbeat unanswered, which names this stage
            self._answer_pending()
            transport.send(self.to_coordinator, Heartbeat(msg.seq, self.cfg.stage))
            return True
        if isinstance(msg, Shutdown):
            self._answer_pending()
            if self.to_next is not None:
                transport.send(self.to_next, msg)
            log.info("stage %d: shutting down (%s)", self.cfg.stage, msg.reason)
            return False
        if not isinstance(msg, Window):
            self._error(-1, f"stage {self.cfg.stage} does not accept {type(msg).__name__}")
            return True
        self.trace.mark(msg.id, "came")
        try:
            self.run_window(msg, tensors)
        except (RowError, ProtocolError) as e:
            self._error(msg.id, str(e))
        return True

    def run_window(self, w: Window, tensors: list[np.ndarray]) -> None:
        """Check, commit, compute, then pass the window on or answer it. Runs inside serve()'s
        inference mode."""
        t0 = time.perf_counter()
        receiving = None
        if self.link is not None and not self.model.first:
            # posted first of all (the previous stage sent these whatever this stage decides);
            # waited for only when needed, so the checks overlap the transfer
            receiving = self.link.recv(len(w.slots), self.model.cfg.d_model, self.model.dtype)
        try:
            check_window(w, tensors, self.cfg, self.model.cfg, self.model.first,
                         self.cache.filled, last=self.model.last)
        except RowError:
            if receiving is not None:
                receiving.wait()  # complete the transfer: the link stays in step
            raise
        if w.follows:
            self.last.check_follows(w)   # (checks.py: a follows window is first and last)
        self._commit(w)
        self.trace.mark(w.id, "checked")
        follow = None   # on CUDA: writes the picks a window that decodes ahead reads
        if w.follows:
            inputs, follow = self.last.follow(w)
        elif self.model.first:
            inputs = w.tokens   # the runner writes them into its staging buffer
        elif receiving is not None:
            inputs = receiving.wait()
        else:
            inputs = transport.frame_tensor(tensors[0])  # bf16 bits or fp32, on the host

        def launching() -> None:  # host work done, the kernels go next
            self.trace.mark(w.id, "launching")
            self.trace.gpu_begin(w.id)

        hidden, head = self.runner.run(inputs, Rows(w.slots, w.positions), chunk=w.chunk,
                                       sample_rows=w.sample_rows, logprob_rows=w.logprob_rows,
                                       launching=launching, follow=follow)
        if self.last is not None:   # the window's tokens (on CUDA picked on the device)
            head = self.last.pick(w, head)
        self.trace.gpu_end()
        self.trace.mark(w.id, "queued")
        if self.last is None:
            self._pass_on(w, hidden, t0)
        else:
            self.last.answer(w, t0, hidden, head)

    def _refuse_malformed(self, e: ProtocolError) -> bool:
        """An Error for a message that does not decode, naming the window it claims to be when
        its id can be read. Over a link, the previous stage sent that window's activations
        whatever this stage makes of its header: they are received and dropped, so the next
        window meets its own. A header whose row count cannot be read leaves the link with
        activations no header matches: the stage stops rather than compute with them.
        Returns False when the stage stops."""
        k = self.cfg.stage
        if self.link is None or self.model.first or e.rows == 0:
            self._error(e.window, f"malformed message: {e}")
            return True
        if e.rows is None:
            self._error(e.window, f"malformed message: {e}; its row count cannot be read, so "
                        f"the activations from stage {k - 1} no longer match their windows: "
                        f"stage {k} stops (restart the stages)")
            return False
        self.link.recv(e.rows, self.model.cfg.d_model, self.model.dtype).wait()
        self._error(e.window, f"malformed message: {e}")
        return True

    def _commit(self, w: Window) -> None:
        """Trim the slots the window commits, then claim its rows' positions (checked: no gap).
        Nothing between this and the compute may refuse the window: a refusal must leave the
        KV cache as it was (check_window has refused all it can)."""
        for slot, length in w.commits:
            self.cache.trim(slot, length)
        for s, p in zip(w.slots, w.positions):
            if s >= 0:
                self.cache.filled[s] = max(self.cache.filled[s], p + 1)

    def _pass_on(self, w: Window, hidden: torch.Tensor, t0: float) -> None:
        if self.link is not None:
            self.link.send(hidden)  # posted before the header goes (see link.py); stage_ms is
            frames = []             # then host time: nothing waits for the device
        else:
            frames = [transport.tensor_frame(hidden)]  # waits for the device
        w.stage_ms.append((time.perf_counter() - t0) * 1e3)
        self.trace.mark(w.id, "sent")   # marked as it goes: the receiver may be quicker
        transport.send(self.to_next, w, frames)

    def _send_result(self, result: Result, frames: list) -> None:
        self.trace.mark(result.id, "sent")
        transport.send(self.to_coordinator, result, frames)

    def _await_pending(self) -> None:
        """A last stage's deferred answer, once its device is done (LastStage.await_pending)."""
        if self.last is not None:
            self.last.await_pending(self.inbox)

    def _answer_pending(self) -> None:
        if self.last is not None:
            self.last.answer_pending()

    def _error(self, window: int, message: str) -> None:
        self._answer_pending()  # answers keep the windows' order
        log.warning("stage %d: %s", self.cfg.stage, message)
        transport.send(self.to_coordinator, Error(self.cfg.stage, window, message))

    def close(self) -> None:
        self.trace.close()
        if self.link is not None:
            self.link.close()
        self.coordinator.close()
        self.sockets.close(linger_ms=1000)
