"""`strata-bench peer`: the arms strata is compared with, on the same GGUF.

  transformers  HF transformers `generate` on one device, the harness's prompts (the default)
  llama.cpp     llama.cpp's `llama-batched-bench` from --bin DIR: prompts of --prompt-tokens
                tokens, --tokens generated each, at each client count; its decode rate and its
                rate of prompt and generated tokens, as `strata-bench sweep --prompt-tokens`
                reports them (strata/bench/llamacpp.py)

transformers is not a dependency of strata (the `test` extra installs it); without it the
command says how to install it."""
from __future__ import annotations

import json
import time

import click
from click.core import ParameterSource

from strata.bench import harness, llamacpp
from strata.bench.harness import machine
from strata.bench.sweep import parse_clients
from strata.launch.options import clean_errors
from strata.model.registry import DEFAULT_MODEL, resolve_model

INSTALL = ("the peer arm runs HF transformers, which is not installed here; install it with "
           "pip install 'transformers>=4.46' (or install strata with its test extra: "
           "pip install -e '.[test]')")
# options that only one engine reads
ONLY = {"transformers": ("device", "batch"),
        "llama.cpp": ("bin_dir", "devices", "clients", "prompt_tokens", "json_out")}
FLAG = {"device": "--device", "batch": "--batch", "bin_dir": "--bin", "devices": "--devices",
        "clients": "--clients", "prompt_tokens": "--prompt-tokens", "json_out": "--json-out"}


@click.command()
@click.option("--engine", type=click.Choice(["transformers", "llama.cpp"]),
              default="transformers", show_default=True)
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--tokens", type=int, default=32, show_default=True,
              help="Tokens generated per request (llama.cpp: -ntg).")
@click.option("--device", default="cuda:0", show_default=True, help="transformers: the device.")
@click.option("--batch", type=int, default=8, show_default=True,
              help="transformers: requests decoded together.")
@click.option("--bin", "bin_dir", type=click.Path(file_okay=False), default=None,
              help="llama.cpp: the folder holding llama-batched-bench (its build/bin).")
@click.option("--devices", default="cuda:0", show_default=True,
              help="llama.cpp: cpu, one CUDA device, or several (split by layer: -sm layer).")
@click.option("--clients", default="1,8,16,32,64", show_default=True,
              help="llama.cpp: client counts (-npl), each with a prompt of its own.")
@click.option("--prompt-tokens", type=int, default=128, show_default=True,
              help="llama.cpp: tokens in every client's prompt (-npp).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None,
              help="llama.cpp: write the rows as JSON, for strata-bench sweep --peer-json.")
@clean_errors("strata-bench peer")
def peer(engine, model, tokens, **options):
    """The peer arms: HF transformers `generate` (eager; bf16 on CUDA, fp32 on CPU) on one
    device with the harness's prompts, or llama.cpp's llama-batched-bench (--engine llama.cpp
    --bin DIR) at each client count; both on the same GGUF, printing tok/s."""
    ctx = click.get_current_context()
    for name in (n for other, names in ONLY.items() if other != engine for n in names):
        if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
            raise ValueError(f"{FLAG[name]} is for --engine {_engine_of(name)}, not {engine}; "
                             f"leave it out or pick that engine")
    if tokens < 1:
        raise ValueError(f"--tokens {tokens}: give 1 or more tokens per request")
    if engine == "llama.cpp":
        run_llamacpp(model, tokens, **{k: options[k] for k in ONLY["llama.cpp"]})
    else:
        run_transformers(model, tokens, options["device"], options["batch"])


def _engine_of(name: str) -> str:
    return next(engine for engine, names in ONLY.items() if name in names)


def run_llamacpp(model: str, tokens: int, bin_dir: str | None, devices: str, clients: str,
                 prompt_tokens: int, json_out: str | None) -> None:
    """llama-batched-bench on the model: one row per client count, as a table and JSON."""
    if bin_dir is None:
        raise ValueError(f"--engine llama.cpp needs --bin DIR, the folder holding "
                         f"{llamacpp.BINARY}; {llamacpp.BUILD}")
    if prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens {prompt_tokens}: give 1 or more tokens per prompt")
    counts = parse_clients(clients)
    path = resolve_model(model)
    cmd = llamacpp.command(bin_dir, path, prompt_tokens, tokens, counts, devices)
    rows, _ = llamacpp.run(cmd, counts)
    click.echo(f"# llama.cpp {llamacpp.BINARY}, {path.name}, {prompt_tokens}-token prompts, "
               f"{tokens} tokens each, {devices}; {machine()}")
    click.echo(f"# {' '.join(cmd)}")
    click.echo(f"{'clients':>7} {'prompt tok/s':>12} {'decode tok/s':>12} {'pp+tg tok/s':>11}")
    for r in rows:
        click.echo(f"{r['clients']:>7} {r['prompt_tok_s']:>12.2f} {r['decode_tok_s']:>12.2f} "
                   f"{r['prompt_and_generated_tok_s']:>11.2f}")
    if json_out:
        conditions = {"engine": "llama.cpp", "model": path.name, "prompt_tokens": prompt_tokens,
                      "tokens_per_client": tokens, "clients": counts, "devices": devices,
                      "command": cmd}
        with open(json_out, "w") as f:
            json.dump({"machine": machine(), "conditions": conditions, "results": rows}, f,
                      indent=2)


def run_transformers(model: str, tokens: int, device: str, batch: int) -> None:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError(INSTALL) from None
    import torch

    from strata.model.gguf_file import ModelFile
    from strata.model.tokenizer import Tokenizer

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
