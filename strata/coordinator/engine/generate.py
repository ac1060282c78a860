"""The solo path: one request (coordinator/sequence.py's Sequence) in one slot, its windows
sent one at a time (the batched path is scheduler.py's)."""
from __future__ import annotations

from typing import Callable

from strata.coordinator.stages.pipeline import Pipeline
from strata.coordinator.sequence import Sequence
from strata.coordinator.windows import (DEFAULT_CHUNK_ROWS, DEFAULT_WINDOW_ROWS, Row,
                                        build_window, prompt_chunks)


def generate_solo(pipe: Pipeline, seq: Sequence, *, slot: int = 0,
                  chunk_rows: int = DEFAULT_CHUNK_ROWS, window_rows: int = DEFAULT_WINDOW_ROWS,
                  on_logits: Callable | None = None) -> Sequence:
    """Read the prompt in fixed chunks, then decode one row per window until the end (a window
    of window_rows rows: 8, the size the scheduler gives one decoding slot).
    on_logits(position, logits[V]) receives the logits each token was sampled from."""
    params = seq.params.with_seed()
    seq.params = params
    commits = [(slot, 0)]  # a fresh conversation: nothing of the slot's past is kept
    want_logits = on_logits is not None

    def run(rows: list[Row], shape: int, chunk: bool = False) -> int | None:
        nonlocal commits
        w = build_window(pipe.new_window_id(), rows, shape, commits, want_logits, chunk)
        commits = []
        pipe.submit(w)
        result, tensors = pipe.receive()
        if not result.tokens:
            return None
        if want_logits:
            on_logits(rows[-1].position + 1, tensors[0][0])
        return result.tokens[0]

    token = None
    chunks = prompt_chunks(slot, seq.prompt, 0, chunk_rows, params)
    chunks[-1][-1] = seq.sampled_row(slot, len(seq.prompt) - 1, seq.prompt[-1])
    for rows in chunks:
        token = run(rows, chunk_rows, chunk=True)
    while not seq.accept(token):
        token = run([seq.sampled_row(slot, seq.length - 1, seq.last_token)], window_rows)
    return seq
