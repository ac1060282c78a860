"""The last program of a tile finishes it: sums over parts without a kernel of their own.

Where a launch cuts a tile's work into parts (K of an int8 GEMV, keys of an attention row),
each part's program writes its partial result to a scratch buffer and arrives at the tile's
counter; the one program that arrives last reads every part, in the parts' order (never the
order of arrival), and writes the tile. So the result is, bit for bit, what a second kernel
adding the parts in that order gives, one launch fewer.

Memory order, as CUTLASS's semaphore: a barrier puts the program's stores before its one
atomic add, which is acquire-release at GPU scope, and another barrier puts it before the
reads; the last program reads the parts with cache_modifier=".cg" (from L2, where the other
programs' stores are).

The counters: one buffer of SIZE int32 a device, zero between launches (the last program of
a tile sets its counter back to zero). It is made outside any CUDA graph capture, as a buffer
made during one would belong to that graph's memory pool: `counters` returns None where none
exists yet during a capture, or a launch needs more tiles than SIZE, and the caller then takes
its two-launch path, with the same bits. A stage runs these kernels on one stream, so two
launches never use the counters at once (with programmatic dependent launch too: a kernel's
programs wait for the kernel before to finish first, kernels/pdl.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SIZE = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's counters for a launch of `tiles` tiles, or None (see the module)."""
    device = torch.device(device)
    if tiles > SIZE:
        return None
    buffer = _COUNTERS.get(device)
    if buffer is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buffer = _COUNTERS[device] = torch.zeros(SIZE, dtype=torch.int32, device=device)
    return buffer


@triton.jit
def arrive(counter_ptr, total):
    """True in the last of the tile's `total` programs to arrive at its counter, which that
    program then sets back to zero; every program's stores before it are seen after it."""
    tl.debug_barrier()
    seen = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = seen == total - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last
