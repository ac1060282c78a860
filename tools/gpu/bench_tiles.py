"""Decode windows of 8 to 64 rows: the skinny matmul's two row-tile designs side by side (an
experiment, not a test), with cuBLAS beside them.

    fit  BLOCK_M = the smallest tile of 16, 32, 64 rows that holds the window: one program
         reads each weight tile once for all rows
    16   BLOCK_M = 16, a grid over row blocks: the same compiled code for every M, but the
         weight is read once per row block (neighbouring programs share it through L2)

Part 1 (`kernels`): each projection of the llama3-8b and SmolLM2 shapes at M = 1, 8, 16, 32, 64:
us per call (from a CUDA graph, weights rotated beyond L2) for fit, 16 and cuBLAS, and whether
row 0's bits equal those at M = 8 ("=" yes, "x" no).

Part 2 (`stage MODEL.gguf`): a whole stage (all layers and the head) replayed from its CUDA
graph for windows of 8, 16, ..., 64 live rows, each design and the default policy (16-row
tiles for weights under 16 MB, else fit): ms per window.

    python tools/gpu/bench_tiles.py kernels
    python tools/gpu/bench_tiles.py stage l8b.gguf
"""
from __future__ import annotations

import dataclasses
import statistics
import sys

import torch
import torch.nn.functional as F

from strata.kernels import fused
from strata.kernels.policy import KernelPolicy

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernels import timed  # noqa: E402

SHAPES = {"llama3-8b": [("qkv", 6144, 4096), ("res", 4096, 4096), ("gate_up", 28672, 4096),
                        ("res", 4096, 14336), ("head", 128256, 4096)],
          "smollm2": [("qkv", 960, 576), ("res", 576, 576), ("gate_up", 3072, 576),
                      ("res", 576, 1536), ("head", 49152, 576)]}
DESIGNS = {"fit": dict(row_tiles=(16, 32, 64), fit_min_bytes=0), "16": dict(row_tiles=(16,)),
           "default": {}}   # default: 16-row tiles for weights under 16 MB, else fit
ROWS = (1, 8, 16, 32, 64)


def _cublas(kind, x, w, norm, res):
    if kind == "qkv":
        return F.linear(fused.rms_norm_rows(x, norm, 1e-5), w)
    if kind == "gate_up":
        return fused.silu_mul(F.linear(fused.rms_norm_rows(x, norm, 1e-5), w))
    if kind == "head":   # fp32 logits where this torch's mm gives them, else bf16 upcast
        h = fused.rms_norm_rows(x, norm, 1e-5)
        if KernelPolicy.for_device(x.device).mm_fp32_out:
            return torch.mm(h, w.t(), out_dtype=torch.float32)
        return F.linear(h, w).float()
    return torch.addmm(res, x, w.t())


def _ours(policy):
    def run(kind, x, w, norm, res):
        if kind == "qkv":
            return fused.norm_linear_rows(x, norm, 1e-5, w, policy, decode=True)
        if kind == "gate_up":
            return fused.norm_gate_up_silu(x, norm, 1e-5, w, policy, decode=True)
        if kind == "head":
            return fused.norm_head_rows(x, norm, 1e-5, w, policy)
        return fused.linear_rows(x, w, res, policy, decode=True)
    return run


def kernels() -> None:
    base = KernelPolicy.for_device("cuda")
    arms = {name: _ours(dataclasses.replace(base, **d)) for name, d in DESIGNS.items()
            if name != "default"}
    arms["cublas"] = _cublas
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for model, shapes in SHAPES.items():
        print(f"== {model}: us per call (row 0's bits vs M = 8)")
        print(f"{'kind':>8} {'n x k':>13} {'M':>3} " + " ".join(f"{a:>12}" for a in arms))
        for kind, n, k in shapes:
            copies = max(2, -(-200_000_000 // (n * k * 2)))
            ws = [torch.randn(n, k, generator=g, **bf) * 0.02 for _ in range(copies)]
            norm = 1 + 0.1 * torch.randn(k, generator=g, **bf)
            x64 = torch.randn(64, k, generator=g, **bf)
            out_n = n // 2 if kind == "gate_up" else n
            r64 = torch.randn(64, out_n, generator=g, **bf)
            ref = {a: f(kind, x64[:8], ws[0], norm, r64[:8])[0] for a, f in arms.items()}
            for m in ROWS:
                x, r = x64[:m], r64[:m]
                cells = []
                for a, f in arms.items():
                    us = timed(lambda i, f=f: f(kind, x, ws[i % copies], norm, r))
                    same = "=" if torch.equal(f(kind, x, ws[0], norm, r)[0], ref[a]) else "x"
                    cells.append(f"{us:10.1f} {same}")
                print(f"{kind:>8} {f'{n}x{k}':>13} {m:>3} " + " ".join(cells))
            del ws


def stage(path: str, iters: int = 50) -> None:
    from strata.model.gguf_file import ModelFile
    from strata.stage_worker.model import KVCache, Rows, StageModel
    from strata.stage_worker.runner import WindowRunner

    file = ModelFile(path)
    cfg = file.config
    base = KernelPolicy.for_device("cuda:0")
    sizes = tuple(range(8, 65, 8))
    print(f"== {file.path.name}: one stage of {cfg.n_layers} layers and the head, graph "
          f"replay ms per window of R live rows (context 256)")
    print(f"{'design':>7} " + " ".join(f"{r:>7}" for r in sizes))
    model = StageModel(file, 0, cfg.n_layers, ctx=320, device="cuda:0", policy=base)
    cache = KVCache(len(model.layers), 64, cfg, 320, model.device, model.dtype)
    for name, design in DESIGNS.items():
        policy = dataclasses.replace(base, **design)
        model.policy = policy          # the same weights under each design's policy
        for layer in model.layers:
            layer.policy = policy
        runner = WindowRunner(model, cache, 16)
        cells = []
        with torch.inference_mode():
            for r in sizes:
                rows = Rows(list(range(r)), [256] * r)
                ids = torch.arange(r) % cfg.vocab
                runner.run(ids, rows, sample_rows=list(range(r)))
                graph = runner.graphs[("layers+head", r)].graph
                times = []
                for _ in range(5):
                    a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    a.record()
                    for _ in range(iters // 5):
                        graph.replay()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) / (iters // 5))
                cells.append(f"{statistics.median(times):7.3f}")
        print(f"{name:>7} " + " ".join(cells), flush=True)
        del runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1] == "kernels":
        kernels()
    else:
        stage(sys.argv[2])
