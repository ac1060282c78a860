"""Running windows through a stage: eagerly, or by replaying CUDA graphs.

A window's layers are one graph per row count (its shape), captured the first time that shape
comes and kept in a bounded LRU cache (`--graph-cache N`; 0 = always eager). Inside a graph
every shape and address is static: the window's rows (slot, position, length) and its input
(tokens or hidden states) are copied into static buffers, the RoPE kernel writes K and V at the
(slot, position) it reads from them (pad rows into the cache's trash slot), and attention reads
each row's length from them. Graphs are captured lazily, each after one eager warm-up run of
the same window; the worker captures the usual shapes before its hello (worker.warm_up). The
head (norm, fp32 logits, argmax) of LOGIT_BLOCK sampled rows is one more graph on the last
stage; a window of exactly LOGIT_BLOCK rows (a decode window) runs the head of all its rows in
its own graph instead (`window_head`), which spares the worker a gather, a copy and a replay.

A replay launches the same kernels on the same shapes as the eager path, so it gives the same
bits (tests/test_gpu.py checks); a shape always runs the same way whatever else is cached.
"""
from __future__ import annotations

import ctypes
import logging
import math
import weakref
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch

from strata.stage_worker.model import KVCache, Rows, RowTensors, StageModel

LOGIT_BLOCK = 8  # sampled rows go through the head in blocks of this many rows (fixed shape)
_PAGE = 4096
log = logging.getLogger("strata.graphs")


class _Captured:
    """fn(*static_inputs) -> tuple of tensors, captured once; call() refills the inputs and
    replays. fn may write state it owns (the KV cache) if running it twice on the same inputs
    writes the same values: the capture is preceded by one eager warm-up run (which compiles
    Triton kernels and creates cuBLAS handles outside the capture)."""

    def __init__(self, fn: Callable, inputs: list[torch.Tensor]):
        """inputs: examples, on the host or the device (copied to the current CUDA device)."""
        self.inputs = [x.to(torch.cuda.current_device(), copy=True) for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # A capture stream of the current device (torch's default one is made once, on the
        # first device that captured). Each graph has its own memory pool: a pool shared by
        # graphs cannot be reused once they are all evicted while one of their outputs lives
        # (torch asserts), and a graph's own pool is small (the window's activations).
        # thread_local: the NCCL link's watchdog thread queries events during a capture
        with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(),
                              capture_error_mode="thread_local"):
            self.outputs = fn(*self.inputs)

        # Host inputs (those whose example is on the host: the rows, and hidden states that
        # come as frames) go through page-locked staging buffers: a copy from pageable memory
        # first waits for the whole stream (the previous window's replay), which would stall
        # the host until the GPU is idle, so the next window's host work could not overlap it.
        # Registered with cudaHostRegister rather than taken from torch's pinned pool, whose
        # copies also record an event each (~15 us more a copy on the lent VMs), and filled in
        # place through numpy (tools/gpu/host_steps.py).
        self.staging = [_page_locked(x.shape, x.dtype) if x.device.type == "cpu" else None
                        for x in inputs]
        self.host = [t.numpy() if t is not None and t.dtype != torch.bfloat16 else None
                     for t in self.staging]
        self.staged = torch.cuda.Event()  # the last copies out of the staging buffers
        # the stream windows replay on (the caller's; Event.record() would look it up each time)
        self.stream = torch.cuda.current_stream()

    def __call__(self, *inputs: "torch.Tensor | Callable[[np.ndarray], None]",
                 launching: Callable[[], None] = lambda: None) -> tuple[torch.Tensor, ...]:
        """inputs: a tensor (host or device), or fill(array) that writes a host input into its
        staging buffer in place. launching() is called just before the replay is queued (after
        the input copies)."""
        if not self.staged.query():  # done before the last replay began: no wait in practice
            self.staged.synchronize()
        for static, stage, host, x in zip(self.inputs, self.staging, self.host, inputs):
            if callable(x):
                x(host)
                x = stage
            elif x.device.type == "cpu" and stage is not None:
                stage.copy_(x)
                x = stage
            static.copy_(x, non_blocking=True)
        self.staged.record(self.stream)
        launching()
        self.graph.replay()
        return self.outputs  # static: valid until the next replay


