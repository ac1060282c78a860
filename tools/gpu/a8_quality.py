"""What int8 activations change, against transformers: a GGUF model in transformers' own
modeling code (fp32, the reference) answers each prompt greedily; then strata's whole model as
one stage reads the prompt as a chunk and the answer through 1-row decode windows (as a lone
client decodes), once per arm: `float` (--weights quantized: the packed kernels, bf16 rows),
`int8` (the same with --activations int8) and `bf16` (--weights bf16, the matrices widened).
Per arm: how often its argmax is the reference's greedy token, and the logits' relative error
(|strata - reference| / |reference| per position: median and worst).

With --device cpu (fp32 stages, weights widened: the kernels' arms are CUDA's) the int8 arm is
emulated: each decode-window projection's rows, normed where the kernels fold the norm in, are
quantized per 32 values as quantize_rows does (a8.quantize_rows_torch) and multiplied back out
before the fp32 matmul: what int8 activations change, without the packed kernels' rounding.
--act-block 256 emulates a scale per 256 values instead (as llama.cpp's q8_K on the CPU; rows
of K not a multiple of 256 take the largest of 128, 64, 32 that divides it), which the kernels
do not have: what such a scale would cost. --act-bits 12 emulates codes of 12 bits (|q| up to
2047) instead of 8, a scale a block as above: whether finer codes buy back a wider block's
loss.

    python tools/gpu/a8_quality.py [--model smollm2-135m] [--prompts tools/handwritten_prompts.jsonl]
        [--requests 24] [--tokens 64] [--arms float,int8,bf16] [--device cuda:0]
        [--act-block 32] [--act-bits 8] [--json-out F]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path
from statistics import median

import torch

from strata.kernels.policy import KernelPolicy
from strata.model.gguf_file import ModelFile
from strata.model.registry import resolve_model
from strata.stage_worker.model import KVCache, Rows, StageModel

ARMS = {"float": ("quantized", False), "int8": ("quantized", True), "bf16": ("bf16", False)}


def reference(path: Path, prompts: list[str], tokens: int, device: str):
    """[(prompt ids, answer ids, fp32 logits [len(answer), vocab])] from transformers."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).to(device).eval()
    out = []
    for text in prompts:
        if tok.chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True, return_tensors="pt")
            ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        else:
            ids = tok(text, return_tensors="pt").input_ids
        ids = ids.to(device)
        with torch.inference_mode():
            gen = hf.generate(ids, max_new_tokens=tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        answer = gen.sequences[0, ids.shape[1]:]
        logits = torch.stack(gen.logits, 1)[0, : len(answer)].float()
        out.append((ids[0].tolist(), answer.tolist(), logits))
    return out


def strata_logits(model: StageModel, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """fp32 logits [len(answer), vocab]: the prompt as one chunk (its last row's logits predict
    answer[0]), then answer[:-1] one decode window of 1 row each."""
    n = len(prompt)
    cache = KVCache(len(model.layers), 1, model.cfg, n + len(answer) + 1, model.device,
                    model.dtype)
    rows = []
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt, device=model.device), Rows([0] * n, list(range(n))),
                       cache, chunk=True)
        cache.filled[0] = n
        rows.append(model.logits(hidden[-1:]).float())
        for i, token in enumerate(answer[:-1]):
            hidden = model(torch.tensor([token], device=model.device), Rows([0], [n + i]), cache)
            rows.append(model.logits(hidden).float())
    return torch.cat(rows)


@contextlib.contextmanager
def emulated_int8(block: int = 32, bits: int = 8):
    """CPU stages whose decode projections see their rows quantized to int8 (codes of `bits`
    bits) and back, a scale per `block` values (or the largest of 128, 64, 32 dividing a row's
    K where `block` does not; the module says why); the head's rows too."""
    from strata.kernels import fused
    from strata.kernels.quant.a8 import quantize_rows_torch
    from strata.stage_worker import model as stage_model

    def rounded(x):
        m, k = x.shape
        b = next(b for b in (block, 128, 64, 32) if k % b == 0)   # a row of K not whole blocks
        q, dx = quantize_rows_torch(x, block=b, top=2 ** (bits - 1) - 1)
        return (q.float().view(m, k // b, b) * dx[..., None]).view(m, k).to(x.dtype)

    linear = fused.linear_rows
    head = stage_model.StageModel._head_block

    def linear_rows(x, w, res=None, policy=None, decode=False):
        return linear(rounded(x) if decode else x, w, res, policy, decode)

    def head_block(self, hidden, w):
        h = stage_model.rms_norm(hidden, self.norm, self.cfg.rms_eps)
        return torch.nn.functional.linear(rounded(h.float()), w.float())

    patches = [(fused, "linear_rows", linear_rows), (stage_model, "linear_rows", linear_rows),
               (stage_model.StageModel, "_head_block", head_block)]
    saved = [(o, n, getattr(o, n)) for o, n, _ in patches]
    try:
        for o, n, f in patches:
            setattr(o, n, f)
        yield
    finally:
        for o, n, f in saved:
            setattr(o, n, f)
    assert fused.linear_rows is linear and stage_model.StageModel._head_block is head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default=str(Path(__file__).parents[1] / "handwritten_prompts.jsonl"))
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--arms", default="float,int8,bf16")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--act-block", type=int, default=32,
                    help="with --device cpu: the emulated int8 arm's values a scale (32 as the "
                         "kernels, or 256)")
    ap.add_argument("--act-bits", type=int, default=8,
                    help="with --device cpu: the emulated arm's bits a code (8 as the kernels)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    path = resolve_model(args.model)
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines()
               if line.strip()][: args.requests]
    ref = reference(path, prompts, args.tokens, args.device)
    file = ModelFile(path)
    base = KernelPolicy.for_device(args.device)
    print(f"# {path.name}, {len(ref)} prompts of {args.prompts}, up to {args.tokens} greedy "
          f"tokens by transformers (fp32), on {args.device}"
          + (f" (int8 emulated, {args.act_bits}-bit codes, a scale per {args.act_block}: "
             f"the module says how)"
             if args.device == "cpu" else ""))
    print(f"{'arm':>6} {'positions':>9} {'argmax = greedy':>16} {'rel. error median':>18} "
          f"{'worst':>8}")
    results = {}
    for arm in args.arms.split(","):
        weights, int8 = ARMS[arm]
        model = StageModel(file, 0, file.config.n_layers, ctx=4096, device=args.device,
                           weights=weights,
                           policy=dataclasses.replace(base, int8_activations=int8))
        same, errors = 0, []
        emulate = ((lambda: emulated_int8(args.act_block, args.act_bits))
                   if int8 and args.device == "cpu" else contextlib.nullcontext)
        for prompt, answer, want in ref:
            with emulate():
                got = strata_logits(model, prompt, answer)
            same += int((got.argmax(-1) == torch.tensor(answer, device=got.device)).sum())
            errors += ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
        results[arm] = dict(positions=len(errors), argmax_is_greedy=same / len(errors),
                            rel_error_median=median(errors), rel_error_worst=max(errors))
        r = results[arm]
        print(f"{arm:>6} {r['positions']:>9} {r['argmax_is_greedy']:>16.2%} "
              f"{r['rel_error_median']:>18.4f} {r['rel_error_worst']:>8.4f}")
        del model
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"model": path.name, "device": args.device, "tokens": args.tokens,
             "act_block": args.act_block if args.device == "cpu" else 32,
             "act_bits": args.act_bits if args.device == "cpu" else 8,
             "requests": len(ref), "arms": results}, indent=1))


if __name__ == "__main__":
    main()
