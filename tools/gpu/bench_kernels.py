"""Decode-window kernels of the llama3-8b shape, alternatives side by side (an
experiment, not a test): each layer matmul at M = 8 by cuBLAS (linear, addmm) and by
kernels/skinny_triton.py in several block configurations (checked against the fp32 reference
and for row independence), and the per-row attention kernel in several configurations."""
import itertools
import math

import torch
import torch.nn.functional as F

from strata.kernels.attention import decode_triton as at
from strata.kernels.fused import skinny_mm_torch
from strata.kernels.skinny_triton import skinny_mm

HBM = 4.25e12
D, FFN, H, KV, HD = 4096, 14336, 32, 8, 128


def timed(fn, n=48) -> float:
    """us per call of fn(i), from a CUDA graph of n calls (eager launches of small kernels
    would measure the host's launch rate, not the kernel). fn(i) picks among weight copies,
    so that no call finds its weights in L2 (as in a stage, where 16 layers stream by)."""
    fn(0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            fn(i)
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / (5 * n) * 1e3


def matmuls():
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    shapes = {"qkv": (6144, D, False), "o+res": (D, D, True), "gate_up": (2 * FFN, D, False),
              "down+res": (D, FFN, True)}
    for name, (n, k, with_res) in shapes.items():
        copies = max(2, -(-200_000_000 // (n * k * 2)))    # more than L2 (50 MB) in all
        ws = [torch.randn(n, k, generator=g, **bf) * 0.02 for _ in range(copies)]
        w = ws[0]
        x = torch.randn(8, k, generator=g, **bf)
        res = torch.randn(8, n, generator=g, **bf) if with_res else None
        limit = n * k * 2 / HBM * 1e6
        rows = []
        if with_res:
            rows.append(("cublas addmm",
                         timed(lambda i: torch.addmm(res, x, ws[i % copies].t()))))
            rows.append(("cublas linear+add", timed(lambda i: F.linear(x, ws[i % copies]) + res)))
        else:
            rows.append(("cublas linear", timed(lambda i: F.linear(x, ws[i % copies]))))
        ref = skinny_mm_torch(x, w, res)
        for bn, bk, st, wp in itertools.product((32, 64, 128), (64, 128, 256), (3, 5), (4, 8)):
            if n % bn or k % bk or (wp == 8 and bn < 128):
                continue
            try:
                out = skinny_mm(x, w, res, block_n=bn, block_k=bk, stages=st, warps=wp)
            except Exception as e:  # e.g. out of shared memory for this block
                print(f"  {name} skinny {bn}x{bk} s{st} w{wp}: {type(e).__name__}")
                continue
            err = (out.float() - ref.float()).abs().max().item()
            # row independence: row 0 beside 7 other rows, and beside 7 different ones
            x2 = torch.cat([x[:1], torch.randn(7, k, generator=g, **bf)])
            same = torch.equal(skinny_mm(x2, w, res, block_n=bn, block_k=bk, stages=st,
                                         warps=wp)[0], out[0])
            us = timed(lambda i: skinny_mm(x, ws[i % copies], res, block_n=bn, block_k=bk,
                                           stages=st, warps=wp))
            rows.append((f"skinny {bn}x{bk} s{st} w{wp} err {err:.3g} rowind {same}", us))
        rows.sort(key=lambda r: r[1])
        print(f"{name} ({n}x{k}), HBM limit {limit:.1f} us:")
        for label, us in rows[:6] + [r for r in rows[6:] if r[0].startswith("cublas")]:
            print(f"  {us:7.1f} us ({limit / us:4.0%})  {label}")


def attention():
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for ctx in (256, 2048):
        kc = torch.randn(9, KV, ctx + 64, HD, generator=g, **bf)
        vc = torch.randn(9, KV, ctx + 64, HD, generator=g, **bf)
        q = torch.randn(8, H, HD, generator=g, **bf)
        slot = torch.arange(8, device="cuda")
        length = torch.full((8,), ctx, device="cuda")
        ref = at.attend_rows_triton(q, kc, vc, slot, length)
        rows = [("current", timed(lambda i: at.attend_rows_triton(q, kc, vc, slot, length)))]
        for bn, st, wp in itertools.product((32, 64, 128), (2, 3, 4), (4, 8)):
            out = torch.empty_like(q)

            def run(i=0):
                at._attend_rows_kernel[(8, KV)](
                    q, kc, vc, out, slot, length, q.stride(0), q.stride(1), out.stride(0),
                    out.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
                    (1.0 / math.sqrt(HD)) * 1.4426950408889634, GROUP=H // KV, HD=HD,
                    BLOCK_G=16, BLOCK_D=HD, BLOCK_N=bn, PRECISION="tf32", num_warps=wp,
                    num_stages=st)
            run()
            err = (out.float() - ref.float()).abs().max().item()
            rows.append((f"BLOCK_N {bn} stages {st} warps {wp} err {err:.2g}", timed(run)))
        rows.sort(key=lambda r: r[1])
        kv_bytes = 2 * 8 * KV * ctx * HD * 2
        print(f"attend_rows, 8 rows x {ctx} keys ({kv_bytes / HBM * 1e6:.1f} us of HBM):")
        for label, us in rows[:5] + [r for r in rows[5:] if r[0] == "current"]:
            print(f"  {us:7.1f} us  {label}")


if __name__ == "__main__":
    torch.cuda.set_device(0)
    matmuls()
    attention()
