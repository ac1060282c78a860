"""Projections over quantized weights (weight.py's QuantWeight), as kernels/fused.py's
dispatch calls them: a decode window on the Triton path takes the quantized kernels
(float_triton.py; with the policy's int8_activations, the rows quantized once and
a8_triton.py), one launch per part of one block type, each writing its columns
of one output; anything else (a prompt chunk, the plain-torch path) returns None, and the
caller runs its dense path on `dense_weight`: the weight dequantized into the stage's scratch
buffer.
"""
from __future__ import annotations

import torch

from strata.kernels.policy import KernelPolicy
from strata.kernels.quant.a8 import Codes
from strata.kernels.quant.weight import QuantWeight


def dense_weight(w: torch.Tensor | QuantWeight, dtype: torch.dtype,
                 policy: KernelPolicy) -> torch.Tensor:
    """w itself, or a quantized w dequantized to `dtype` (valid until the next one)."""
    return w.dense(dtype, policy.triton) if isinstance(w, QuantWeight) else w


def project(x: torch.Tensor, w: QuantWeight, policy: KernelPolicy, decode: bool, *,
            kind: str, res: torch.Tensor | None = None, norm: torch.Tensor | None = None,
            eps: float = 0.0, out_dtype: torch.dtype | None = None,
            codes: Codes | None = None) -> torch.Tensor | None:
    """x [M, K] @ w^T (+ res; rmsnorm(x) with norm) [M, N], or None where the quantized kernels
    do not take the window (see the module). codes: x's rows already quantized (no norm), for
    the int8 kernels."""
    if not (decode and policy.triton):
        return None
    if policy.int8_activations:
        assert codes is None or norm is None
        return _project_a8(x, w, res, norm, eps, out_dtype or x.dtype, codes)
    from strata.kernels.quant.float_triton import fits_k, quant_mm
    blocks = [policy.quant_blocks(p.qtype, p.rows, p.cols, kind) for p in w.parts]
    if not all(fits_k(p, b["block_k"]) for p, b in zip(w.parts, blocks)):
        return None
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    tile = policy.row_tile(x.shape[0], w.nbytes)
    col = 0
    for part, b in zip(w.parts, blocks):
        cols = slice(col, col + part.rows)
        quant_mm(x, part, None if res is None else res[:, cols], norm, eps, out=out[:, cols],
                 block_m=tile, **b)
        col += part.rows
    return out


def rows_codes(w: torch.Tensor | QuantWeight, policy: KernelPolicy, decode: bool, rows: int,
               k: int, device: torch.device) -> Codes | None:
    """Codes [rows, k] for a kernel to fill with the rows it writes, where `project` would
    quantize them for w's int8 kernels (a decode window, int8 activations, w quantized and
    k whole blocks of 32); else None."""
    if not (decode and policy.triton and policy.int8_activations
            and isinstance(w, QuantWeight) and k % 32 == 0):
        return None
    return Codes.empty(rows, k, device)


def gate_up_silu(x: torch.Tensor, w: QuantWeight, norm: torch.Tensor | None, eps: float,
                 policy: KernelPolicy, decode: bool, act: str = "silu") -> torch.Tensor | None:
    """act(g) * u of [g | u] = rmsnorm(x) @ w^T in one kernel, or None (a prompt chunk, the
    plain-torch path, or gate and up of different types)."""
    if not (decode and policy.triton) or len(w.parts) != 1:
        return None
    if policy.int8_activations:
        # [gate | up] rounded as the projection's output, then act(gate) * up in fp32, and
        # those rows quantized for the down projection (Codes, which linear_rows takes)
        from strata.kernels.quant.a8_triton import a8_gate_up_silu, quantize_rows
        return a8_gate_up_silu(quantize_rows(x, norm, eps), w.parts[0], act, x.dtype,
                               codes=True)
    from strata.kernels.quant.float_triton import fits_k, quant_gate_up
    part = w.parts[0]
    blocks = policy.quant_blocks(part.qtype, part.rows, part.cols, "gate_up")
    if not fits_k(part, blocks["block_k"]):
        return None
    return quant_gate_up(x, part, norm, eps, block_m=policy.row_tile(x.shape[0], w.nbytes),
                         act=act, **blocks)


def _project_a8(x: torch.Tensor, w: QuantWeight, res: torch.Tensor | None,
                norm: torch.Tensor | None, eps: float, out_dtype: torch.dtype,
                codes: Codes | None = None) -> torch.Tensor:
    """rmsnorm(x) (with norm) or x, each row quantized to int8 once (or given as codes), @ w^T
    (+ res): one kernel a part (a8_triton.py, at its own blocks)."""
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    rows = codes if codes is not None else quantize_rows(x, norm, eps)
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device)
    col = 0
    for part in w.parts:
        cols = slice(col, col + part.rows)
        a8_mm(rows, part, None if res is None else res[:, cols], out=out[:, cols])
        col += part.rows
    return out


def embed_rows(tokens: torch.Tensor, w: torch.Tensor | QuantWeight, dtype: torch.dtype,
               policy: KernelPolicy) -> torch.Tensor:
    """The token embedding's rows for tokens [R] -> [R, D] in `dtype`: gathered, and
    dequantized on the gather where the table is quantized."""
    if isinstance(w, QuantWeight):
        return w.gather(tokens, dtype, policy.triton)
    return torch.nn.functional.embedding(tokens, w)