def _page_locked(shape, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor on whole pages of its own (so no other registration overlaps them),
    registered with CUDA and unregistered when it is collected; or, where registering fails,
    one from torch's pinned pool."""
    nbytes = math.prod(shape) * dtype.itemsize
    size = -(-nbytes // _PAGE) * _PAGE
    raw = torch.empty(size + _PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE
    pages = raw[start:start + size]
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(pages.data_ptr(), size, 0)) if size else -1
    if err == 0:
        out = pages[:nbytes].view(dtype).view(shape)
        weakref.finalize(out, cudart.cudaHostUnregister, pages.data_ptr())
        return out
    if size:
        _clear_cuda_error()
        log.warning("could not page-lock a staging buffer of %d bytes (CUDA error %d); it "
                    "comes from torch's pinned pool, whose copies are slower", nbytes, err)
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _clear_cuda_error() -> None:
    """A failed cudaHostRegister stays this thread's last CUDA error, which torch's check
    after its next kernel launch would raise: read it off with cudaGetLastError (best effort:
    where the runtime's symbols are visible in the process, as torch loads them)."""
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (OSError, AttributeError):
        pass


class WindowRunner:
    """The mechanism a stage worker calls per window: layers, then (last stage) logits."""

    def __init__(self, model: StageModel, cache: KVCache, graph_cache: int = 0):
        self.model, self.cache = model, cache
        self.capacity = graph_cache if model.device.type == "cuda" else 0
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.captures = 0  # graphs captured so far (evictions make this exceed the capacity)
        # (fp32 logits [R, V], argmax [R]) of every row of the last window, when its graph
        # computed them (last stage, R == LOGIT_BLOCK); None otherwise. Static buffers.
        self.window_head: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- layers ----------------------------------------------------------------------------

    def layers(self, inputs: torch.Tensor | list[int], rows: Rows, chunk: bool = False,
               launching: Callable[[], None] = lambda: None) -> torch.Tensor:
        """inputs: token ids (first stage: a list, or a tensor [R]) or hidden states [R, D],
        on any device. chunk: one slot's prompt rows (Window.chunk). Returns hidden states
        [R, D] on the model's device (a static buffer when graphed: read it before the next
        window). launching() is called when the host work is done and the kernels are about
        to be queued (a trace's GPU span starts there)."""
        m = self.model
        self.window_head = None
        tokens = None
        if m.first:   # a graphed window never makes a tensor of them: they go to its staging
            tokens = inputs if isinstance(inputs, list) else inputs.tolist()
            # a pad row's token is never checked, and the embedding must not see it
            tokens = [t if s >= 0 else 0 for s, t in zip(rows.slots, tokens)]
            if not (self.capacity and m.row_tensors):
                inputs = torch.tensor(tokens, dtype=torch.long)
        if not m.row_tensors:
            launching()
            return m(inputs.to(m.device), rows, self.cache)
        if not self.capacity:
            packed = RowTensors.pack(rows, self.cache.trash)
            launching()
            inputs = inputs.to(m.device) if m.first else inputs.to(m.device, m.dtype)
            return m(inputs, RowTensors.unpack(packed.to(m.device)), self.cache, chunk)
        # the graph's inputs: the first stage's rows and tokens in one host tensor [4, R] (one
        # copy to the device), a later stage's hidden states [R, D] and rows [3, R]; the rows
        # are written straight into the graph's staging buffer

        def fill(out: np.ndarray) -> None:
            RowTensors.fill(out, rows, self.cache.trash, tokens)

        def example() -> list[torch.Tensor]:
            packed = RowTensors.pack(rows, self.cache.trash, tokens)
            return [packed] if m.first else [inputs.to(m.dtype), packed]

        with_head = m.last and len(rows.slots) == LOGIT_BLOCK and not chunk
        if chunk:
            key, fn = ("chunk", len(rows.slots)), self._chunk_fn
        else:
            key = ("layers+head" if with_head else "layers", len(rows.slots))
            fn = self._layers_head_fn if with_head else self._layers_fn
        graph_inputs = [fill] if m.first else [inputs.to(m.dtype), fill]
        out = self._graph(key, fn, example)(*graph_inputs, launching=launching)
        if with_head:
            self.window_head = out[1:]
        return out[0]

    def _forward(self, inputs: tuple[torch.Tensor, ...], chunk: bool = False) -> torch.Tensor:
        """The model on a graph's inputs: ([4, R] rows and tokens) or (hidden, [3, R] rows)."""
        if self.model.first:
            (packed,) = inputs
            return self.model(packed[3], RowTensors.unpack(packed), self.cache, chunk)
        hidden, packed = inputs
        return self.model(hidden, RowTensors.unpack(packed), self.cache, chunk)

    def _layers_fn(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (self._forward(inputs),)

    def _chunk_fn(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (self._forward(inputs, chunk=True),)

    def _layers_head_fn(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = self._forward(inputs)
        return (hidden,) + self._head_fn(hidden)

    # -- head ------------------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [N, D] rows to sample (last stage). Returns (fp32 logits [N, V], argmax [N]),
        computed in fixed blocks of LOGIT_BLOCK rows (a row's logits never depend on N)."""
        n = hidden.shape[0]
        blocks = -(-n // LOGIT_BLOCK)
        padded = torch.zeros(blocks * LOGIT_BLOCK, hidden.shape[1], dtype=hidden.dtype,
                             device=hidden.device)
        padded[:n] = hidden
        outs = [self._head(block) for block in padded.split(LOGIT_BLOCK)]
        if len(outs) == 1:
            return outs[0][0][:n], outs[0][1][:n]
        return (torch.cat([o[0] for o in outs])[:n], torch.cat([o[1] for o in outs])[:n])

    def _head(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.capacity:
            return self._head_fn(block)
        graph = self._graph(("head", block.shape[0]), self._head_fn, lambda: [block])
        out = graph(block)
        return out[0].clone(), out[1].clone()  # several blocks may replay this graph

    def _head_fn(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.logits(block)
        return logits, logits.argmax(-1)

    # -- the cache ---------------------------------------------------------------------------

    def _graph(self, key: tuple, fn: Callable,
               example: Callable[[], list[torch.Tensor]]) -> _Captured:
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            return graph
        while len(self.graphs) >= self.capacity:
            _, evicted = self.graphs.popitem(last=False)  # least recently used
            evicted.staged.synchronize()  # its staging buffers are freed: no copy may be left
        graph = self.graphs[key] = _Captured(fn, example())
        self.captures += 1
        return graph
