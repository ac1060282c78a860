"""`strata-launch`: start the stages, run the coordinator, print the generated text, clean up."""
from __future__ import annotations

import sys

import click

from strata.coordinator.generate import RequestError, Sequence, generate_solo
from strata.coordinator.pipeline import PipelineError, WindowFailed
from strata.coordinator.sampling import SamplingParams
from strata.coordinator.windows import DEFAULT_CHUNK_ROWS, DEFAULT_WINDOW_ROWS
from strata.launch.plan import PlanError, parse_devices, plan_stages
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelError, ModelFile
from strata.model.registry import DEFAULT_MODEL, resolve_model
from strata.model.tokenizer import Tokenizer


def say(text: str) -> None:
    click.echo(text, err=True)


def cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def open_model(model: str, ctx_size: int) -> ModelFile:
    file = ModelFile(resolve_model(model, say=say))
    if ctx_size < 1:
        raise ModelError(f"--ctx-size {ctx_size} is below 1")
    if ctx_size > file.config.ctx_len:
        raise ModelError(f"--ctx-size {ctx_size} exceeds the {file.config.ctx_len} positions "
                         f"the model was trained for; use --ctx-size {file.config.ctx_len} or less")
    return file


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="smollm2-135m (embedded) or the path of a GGUF file.")
@click.option("--layer-split", default="auto", show_default=True,
              help="auto, or layer boundaries K1,K2,..: 12,24 on 30 layers = [0,12) [12,24) [24,30).")
@click.option("--devices", default="auto", show_default=True,
              help="auto, cpu, or one per stage: cuda:0,cuda:1 (stages may share a device).")
@click.option("--ctx-size", type=int, default=2048, show_default=True,
              help="Positions of KV cache per slot (prompt + generated tokens).")
@click.option("--prompt", required=True, help="The prompt text.")
@click.option("--chat", is_flag=True, help="Render the prompt as one user message with the "
              "model's chat template.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off.")
@click.option("--min-p", type=float, default=0.0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=None, help="Seed of the sampling draws (random if unset).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS, show_default=True,
              help="Rows of a prompt chunk.")
@click.option("--window-rows", type=int, default=DEFAULT_WINDOW_ROWS, show_default=True,
              help="Rows of a decode window.")
@click.option("--external-stage", type=int, multiple=True,
              help="Don't spawn stage K: print its strata-worker command and wait for it.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Where each stage writes its log (default: a temporary run directory).")
def main(model, layer_split, devices, ctx_size, prompt, chat, max_tokens, temperature, top_k,
         top_p, min_p, seed, stop, chunk_rows, window_rows, external_stage, log_dir):
    """Run a GGUF model split across stage processes and print the generated text."""
    try:
        if chunk_rows < 1 or window_rows < 1:
            raise PlanError("--chunk-rows and --window-rows must be at least 1")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                seed=seed, max_tokens=max_tokens, stop=tuple(stop)).with_seed()
        file = open_model(model, ctx_size)
        plan = plan_stages(layer_split, parse_devices(devices, cuda_count()),
                           file.config.n_layers)
        for e in external_stage:
            if not 0 <= e < len(plan):
                raise PlanError(f"--external-stage {e} does not exist: stages are 0..{len(plan) - 1}")
        tok = Tokenizer.from_gguf(file.reader)
        text = tok.render_chat([{"role": "user", "content": prompt}]) if chat else prompt
        seq = Sequence(tok.encode(text), params, tok.stop_ids, ctx_size, tok.decode)
        with launch_stages(file, plan, slots=1, ctx=ctx_size, log_dir=log_dir,
                           external=set(external_stage), say=say) as run:
            for p in plan:
                say(f"stage {p.index}: layers [{p.layer_start}, {p.layer_end}) on {p.device}")
            generate_solo(run.pipe, seq, chunk_rows=chunk_rows, window_rows=window_rows)
            click.echo(seq.final_text())
            say(f"[{len(seq.prompt)} prompt tokens, {len(seq.generated)} generated, "
                f"finish: {seq.finish_reason}, seed {params.seed}]")
    except (ModelError, PlanError, RequestError, ValueError) as e:
        say(f"strata-launch: {e}")
        sys.exit(2)
    except (PipelineError, WindowFailed) as e:
        say(f"strata-launch: {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        say("strata-launch: interrupted; stages stopped")
        sys.exit(130)
