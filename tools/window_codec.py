"""What a decode window's rows cost on the host, from the coordinator's records to the last
stage's: a window of 64 rows, every row sampled (greedy and at 0.7 and 1.0, a quarter with
penalties, a quarter with a logit bias, 4 asking for log-probabilities).

  python tools/window_codec.py [--repeats 3000]

Prints the median of each step in microseconds:
  build   build_window: the coordinator's rows made into a Window (the draws memoised)
  encode  transport.pack: the header's map and msgpack
  decode  transport.unpack: msgpack and the message's checks (and encode + decode together)
  read    the stage's records of the window's sampled and logprob rows (Window.sampled and
          Window.scored; a checkout from before them: head.row_params, the sampler's rows)
and the header's size and the first digits of its sha256 (the same window on the wire gives
the same digits).
"""
from __future__ import annotations

import hashlib
import statistics
import time

import click

from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.windows import Row, build_window
from strata.protocol.messages import Window
from strata.protocol.transport import pack, unpack

ROWS = 64


def window_rows() -> list[Row]:
    """64 decode rows of 64 slots, each sampled."""
    rows = []
    for s in range(ROWS):
        params = SamplingParams(
            temperature=(0.0, 0.7, 1.0)[s % 3], top_p=0.9 if s % 5 == 0 else 1.0, seed=s,
            repetition_penalty=1.1 if s % 4 == 1 else 1.0,
            frequency_penalty=0.5 if s % 8 == 1 else 0.0,
            logit_bias=((11, 2.0), (s + 100, -100.0)) if s % 4 == 2 else (),
            logprobs=5 if s % 16 == 3 else None)
        rows.append(Row(s, 200 + s, 7 + s, params, prompt_len=150))
    return rows


def reader():
    """The stage's read of a window's rows."""
    if hasattr(Window, "sampled"):
        return lambda w: (w.sampled, w.scored)
    from strata.stage_worker.head import row_params
    return row_params


def median_us(times: list[int]) -> float:
    return statistics.median(times) / 1e3


@click.command()
@click.option("--repeats", default=3000, show_default=True)
def main(repeats: int) -> None:
    rows, read = window_rows(), reader()
    w = build_window(1, rows, ROWS)
    frames = pack(w)
    steps: dict[str, list[int]] = {"build": [], "encode": [], "decode": [], "encode + decode": [],
                                   "read": []}
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        built = build_window(1, rows, ROWS)
        t1 = time.perf_counter_ns()
        sent = pack(built)
        t2 = time.perf_counter_ns()
        got, _ = unpack(sent)
        t3 = time.perf_counter_ns()
        read(got)
        t4 = time.perf_counter_ns()
        for name, t in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t3 - t1, t4 - t3)):
            steps[name].append(t)
        del built, sent, got   # freed here, not in the next repeat's steps
    digest = hashlib.sha256(frames[0]).hexdigest()[:12]
    print(f"{ROWS} rows, header {len(frames[0])} bytes, sha256 {digest}; median of {repeats} "
          f"(us): " + ", ".join(f"{name} {median_us(t):.1f}" for name, t in steps.items()))


if __name__ == "__main__":
    main()
