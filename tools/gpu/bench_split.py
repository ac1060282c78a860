"""Split-K for the narrow projections of a decode window (qkv with its norm folded in, o and
down with the residual) against one program per column block, side by side (a device-call
experiment, not a test). Usage: bench_split.py MODEL

1. At the llama3-8b shapes, M = 8: each (block_n, block_k, stages, split) checked against the
   reference, for row independence and for the same bits over 64 launches (the parts are added
   in order whichever program finishes last), and timed in a CUDA graph with the weights
   rotating past L2 (bench_kernels.timed).
2. Layers 0:16 and 16:32 of MODEL replayed as a stage's 8-row decode window, with the blocks
   of fused.py, then with each shape's fastest variant of part 1.
"""
import itertools
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_fold import D, FFN, H, HD, KV, _table, _weights, bf  # noqa: E402
from bench_kernels import timed  # noqa: E402

from strata.kernels import fused, skinny_triton as sk  # noqa: E402
from strata.model.gguf_file import ModelFile  # noqa: E402
from strata.stage_worker.graphs import WindowRunner  # noqa: E402
from strata.stage_worker.model import KVCache, Rows, StageModel  # noqa: E402

SHAPES = {"qkv": ((H + 2 * KV) * HD, D), "o": (D, D), "down": (D, FFN)}


def kernels() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, D, generator=g, **bf)
    norm = 1 + 0.1 * torch.randn(D, generator=g, **bf)
    best = {}
    for name, (n, k) in SHAPES.items():
        ws = _weights(n, k, g)
        copies = len(ws)
        xk = x if k == D else torch.randn(8, k, generator=g, **bf)
        res = None if name == "qkv" else torch.randn(8, n, generator=g, **bf)
        kw = dict(norm=norm, eps=1e-5) if name == "qkv" else dict(res=res)
        ref = sk.skinny_mm_torch(xk, ws[0], res, kw.get("norm"), 1e-5)
        rows = []
        for bn, bk, st, split in itertools.product((16, 32, 64), (128, 256), (4, 5), (1, 2, 4)):
            if n % bn or k % (bk * split):
                continue
            b = dict(block_n=bn, block_k=bk, stages=st, split=split)
            try:
                out = sk.skinny_mm(xk, ws[0], **kw, **b)
            except Exception as e:
                print(f"  {name} {b}: {type(e).__name__}")
                continue
            err = (out.float() - ref.float()).abs().max().item()
            one = {**kw, "res": res[3:4]} if res is not None else kw
            alone = torch.equal(sk.skinny_mm(xk[3:4], ws[0], **one, **b)[0], out[3])
            same = all(torch.equal(sk.skinny_mm(xk, ws[0], **kw, **b), out) for _ in range(64))
            us = timed(lambda i: sk.skinny_mm(xk, ws[i % copies], **kw, **b))
            rows.append((f"{bn}x{bk} s{st} split {split} err {err:.3g} rowind {alone} "
                         f"repeat {same}", us, b, alone and same))
        current = fused.skinny_blocks(n, k, "qkv" if name == "qkv" else "res")
        label = f"{current['block_n']}x{current['block_k']} s{current['stages']} split 1"
        ok = [r for r in rows if r[3]]
        best[name] = min(ok, key=lambda r: r[1])[2]
        _table(f"{name} (fused.py: {label})", ws[0], [r[:2] for r in rows])
        print(f"  fastest: {best[name]}")
    return best


def stages(path: str, best: dict) -> None:
    original = fused.skinny_blocks

    def with_best(n, k, kind="plain"):
        for name, shape in SHAPES.items():
            if (n, k) == shape and kind == ("qkv" if name == "qkv" else "res"):
                return {**best[name], "warps": 4}
        return original(n, k, kind)

    for span in ((0, 16), (16, 32)):
        model = StageModel(ModelFile(path), *span, ctx=512, device="cuda:0")
        cfg = model.cfg
        inputs = (torch.randint(0, cfg.vocab, (8,)) if model.first
                  else torch.randn(8, cfg.d_model).to(model.dtype))
        rows = Rows(list(range(8)), [256] * 8)
        for label, blocks in (("fused.py", original), ("split", with_best),
                              ("fused.py", original), ("split", with_best)):
            fused.skinny_blocks = blocks
            cache = KVCache(len(model.layers), 8, cfg, 512, model.device, model.dtype,
                            trash_slot=True)
            runner = WindowRunner(model, cache, 8)
            with torch.inference_mode():
                runner.layers(inputs, rows)
                graph = runner.graphs[("layers+head" if runner.window_head is not None
                                       else "layers", 8)].graph
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                for _ in range(3):
                    graph.replay()
                a.record()
                for _ in range(40):
                    graph.replay()
                b.record()
                b.synchronize()
            print(f"stage {span}: {a.elapsed_time(b) / 40:.3f} ms  {label}")
        del model, runner, cache
        torch.cuda.empty_cache()
    fused.skinny_blocks = original


if __name__ == "__main__":
    torch.cuda.set_device(0)
    best = kernels()
    if len(sys.argv) > 1:
        stages(sys.argv[1], best)
