"""Building windows: fixed shapes, so a row's arithmetic never depends on its neighbours.

A prompt chunk is `chunk_rows` rows of one slot (the last chunk padded); a decode window has
one row per decoding slot (and its drafts), padded to a multiple of 8 rows (the scheduler picks
the size: scheduler.py). Pad rows have slot -1.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from strata.coordinator.config import WINDOW_ROW_STEP
from strata.coordinator.sampling_params import SamplingParams, draw_uniform
from strata.protocol.messages import Window
from strata.protocol.rows import LogprobRow, SamplingRow

DEFAULT_CHUNK_ROWS = 32
DEFAULT_WINDOW_ROWS = WINDOW_ROW_STEP  # a decode window of one live row (a request alone)


class Row(NamedTuple):
    """A window's row (a named tuple: a decode window makes one per slot and draft, and a
    tuple is several times quicker to make than a frozen dataclass)."""
    slot: int
    position: int
    token: int
    sample: SamplingParams | None = None  # sample the token for position + 1 from this row
    prompt_len: int = 0          # a sampled row's: its slot's output begins at this position
    held_back: frozenset[int] = frozenset()   # a sampled row's tokens it may not sample
    score: tuple[int, int] | None = None   # (token, top): a prompt row reports the logprob of
                                           # the next prompt token and of its top most likely
    mask: int = -1   # a sampled row's token mask: its index in build_window's masks (-1: none)


def build_window(window_id: int, rows: list[Row], shape: int,
                 commits: list[tuple[int, int]] = (), want_logits: bool = False,
                 chunk: bool = False, propose: list[tuple[int, int]] = (),
                 coupled: bool = False, masks=None, after: int = -1,
                 follows: list[int] = ()) -> Window:
    """rows: at most `shape` live rows; the rest of the window is padding. chunk: the rows are
    prompt rows of one slot (see Window.chunk). propose: (slot, k) asks the last stage's
    drafter for k proposals for a slot with rows here (see Window.propose). coupled: a slot
    that samples with a temperature gets coupled proposals (Window.propose_u). masks: the
    token masks the rows' `mask` index, [n, words] int32 (grammar.WindowMasks), or None.
    after, follows: a window that decodes ahead of window `after` (Window.follows: per row
    the sampled row of `after` whose pick is its token, -1 for its own)."""
    assert len(rows) <= shape, (len(rows), shape)
    pad = shape - len(rows)
    sampled, scored = [], []
    for i, r in enumerate(rows):
        if r.score is not None:
            scored.append(LogprobRow(i, *r.score))
        if r.sample is None:
            continue
        p = r.sample
        # the sampled token goes to position + 1: its draw is keyed by that position
        u = draw_uniform(p.seed, r.position + 1) if p.temperature > 0 else 0.0
        penalty = [float(p.repetition_penalty), float(p.frequency_penalty),
                   float(p.presence_penalty)] if p.penalised else []
        bias_ids, bias = [], []
        if p.logit_bias or r.held_back:
            given = dict(p.logit_bias) | dict.fromkeys(r.held_back, -math.inf)
            bias_ids = sorted(given)
            bias = [float(given[t]) for t in bias_ids]
        # SamplingRow's fields in order (keywords would cost twice the time of the call)
        sampled.append(SamplingRow(float(p.temperature), int(p.top_k), float(p.top_p),
                                   float(p.min_p), u, i, penalty, r.prompt_len, bias_ids, bias,
                                   r.mask))
        if p.logprobs is not None:
            assert r.score is None, "a row reports one log-probability"
            scored.append(LogprobRow(i, -1, p.logprobs))
    return Window.from_rows(
        window_id, slots=[r.slot for r in rows] + [-1] * pad,
        positions=[r.position for r in rows] + [0] * pad,
        tokens=[r.token for r in rows] + [0] * pad, sampled=sampled, scored=scored,
        commits=[list(c) for c in commits], want_logits=want_logits, chunk=chunk,
        propose=[list(p) for p in propose],
        propose_u=proposal_draws(rows, propose) if coupled and propose else [],
        masks=masks.astype("<i4", copy=False).tobytes() if masks is not None else b"",
        after=after, follows=list(follows) + [-1] * pad if follows else [])


def proposal_draws(rows: list[Row], propose: list[tuple[int, int]]) -> list[list[float]]:
    """Window.propose_u: for each (slot, k), the draws of the k positions after the one the
    slot's last row samples (last row at P: positions P + 2 .. P + 1 + k; the window's own
    rows carry the draws up to P + 1), or [] for a slot that samples greedily; [] when no
    slot samples with a temperature. Each draw is the one that position's row will sample
    with (draw_uniform is memoised: it is made once)."""
    last: dict[int, Row] = {}
    for r in rows:
        if r.position >= last.get(r.slot, r).position:
            last[r.slot] = r
    out = []
    for slot, k in propose:
        r = last[slot]
        p = r.sample
        out.append([] if p is None or p.temperature <= 0 else
                   [draw_uniform(p.seed, r.position + 1 + i) for i in range(1, k + 1)])
    return out if any(out) else []


def prompt_chunks(slot: int, tokens: list[int], start: int, chunk_rows: int,
                  params: SamplingParams) -> list[list[Row]]:
    """Rows reading tokens[start:] at positions start..; the very last row samples."""
    rows = [Row(slot, p, tokens[p]) for p in range(start, len(tokens))]
    if rows:
        rows[-1] = Row(slot, len(tokens) - 1, tokens[-1], params)
    return [rows[i:i + chunk_rows] for i in range(0, len(rows), chunk_rows)]
