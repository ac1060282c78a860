"""The real Scheduler against a timed fake pipeline: what a scheduling policy does to total
tok/s, in a second, without GPUs. A model, not a measurement: each stage takes a fixed time
per window (decode or prompt chunk), windows queue at each stage in order, and the hops and the
coordinator's step cost fixed times (defaults: the llama3-8b shape on two H200s, from the
sweep's traces). Use it to see what a change of admission or prompt order does to
serial against pipelined groups before measuring it on GPUs.

    python tools/schedsim.py --model /tmp/l8b.gguf --clients 16,32 --tokens 128
"""
from __future__ import annotations

from collections import deque

import click
import gguf

from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.bench.harness import prompt_set
from strata.model.tokenizer import Tokenizer
from strata.protocol.messages import Result


class TimedPipe:
    """Window w leaves the coordinator at `now`, reaches stage 0 after hop_in ms, waits for the
    stage, takes its cost there, crosses each link, and its result lands back ms after the last
    stage; receive() moves `now` to that time plus the coordinator's step."""

    def __init__(self, decode_ms, chunk_ms, hop_in=0.17, link=0.02, back=0.07, step=0.05):
        self.decode_ms, self.chunk_ms = decode_ms, chunk_ms
        self.hop_in, self.link, self.back, self.step = hop_in, link, back, step
        self.now, self.free = 0.0, [0.0] * len(decode_ms)
        self.results: deque = deque()
        self.next_id = 0

    def new_window_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def submit(self, w) -> None:
        t = self.now + self.hop_in - self.link
        for s, cost in enumerate(self.chunk_ms if w.chunk else self.decode_ms):
            self.free[s] = max(t + self.link, self.free[s]) + cost
            t = self.free[s]
        self.results.append((t + self.back, w))

    def receive(self, timeout=None):
        t, w = self.results.popleft()
        self.now = max(self.now, t) + self.step
        return Result(w.id, [5] * len(w.sample_rows)), []


def simulate(prompts: list[list[int]], tokens: int, groups: int, batch: int, pipe: TimedPipe,
             window_rows: int = 8, chunk_rows: int = 32) -> float:
    """Total tok/s of len(prompts) clients arriving at once, `tokens` each."""
    cfg = SchedulerConfig(slots=batch, groups=groups, window_rows=window_rows,
                          chunk_rows=chunk_rows, ctx=4096, prompt_depth=len(pipe.decode_ms) + 1)
    sched = Scheduler(pipe, cfg, frozenset())
    for p in prompts:
        sched.submit(p, SamplingParams(max_tokens=tokens))
    sched.run()
    return len(prompts) * tokens / pipe.now * 1000


@click.command()
@click.option("--model", required=True, help="A GGUF whose tokenizer reads the bench prompts.")
@click.option("--clients", default="16,32", show_default=True)
@click.option("--tokens", type=int, default=128, show_default=True)
@click.option("--decode-ms", default="2.12,2.38", show_default=True,
              help="Each stage's time on a decode window (GPU + overhead).")
@click.option("--chunk-ms", default="2.4,2.7", show_default=True,
              help="Each stage's time on a prompt chunk.")
def main(model, clients, tokens, decode_ms, chunk_ms):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(model))
    dec = [float(x) for x in decode_ms.split(",")]
    chunk = [float(x) for x in chunk_ms.split(",")]
    counts = [int(c) for c in clients.split(",")]
    print(f"# model of the scheduler: stages {dec} ms a decode window, {chunk} ms a chunk; "
          f"{tokens} tokens per client, batch {max(counts)}")
    for n in counts:
        prompts = [tok.encode(t) for t in prompt_set(n)]
        serial = simulate(prompts, tokens, 1, max(counts), TimedPipe(dec, chunk))
        piped = simulate(prompts, tokens, len(dec), max(counts), TimedPipe(dec, chunk))
        print(f"{n:>3} clients: serial {serial:7.1f} pipelined {piped:7.1f} tok/s, "
              f"{piped / serial:.3f}x")


if __name__ == "__main__":
    main()
