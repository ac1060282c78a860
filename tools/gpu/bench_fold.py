"""Folded decode-window kernels against the kernels apart, and programmatic dependent launch,
side by side (an experiment, not a test). Usage: bench_fold.py (part 1);
bench_fold.py MODEL START:END (part 2); bench_fold.py head (part 3)

1. At the llama3-8b shapes, M = 8: norm + qkv (apart: rms_norm_rows, skinny_mm) against
   skinny_mm with the norm folded in, in several blocks, and norm + gate_up + SiLU against
   gate_up_silu; each checked against its reference and for row independence, timed in a
   CUDA graph with the weights rotating past L2 (bench_kernels.timed).
2. Layers START:END of MODEL as a stage replays an 8-row decode window, each projection's
   fold on or off (a KernelPolicy's fold).
3. The head (128256 x 4096): final norm and fp32 logits by cuBLAS against the skinny kernel.
"""
import dataclasses
import itertools
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernels import HBM, timed  # noqa: E402

from strata.kernels import fused, skinny_triton as sk  # noqa: E402
from strata.kernels.policy import KernelPolicy  # noqa: E402
from strata.model.gguf_file import ModelFile  # noqa: E402
from strata.stage_worker.model import KVCache, Rows, StageModel  # noqa: E402
from strata.stage_worker.runner import WindowRunner  # noqa: E402

D, FFN, H, KV, HD = 4096, 14336, 32, 8, 128
bf = dict(device="cuda", dtype=torch.bfloat16)


def _weights(n, k, g):
    copies = max(2, -(-200_000_000 // (n * k * 2)))
    return [torch.randn(n, k, generator=g, **bf) * 0.02 for _ in range(copies)]


def kernels():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, D, generator=g, **bf)
    norm = 1 + 0.1 * torch.randn(D, generator=g, **bf)

    ws = _weights((H + 2 * KV) * HD, D, g)
    n = len(ws)
    plain = KernelPolicy(triton=True).skinny_blocks(*ws[0].shape)
    rows = [("apart: norm, skinny", timed(lambda i: sk.skinny_mm(
        fused.rms_norm_rows(x, norm, 1e-5), ws[i % n], **plain)))]
    ref = fused.skinny_mm_torch(x, ws[0], None, norm, 1e-5)
    for bn, bk, st in itertools.product((32, 64), (64, 128, 256), (4, 5)):
        b = dict(block_n=bn, block_k=bk, stages=st)
        try:
            out = sk.skinny_mm(x, ws[0], None, norm, 1e-5, **b)
        except Exception as e:
            print(f"  skinny_mm+norm {b}: {type(e).__name__}")
            continue
        err = (out.float() - ref.float()).abs().max().item()
        alone = torch.equal(sk.skinny_mm(x[3:4], ws[0], None, norm, 1e-5, **b)[0], out[3])
        us = timed(lambda i: sk.skinny_mm(x, ws[i % n], None, norm, 1e-5, **b))
        rows.append((f"skinny_mm+norm {bn}x{bk} s{st} err {err:.3g} rowind {alone}", us))
    _table("norm + qkv", ws[0], rows)

    ws = _weights(2 * FFN, D, g)
    n = len(ws)
    wide = KernelPolicy(triton=True).skinny_blocks(*ws[0].shape)
    rows = [("apart: norm, skinny, silu", timed(lambda i: fused.silu_mul(
        sk.skinny_mm(fused.rms_norm_rows(x, norm, 1e-5), ws[i % n], **wide))))]
    ref = fused.gate_up_silu_torch(x, ws[0], norm, 1e-5)
    for bn, bk, st in itertools.product((32, 64), (64, 128), (3, 4, 5)):
        b = dict(block_n=bn, block_k=bk, stages=st)
        try:
            h = sk.gate_up_silu(x, ws[0], norm, 1e-5, **b)
        except Exception as e:
            print(f"  gate_up_silu {b}: {type(e).__name__}")
            continue
        err = (h.float() - ref.float()).abs().max().item()
        alone = torch.equal(sk.gate_up_silu(x[5:6], ws[0], norm, 1e-5, **b)[0], h[5])
        us = timed(lambda i: sk.gate_up_silu(x, ws[i % n], norm, 1e-5, **b))
        rows.append((f"gate_up_silu {bn}x{bk} s{st} err {err:.3g} rowind {alone}", us))
    _table("norm + gate_up + silu", ws[0], rows)


def head():
    """The last stage's head at llama3-8b's vocabulary: final norm + fp32 logits by cuBLAS
    (the plain path: final norm, then cuBLAS with fp32 output) against the skinny kernel with the norm folded in."""
    from strata.kernels.norms import rms_norm
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, D, generator=g, **bf)
    norm = 1 + 0.1 * torch.randn(D, generator=g, **bf)
    ws = _weights(128256, D, g)
    n = len(ws)
    rows = [("apart: norm, cublas mm fp32 out", timed(lambda i: torch.mm(
        rms_norm(x, norm, 1e-5), ws[i % n].t(), out_dtype=torch.float32), n=8))]
    ref = fused.skinny_mm_torch(x, ws[0], None, norm, 1e-5, out_dtype=torch.float32)
    for bn, bk, st in ((128, 128, 3), (64, 128, 4), (64, 128, 5), (64, 256, 4), (128, 64, 4),
                       (64, 64, 4), (32, 256, 5)):
        b = dict(block_n=bn, block_k=bk, stages=st, out_dtype=torch.float32)
        try:
            out = sk.skinny_mm(x, ws[0], None, norm, 1e-5, **b)
        except Exception as e:
            print(f"  head {bn}x{bk} s{st}: {type(e).__name__}")
            continue
        err = (out - ref).abs().max().item()
        alone = torch.equal(sk.skinny_mm(x[2:3], ws[0], None, norm, 1e-5, **b)[0], out[2])
        us = timed(lambda i: sk.skinny_mm(x, ws[i % n], None, norm, 1e-5, **b), n=8)
        rows.append((f"skinny_mm+norm fp32 {bn}x{bk} s{st} err {err:.3g} rowind {alone}", us))
    _table("norm + head", ws[0], rows)


