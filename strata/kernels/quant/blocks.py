"""The GGUF block types the quantized kernels read (weight.py, reads.py): their geometry
and packed planes, as plain data (the launcher plans memory with it without torch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# type -> (quants a block, bytes a block, quants a scale group); llama.cpp's ggml-common.h
BLOCKS = {"Q4_0": (32, 18, 32), "Q4_1": (32, 20, 32), "Q8_0": (32, 34, 32),
          "Q4_K": (256, 144, 32), "Q5_K": (256, 176, 32), "Q6_K": (256, 210, 16),
          "Q5_0": (32, 22, 32), "Q5_1": (32, 24, 32), "IQ4_NL": (32, 18, 32),
          "IQ4_XS": (256, 136, 32)}
KERNEL_TYPES = tuple(BLOCKS)
# each type's planes (weight.py's docstring says what each holds)
PLANES = {"Q4_0": ("qs", "d"), "Q4_1": ("qs", "d", "m"), "Q8_0": ("qs", "qh", "d"),
          "Q4_K": ("qs", "sc", "dm"), "Q5_K": ("qs", "qh", "sc", "dm"),
          "Q6_K": ("qs", "qh", "sc", "dm"), "Q5_0": ("qs", "qh", "d"),
          "Q5_1": ("qs", "qh", "d", "m"), "IQ4_NL": ("qs", "d"), "IQ4_XS": ("qs", "sc", "dm")}
# the codebook of IQ4_NL and IQ4_XS (llama.cpp's kvalues_iq4nl): a 4-bit code's value
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def stays_packed(types: list[str], mode: str, cuda: bool) -> bool:
    """Whether a matrix whose pieces (a fused projection's q, k and v, say) have these GGUF
    types stays packed: --weights quantized on a CUDA device ("packed": any device, for
    tests under Triton's interpreter) and a kernel for every piece; else it is widened whole."""
    return (mode == "packed" or (mode == "quantized" and cuda)) and all(
        t in KERNEL_TYPES for t in types)


# off CUDA, a quantized kernel's programs are at least this wide (program_width)
INTERPRETER_WIDTH = 128


def program_width(device: torch.device, width: int) -> int:
    """A quantized kernel's columns (or rows) a program: `width`, its caller's CUDA default, on
    CUDA; elsewhere at least INTERPRETER_WIDTH. Off CUDA only Triton's interpreter runs these
    kernels, a program at a time in Python, so a call's time goes with its programs (a Q4_K
    [512, 256] GEMV: 0.94 s with 32 columns a program, 0.28 s with 128); the width changes no
    bits."""
    return width if device.type == "cuda" else max(width, INTERPRETER_WIDTH)


@dataclass
class Part:
    """Rows of one block type: planes [rows, ...] of PLANES[qtype] (weight.py packs
    them)."""
    qtype: str
    rows: int
    cols: int
    planes: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planes.values())
