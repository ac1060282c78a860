"""A coordinator of your own: start the stage workers, drive them with strata's library in a
greedy loop of a few lines, print the text.

    python examples/custom_coordinator.py --layer-split 15 --prompt "The three primary colours are"

It prints what `strata-launch --layer-split 15 --prompt "..."` prints (greedy is the default of
both); tests/system/test_custom_coordinator.py checks that token for token. The policy (which rows
go into which window) is all here; the mechanism (the worker processes, the sockets, the hellos,
the windows' encoding) is strata's.
"""
from __future__ import annotations

import argparse
import sys

import torch

from strata.coordinator.stages.pipeline import Expect, Pipeline
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.windows import Row, build_window, prompt_chunks
from strata.launch.plan import parse_devices, plan_stages
from strata.launch.processes import StageProcesses
from strata.model.gguf_file import ModelFile
from strata.model.registry import DEFAULT_MODEL, resolve_model
from strata.model.tokenizer import Tokenizer

CHUNK_ROWS = 32  # rows of a prompt window
WINDOW_ROWS = 8  # rows of a decode window: one live row here, the rest padding
SLOT = 0         # the workers hold one slot's KV cache (slots=1)


def generate(pipe: Pipeline, tok: Tokenizer, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding of one prompt in slot 0 of stages that have said hello."""
    greedy = SamplingParams(temperature=0.0)
    # the prompt in windows of CHUNK_ROWS rows; its last row samples the first token
    for i, rows in enumerate(prompt_chunks(SLOT, prompt, 0, CHUNK_ROWS, greedy)):
        commits = [(SLOT, 0)] if i == 0 else []  # (slot, length kept): the slot starts empty
        pipe.submit(build_window(pipe.new_window_id(), rows, CHUNK_ROWS, commits, chunk=True))
        result, _ = pipe.receive()
    out = [result.tokens[0]]
    while len(out) < max_tokens and out[-1] not in tok.stop_ids:
        # one row: the last token at its position, sampling the token after it
        row = Row(SLOT, len(prompt) + len(out) - 1, out[-1], greedy)
        pipe.submit(build_window(pipe.new_window_id(), [row], WINDOW_ROWS))
        result, _ = pipe.receive()
        out.append(result.tokens[0])
    return out


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--model", default=DEFAULT_MODEL, help="smollm2-135m or a GGUF path")
    args.add_argument("--layer-split", default="15", help="layer boundaries K1,K2,..")
    args.add_argument("--devices", default="cpu", help="cpu, or one per stage: cuda:0,cuda:1")
    args.add_argument("--ctx-size", type=int, default=512)
    args.add_argument("--prompt", default="The three primary colours are")
    args.add_argument("--max-tokens", type=int, default=32)
    a = args.parse_args()

    file = ModelFile(resolve_model(a.model))
    tok = Tokenizer.from_gguf(file.reader)
    prompt = tok.encode(a.prompt)
    if len(prompt) + a.max_tokens > a.ctx_size:
        sys.exit(f"custom_coordinator: {len(prompt)} prompt tokens + --max-tokens "
                 f"{a.max_tokens} exceed --ctx-size {a.ctx_size}; raise --ctx-size")
    plan = plan_stages(a.layer_split, parse_devices(a.devices, torch.cuda.device_count()),
                       file.config.n_layers)
    procs = StageProcesses(file.path, plan, slots=1, ctx=a.ctx_size)  # one process per stage
    pipe = Pipeline(procs.endpoints.inbox, procs.endpoints.stages[0], procs.check_alive)
    done = False
    try:
        procs.start()
        pipe.wait_for_hellos([Expect(p.index, p.layer_start, p.layer_end, file.fingerprint(),
                                     1, a.ctx_size) for p in plan], timeout=300)
        tokens = generate(pipe, tok, prompt, a.max_tokens)
        print(tok.decode([t for t in tokens if t not in tok.stop_ids]))
        done = True
    finally:
        pipe.shutdown()  # Shutdown goes through the stages, each exits
        done &= procs.stop()  # False if a stage exited with an error code
        pipe.close()
        kept = procs.remove_run_dir(keep_logs=not done)  # the run directory: sockets, logs
        if kept:
            print(f"custom_coordinator: the stage logs are kept in {kept}", file=sys.stderr)


if __name__ == "__main__":
    main()
