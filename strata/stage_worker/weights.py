"""How a stage holds its weights: quantized blocks where a kernel reads them, dense (bf16 on
CUDA, fp32 on the CPU) everywhere else, and an account of what was loaded.

`--weights quantized` keeps every matrix of a block type with a kernel (kernels/quant/weight.py's
KERNEL_TYPES: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) packed on a CUDA
stage; other types (IQ3_S, IQ2_*, Q2_K, Q3_K, MXFP4, ...) are widened at load, and so is
everything on CPU stages and with `--weights bf16`. Norm vectors are always dense. An MoE layer's expert tensors ([E, N, K] in
the file) follow the same rule (`experts`): packed as E * N rows, which the grouped expert
kernels read (kernels/moe_triton.py), or widened to [E, N, K].
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from strata.kernels.quant.blocks import stays_packed
from strata.kernels.quant.weight import QuantWeight, Scratch
from strata.model.gguf_file import ModelFile


@dataclass
class LoadReport:
    """What a stage's loader made of the file's matrices, and their bytes on the device."""
    quantized: Counter = field(default_factory=Counter)   # block type -> matrices kept packed
    widened: Counter = field(default_factory=Counter)     # file type -> matrices made dense
    weight_bytes: int = 0                                 # norms included

    def summary(self, dtype: torch.dtype) -> str:
        """e.g. 'kept quantized: Q4_K x193, Q6_K x33; loaded as bfloat16: IQ3_S x2' (matrices
        by their type in the file)."""
        def tally(c: Counter) -> str:
            return ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "none"
        name = str(dtype).removeprefix("torch.")
        return f"kept quantized: {tally(self.quantized)}; loaded as {name}: {tally(self.widened)}"


@dataclass
class WeightLoader:
    """Loads one stage's tensors from `file`: `matrices` gives a QuantWeight (where
    blocks.stays_packed says so for the stage's `mode`) or a dense tensor, `vector` a dense
    one; `report` counts them. `scratch` is the buffer the stage's quantized layer matrices
    dequantize into for prompt chunks: reserved for those loaded `for_chunks`, allocated by
    `finish`."""
    file: ModelFile
    device: torch.device
    dtype: torch.dtype
    mode: str = "bf16"    # quantized, bf16, or packed (any device: interpreter tests)
    scratch: Scratch = field(default_factory=Scratch)
    report: LoadReport = field(default_factory=LoadReport)

    def vector(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor widened whatever its type (norms, biases, a router), in the stage's dtype
        or `dtype`."""
        t = self.file.tensor(name, dtype or self.dtype, self.device)
        self.report.weight_bytes += t.numel() * t.element_size()
        return t

    def matrix(self, name: str) -> torch.Tensor | QuantWeight:
        return self.matrices([name])

    def matrices(self, names: list[str], for_chunks: bool = False
                 ) -> torch.Tensor | QuantWeight:
        """The rows of the named matrices one after another (a fused projection)."""
        types = [self.file.tensor_type(n) for n in names]
        if self._packs(types):
            w = self._packed(names, types)
            if for_chunks:
                self.scratch.reserve(w.numel())
            return w
        return self._dense(names, types, dim=0)

    def experts(self, names: list[str]) -> torch.Tensor | QuantWeight:
        """An MoE layer's expert tensors [E, N, K] (gate and up: [gate; up] of each expert):
        packed, the first tensor's E * N rows (expert e's rows e * N ..), then the next's; or
        dense [E, sum of N, K]. Prompt chunks read packed experts in place (no scratch)."""
        types = [self.file.tensor_type(n) for n in names]
        if self._packs(types):
            return self._packed(names, types)
        return self._dense(names, types, dim=1)

    def _packs(self, types: list[str]) -> bool:
        return stays_packed(types, self.mode, torch.device(self.device).type == "cuda")

    def _packed(self, names: list[str], types: list[str]) -> QuantWeight:
        pieces = []
        for name, qtype in zip(names, types):
            raw, cols = self.file.blocks(name)
            pieces.append(QuantWeight.from_blocks(qtype, torch.from_numpy(raw), cols,
                                                  self.device, self.scratch))
        w = pieces[0] if len(pieces) == 1 else QuantWeight.cat(pieces)
        self.report.quantized.update(types)
        self.report.weight_bytes += w.nbytes
        return w

    def _dense(self, names: list[str], types: list[str], dim: int) -> torch.Tensor:
        dense = [self.file.tensor(n, self.dtype, self.device) for n in names]
        w = dense[0] if len(dense) == 1 else torch.cat(dense, dim)
        self.report.widened.update(types)
        self.report.weight_bytes += w.numel() * w.element_size()
        return w

    def finish(self) -> None:
        """Allocate the scratch buffer (after every matrix is loaded)."""
        self.scratch.allocate(self.dtype, self.device)
