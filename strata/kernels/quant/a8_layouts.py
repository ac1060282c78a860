"""The register layouts of the Gluon int8 MMA (a8_gluon.py, a8_ring.py): mma.sync m16n8k32's
accumulator over the warps, the A fragments' bytes as a thread loads them, and the rows' dc
plane values where the accumulator holds their columns."""
from __future__ import annotations

from triton.experimental.gluon import language as gl


def mma_layout(warps: int, warps_m: int = 1) -> gl.NVMMADistributedLayout:
    """mma.sync m16n8's accumulator over `warps` warps: along the weight's rows, or with
    warps_m > 1 also that many along the window's rows (warps_m warps share a weight row)."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps // warps_m, warps_m],
                                     instr_shape=[16, 8])


def raw_layout(block_n: int, warps: int, warps_m: int = 1) -> gl.DistributedLinearLayout:
    """[block_n, 16] bytes as the int8 A fragments of mma.sync m16n8k32 hold their rows (warp
    w rows 16 w .. 16 w + 15 and again every 16 warps' rows, lane l rows l / 4 and l / 4 + 8):
    lane l the 4 bytes 4 (l % 4) .. of each of its rows; the warps along the window's rows
    (mma_layout's warps_m) hold the same."""
    wn = warps // warps_m
    reps = [[16 * wn << i, 0] for i in range((block_n // (16 * wn)).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]] + reps,
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=([[0, 0] for _ in range(warps_m.bit_length() - 1)]   # a warp's id: m first
                    + [[16 << i, 0] for i in range(wn.bit_length() - 1)]),
        block_bases=[], shape=[block_n, 16])


def dc_layout(block_m: int, warps: int, width: int = 2,
              warps_m: int = 1) -> gl.DistributedLinearLayout:
    """[block_m, width]: each column's dc plane values (Codes.dc) where the m16n8 accumulator
    holds the column (lane l: columns 2 (l % 4) and 2 (l % 4) + 1 of every 8, warp m of
    mma_layout's warps_m the 8 columns 8 m .. of every 8 warps_m), a column's in the thread."""
    wn = warps // warps_m
    return gl.DistributedLinearLayout(
        reg_bases=([[0, 1 << i] for i in range(width.bit_length() - 1)] + [[1, 0]]
                   + [[8 * warps_m << i, 0]
                      for i in range((block_m // (8 * warps_m)).bit_length() - 1)]),
        lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
        warp_bases=([[8 << i, 0] for i in range(warps_m.bit_length() - 1)]
                    + [[0, 0] for _ in range(wn.bit_length() - 1)]),
        block_bases=[], shape=[block_m, width])
