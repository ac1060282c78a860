"""`strata-bench peer`: the arm strata is compared with, HF transformers `generate` on one device.

transformers is not a dependency of strata (the `test` extra installs it); without it the
command says how to install it."""
from __future__ import annotations

import time

import click
import torch

from strata.bench import harness
from strata.bench.harness import machine
from strata.launch.options import clean_errors
from strata.model.gguf_file import ModelFile
from strata.model.registry import DEFAULT_MODEL, resolve_model
from strata.model.tokenizer import Tokenizer

INSTALL = ("the peer arm runs HF transformers, which is not installed here; install it with "
           "pip install 'transformers>=4.46' (or install strata with its test extra: "
           "pip install -e '.[test]')")


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--device", default="cuda:0", show_default=True)
@click.option("--batch", type=int, default=8, show_default=True)
@click.option("--tokens", type=int, default=32, show_default=True, help="Tokens per request.")
@clean_errors("strata-bench peer")
def peer(model, device, batch, tokens):
    """The peer arm: HF transformers `generate` (eager; bf16 on CUDA, fp32 on CPU) on one
    device, with the same model and the harness's prompts at the same batch; prints tok/s."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError(INSTALL) from None

    path = resolve_model(model)
    tok = Tokenizer.from_gguf(ModelFile(path).reader)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    hf = hf.to(device).eval()
    prompts = [tok.encode(p) for p in harness.prompt_set(batch)]
    width = max(len(p) for p in prompts)  # left-padded to the longest, as generate expects
    ids = torch.tensor([[tok.eos_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def run(n: int) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=tok.eos_id)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(2)  # warm-up
    seconds = run(tokens)
    click.echo(f"# HF transformers generate, {path.name}, {dtype}, {device}, {machine()}")
    click.echo(f"{'batch':>5} {'tokens':>6} {'total tok/s':>11} {'ms/step':>8}")
    click.echo(f"{batch:>5} {tokens:>6} {batch * tokens / seconds:>11.2f} "
               f"{1e3 * seconds / tokens:>8.1f}")
