"""Programmatic dependent launch (PDL, Hopper and later): the next kernel on the stream is
launched while this one is still running, so that its programs are placed and waiting when
this one finishes.

A decode window of a few rows is a chain of a few hundred short kernels in a CUDA graph; each
one otherwise starts only after the one before has finished and the GPU has launched it: a
few microseconds a kernel in which it computes nothing. With PDL each program of a kernel
first waits (griddepcontrol.wait) until the kernel before has finished and its writes are
seen, then lets the next kernel launch (griddepcontrol.launch_dependents: that kernel's
programs may be placed once all of this kernel's programs have passed the wait). So no program
reads, writes or counts (kernels/arrive.py) anything before every kernel ahead of it has
finished, as without PDL: the same bits (tests/kernels/test_pdl.py), and at most one kernel's
programs wait ahead. (Fetching the next kernel's weights into L2 before its wait, or letting
it launch before this one's wait, measured slower on the llama3-8b shape: the waiting kernels
ran ahead of each other.)

Only kernels whose every program calls `enter` first are launched with the attribute
(`launch_options`); any other kernel on the stream starts as before, after the one ahead of it
has finished. On for CUDA devices of compute capability 9.0 or later, with a Triton that has it
(launch_pdl and griddepcontrol), unless STRATA_PDL=0; the interpreter and the CPU never see it.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _capable(index: int) -> bool:
    """A Hopper or later GPU, and a Triton that launches with PDL (launch_pdl, gdc_wait)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return ("launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
            and torch.cuda.get_device_capability(index)[0] >= 9)


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a Hopper or later GPU, a Triton that can,
    STRATA_PDL not 0."""
    device = torch.device(device)
    return (device.type == "cuda" and os.environ.get("STRATA_PDL", "1") != "0"
            and _capable(device.index if device.index is not None
                         else torch.cuda.current_device()))


def launch_options(device: torch.device) -> dict:
    """A launch's keyword arguments: the kernel's PDL constexpr, and with it on, launch_pdl."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL kernel's first call in every program (see the module); nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