def _table(name, w, rows):
    limit = w.numel() * 2 / HBM * 1e6
    rows.sort(key=lambda r: r[1])
    print(f"{name} {tuple(w.shape)}, HBM limit {limit:.1f} us:")
    for label, us in rows[:8] + [r for r in rows[8:] if r[0].startswith("apart")]:
        print(f"  {us:7.1f} us ({limit / us:4.0%})  {label}")


def stage(path, span):
    start, end = (int(x) for x in span.split(":"))
    file = ModelFile(path)
    model = StageModel(file, start, end, ctx=512, device="cuda:0")
    cfg = model.cfg
    inputs = (torch.randint(0, cfg.vocab, (8,)) if model.first
              else torch.randn(8, cfg.d_model).to(model.dtype))
    rows = Rows(list(range(8)), [256] * 8)
    weights = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    print(f"stage [{start}:{end}]: {weights / 1e9:.2f} GB of layer weights, "
          f"HBM limit {weights / HBM * 1e3:.3f} ms")
    base = None
    for fold in (set(), {"gate_up"}, {"qkv"}, {"qkv", "gate_up"}, {"qkv", "gate_up", "head"}):
        policy = dataclasses.replace(model.policy, fold=frozenset(fold))
        model = StageModel(file, start, end, ctx=512, device="cuda:0", policy=policy)
        cache = KVCache(len(model.layers), 8, cfg, 512, model.device, model.dtype)
        runner = WindowRunner(model, cache, 8)
        with torch.inference_mode():
            out = runner.run(inputs, rows)[0].clone()
            graph = runner.graphs[("layers+head" if model.last else "layers", 8)].graph
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(3):
                graph.replay()
            a.record()
            for _ in range(40):
                graph.replay()
            b.record()
            b.synchronize()
        base = out if base is None else base
        err = (out.float() - base.float()).norm() / base.float().norm()
        print(f"  {a.elapsed_time(b) / 40:.3f} ms  folded {sorted(fold) or 'none'} "
              f"(hidden vs apart: relative {err:.2g})")


if __name__ == "__main__":
    torch.cuda.set_device(0)
    if len(sys.argv) > 2:
        stage(sys.argv[1], sys.argv[2])
    elif sys.argv[1:] == ["head"]:
        head()
    else:
        kernels()
