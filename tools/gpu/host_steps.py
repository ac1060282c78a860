"""The host steps of a first stage's decode window before its graph runs, each timed alone
(an experiment, not a test), with alternatives side by side. Usage:
host_steps.py MODEL (a small model: the host work does not depend on its size)"""
import sys
import time
from statistics import median

import torch

from strata.model.gguf_file import ModelFile
from strata.stage_worker.model import KVCache, Rows, RowTensors, StageModel
from strata.stage_worker.runner import WindowRunner


def main(path):
    torch.cuda.set_device(0)
    model = StageModel(ModelFile(path), 0, 2, ctx=512, device="cuda:0")
    cache = KVCache(2, 8, model.cfg, 512, model.device, model.dtype)
    runner = WindowRunner(model, cache, 8)
    tokens = [5] + [0] * 7
    rows = Rows([0] + [-1] * 7, [100] + [0] * 7)
    with torch.inference_mode():
        runner.run(torch.tensor(tokens), rows)
        cap = next(iter(runner.graphs.values()))
        static, stage = cap.inputs[0], cap.staging[0]
        plain = torch.empty_like(stage, pin_memory=False)
        torch.cuda.cudart().cudaHostRegister(plain.data_ptr(), plain.numel() * 8, 0)
        steps = {}

        def timed(name, fn):
            a = time.perf_counter()
            out = fn()
            steps.setdefault(name, []).append((time.perf_counter() - a) * 1e6)
            return out

        for _ in range(300):
            torch.cuda.synchronize()
            time.sleep(0.0005)
            timed("whole runner.run (to the replay's return)",
                  lambda: runner.run(torch.tensor(tokens), rows))
            torch.cuda.synchronize()
            time.sleep(0.0005)
            packed = timed("RowTensors.pack with tokens",
                           lambda: RowTensors.pack(rows, cache.trash, tokens))
            timed("staged.synchronize", cap.staged.synchronize)
            timed("staged.query", cap.staged.query)
            timed("copy into pinned staging", lambda: stage.copy_(packed))
            timed("H2D from caching-allocator pinned", lambda: static.copy_(stage, non_blocking=True))
            timed("copy into registered buffer", lambda: plain.copy_(packed))
            timed("H2D from registered buffer", lambda: static.copy_(plain, non_blocking=True))
            timed("event record", cap.staged.record)
            timed("graph.replay", cap.graph.replay)
            timed("torch.inference_mode enter+exit", lambda: torch.inference_mode().__enter__())
    for name, v in steps.items():
        print(f"  {median(v):8.1f} us  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
