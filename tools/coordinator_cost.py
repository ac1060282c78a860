"""What the coordinator's host work costs a decode window, plain against drafted: the real
Scheduler against a pipeline that answers at once (every row samples token 5; with drafts, the
last stage's proposals are all 5s, so every draft is kept, or all 1s, so none is), each window
packed and unpacked as the transport would. No stage, no model: the time is the scheduler's
(building the window, offering drafts, verifying and accepting them) and the wire's.

  python tools/coordinator_cost.py [--slots 16,32] [--tokens 96] [--draft-tokens 0,2] [--profile]

Prints per arm (slots, drafts) the decode windows, the tokens they gave and the microseconds a
window (the least of --repeats runs, the arms in turn); --profile also prints cProfile's top
functions of one drafted run (the first slot count, none kept).
"""
from __future__ import annotations

import cProfile
import pstats
import time
from collections import deque

import click

from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.coordinator.sampling_params import SamplingParams
from strata.protocol.messages import Result
from strata.protocol.transport import pack, unpack

TOKEN, WRONG, STOP = 5, 1, 2


class AnsweringPipe:
    """Answers each window at once: TOKEN for every sampled row; for `propose`, k proposals
    of TOKEN (kept) or WRONG (not kept)."""

    def __init__(self, kept: bool):
        self.proposal = TOKEN if kept else WRONG
        self.queue: deque = deque()
        self.next_id = 0
        self.decode_windows = 0

    def new_window_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def check(self) -> None:
        pass

    def stage_table(self) -> list[dict]:
        return []

    def submit(self, w) -> None:
        self.queue.append(unpack(pack(w))[0])

    def receive(self, timeout=None):
        w = self.queue.popleft()
        self.decode_windows += not w.chunk
        proposals = [[slot] + [self.proposal] * k for slot, k in w.propose]
        return Result(w.id, [TOKEN] * len(w.sample_rows), proposals=proposals), []


def run(slots: int, tokens: int, k: int, kept: bool, prompt: int) -> tuple[float, int, int]:
    """(seconds, decode windows, tokens generated) of `slots` requests of `tokens` each."""
    cfg = SchedulerConfig(slots=slots, ctx=prompt + tokens + 16, draft_tokens=k,
                          drafter="mtp", chunk_rows=128)
    pipe = AnsweringPipe(kept)
    sched = Scheduler(pipe, cfg, frozenset({STOP}))
    reqs = [sched.submit([3 + (i + j) % 50 for j in range(prompt)],
                         SamplingParams(max_tokens=tokens)) for i in range(slots)]
    t0 = time.perf_counter()
    sched.run()
    elapsed = time.perf_counter() - t0
    return elapsed, pipe.decode_windows, sum(len(r.seq.generated) for r in reqs)


@click.command()
@click.option("--slots", default="16,32", show_default=True, help="Slot counts (every request "
              "at once, one a slot).")
@click.option("--tokens", type=int, default=96, show_default=True)
@click.option("--prompt", type=int, default=16, show_default=True, help="Prompt tokens.")
@click.option("--draft-tokens", default="0,2", show_default=True,
              help="Arms: drafts per slot (0: plain).")
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--profile", is_flag=True, help="cProfile's top functions of a drafted run.")
def main(slots, tokens, prompt, draft_tokens, repeats, profile):
    counts = [int(x) for x in slots.split(",")]
    ks = [int(x) for x in draft_tokens.split(",")]
    arms = [(n, k, kept) for n in counts for k in ks for kept in ((False,) if k == 0
                                                                   else (False, True))]
    runs: dict[tuple, list] = {arm: [] for arm in arms}
    for _ in range(repeats):   # the arms in turn, so that a slow spell of the machine hits all
        for n, k, kept in arms:
            runs[(n, k, kept)].append(run(n, tokens, k, kept, prompt))
    print(f"# {tokens} tokens a request, {prompt}-token prompts; us a decode window (prompt "
          f"chunks included), the least of {repeats} runs, the arms in turn")
    print(f"{'slots':>5} {'arm':>20} {'windows':>8} {'tokens':>7} {'us/window':>10}")
    for (n, k, kept), rs in runs.items():
        us = min(t / w * 1e6 for t, w, _ in rs)
        name = "plain" if k == 0 else f"{k} drafts, {'kept' if kept else 'none kept'}"
        print(f"{n:>5} {name:>20} {rs[0][1]:>8} {rs[0][2]:>7} {us:>10.1f}")
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        run(counts[0], tokens, max(ks), False, prompt)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
