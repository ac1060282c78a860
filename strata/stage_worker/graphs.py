"""CUDA graphs of a stage's windows: a captured function replayed with its inputs refilled.

Inside a graph every shape and address is static: a window's rows (slot, position, length)
and its input (tokens or hidden states) are copied into static buffers; host inputs go through
page-locked staging buffers so that the copy does not wait for the previous replay. Each
capture follows one eager warm-up run of the same inputs. A replay launches the same kernels on
the same shapes as the eager path, so it gives the same bits (tests/stage_worker/test_gpu.py
checks).
"""
from __future__ import annotations

import ctypes
import logging
import math
import weakref
from typing import Callable

import numpy as np
import torch

_PAGE = 4096
log = logging.getLogger("strata.graphs")


class Captured:
    """fn(*static_inputs) -> tuple of tensors, captured once; call() refills the inputs and
    replays. fn may write state it owns (the KV cache) if running it twice on the same inputs
    writes the same values: the capture is preceded by one eager warm-up run (which compiles
    Triton kernels and creates cuBLAS handles outside the capture)."""

    def __init__(self, fn: Callable, inputs: list[torch.Tensor], pool=None):
        """inputs: examples, on the host or the device (copied to the current CUDA device).
        pool: a memory pool (torch.cuda.graph_pool_handle()) shared with other graphs that
        are replayed one at a time on one stream and never dropped (the drafter's); by
        default the graph's own."""
        self.inputs = [x.to(torch.cuda.current_device(), copy=True) for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # A capture stream of the current device (torch's default one is made once, on the
        # first device that captured). A window's graph has its own memory pool: a pool shared
        # by graphs cannot be reused once they are all evicted while one of their outputs
        # lives (torch asserts), and a graph's own pool is small (the window's activations).
        # thread_local: the NCCL link's watchdog thread queries events during a capture
        with torch.cuda.graph(self.graph, pool=pool, stream=torch.cuda.Stream(),
                              capture_error_mode="thread_local"):
            self.outputs = fn(*self.inputs)

        # Host inputs (those whose example is on the host: the rows, and hidden states that
        # come as frames) go through page-locked staging buffers: a copy from pageable memory
        # first waits for the whole stream (the previous window's replay), which would stall
        # the host until the GPU is idle, so the next window's host work could not overlap it.
        # Registered with cudaHostRegister rather than taken from torch's pinned pool, whose
        # copies also record an event each (~15 us more a copy on an H200 host), and filled in
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
