"""Int8 activations against quantized weights by exact integer block sums: the arithmetic, in
plain torch, that the Triton kernels (a8_triton.py) are checked against.

A window row x [K] is quantized alone, as llama.cpp's q8_1 is: with `norm`, y = rmsnorm(x) * g
(rsqrt of the mean of squares + eps), else y = x; each block of 32 values gets the scale
dx = max|y| / 127 and codes q = round(y / dx) in -127..127. A weight group (32 quants, 16 for
Q6_K) reads w = a * u + b (weight.py's group_terms) with an unsigned code u; the codes
of Q8_0, IQ4_NL and IQ4_XS are taken signed (u - 128, b = 0) so that every code fits int8.
Then

    sum over the group of w * y  ~=  dx * (a * sum(u * q) + b * sum(q))

where both sums are integers, exact in int32 whatever their order. Only the float terms have
an order: each (row, column) adds its groups' terms one by one, in order along K, in every
kernel. So a row's result is the same bits in a GEMV over a few rows and in an MMA over many.
"""
from __future__ import annotations

import dataclasses

import torch

from strata.kernels.quant.weight import BLOCKS, Part, codes, group_terms

QBLOCK = 32   # activation values a scale


@dataclasses.dataclass(frozen=True)
class Codes:
    """Window rows quantized for the int8 kernels (a8_triton.quantize_rows): codes q int8
    [M, K], scales dx fp32 [M, K / 32], the codes' sums over each 16, qs int32 [M, K / 16]
    (the kernels' b terms need a group's sum; taken once here, not in every tile), and the
    codes again in pair order, qp: each 8 as codes 0, 2, 4, 6, 1, 3, 5, 7, the order in which
    the GEMV takes a word of eight nibbles apart (a8_gemv.py). rows: the window rows they
    came from, where a kernel wrote both (a8_gate_up_silu), for a caller that needs them.
    dc: fp32 [M, K / 32, 4], each block's dx, then its codes' sum times dx and each 16's
    (the products rounded once, as the kernels round them): the Gluon kernels' (a8_gluon.py)
    terms of the rows in one load a block."""
    q: torch.Tensor
    dx: torch.Tensor
    qs: torch.Tensor
    qp: torch.Tensor
    dc: torch.Tensor
    rows: torch.Tensor | None = None

    @staticmethod
    def empty(m: int, k: int, device: torch.device) -> Codes:
        """Planes for m rows of k values, unwritten (a kernel fills them)."""
        q = torch.empty(m, k, dtype=torch.int8, device=device)
        return Codes(q, torch.empty(m, k // QBLOCK, dtype=torch.float32, device=device),
                     torch.empty(m, k // 16, dtype=torch.int32, device=device),
                     torch.empty_like(q),
                     torch.empty(m, k // QBLOCK, 4, dtype=torch.float32, device=device))

    def __getitem__(self, rows: slice) -> Codes:
        return Codes(self.q[rows], self.dx[rows], self.qs[rows], self.qp[rows], self.dc[rows],
                     None if self.rows is None else self.rows[rows])


def quantize_rows_torch(x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0,
                        block: int = QBLOCK, top: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], dx fp32 [M, K / block]) as the module says (the Triton
    quantizer's rounding, up to its division and sum order); `block` values a scale, 32 as
    the kernels, and codes up to `top`, 127 as the kernels (others only to measure what they
    would change: q is then int32)."""
    y = x.float()
    if norm is not None:
        r = torch.rsqrt((y * y).sum(1, keepdim=True) / y.shape[1] + eps)
        y = y * r * norm.float()
    m, k = y.shape
    blocks = y.view(m, k // block, block)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    v = blocks * inv[..., None]
    q = torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(0.5 - v)).clamp(-top, top)
    return q.to(torch.int8 if top <= 127 else torch.int32).view(m, k), amax / top


def signed_terms(part: Part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int64 [N, K], a, b fp32 [N, K / group]) with Q8_0's codes signed (b = 0)."""
    a, b = group_terms(part.qtype, part.planes)
    u = codes(part.qtype, part.planes)
    if part.qtype in ("Q8_0", "IQ4_NL", "IQ4_XS"):
        u, b = u - 128, torch.zeros_like(b)
    return u, a, b


def a8_mm_reference(q: torch.Tensor, dx: torch.Tensor, part: Part) -> torch.Tensor:
    """fp64 [M, N]: sum over groups of dx * (a * sum(u * q) + b * sum(q)), the integer sums
    exact, the rest in float64 (the kernels add the same terms in fp32, group by group)."""
    u, a, b = signed_terms(part)
    group = BLOCKS[part.qtype][2]
    n, k = u.shape
    m = q.shape[0]
    ug = u.view(n, k // group, group)
    qg = q.to(torch.int64).view(m, k // group, group)
    isum = torch.einsum("ngs,mgs->mng", ug, qg).double()          # exact: integers < 2^53
    qsum = qg.sum(-1).double()                                     # [M, G]
    scale = dx.double().repeat_interleave(QBLOCK // group, 1)      # [M, G]
    terms = (a.double()[None] * isum + b.double()[None] * qsum[:, None, :]) * scale[:, None, :]
    return terms.sum(-1)
