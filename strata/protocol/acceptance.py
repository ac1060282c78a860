"""The one acceptance rule of draft tokens, which the coordinator (Speculation.verify) and the
last stage's drafter (Drafter._plan) both apply to a window's rows.

A slot's rows in a window are consecutive positions: row 0 holds the slot's last token, row
i + 1 holds draft i. The token sampled at row i is the target's token at the next position,
so draft i is kept while it equals the token sampled at row i and every draft before it is
kept; the tokens that count are then the sampled tokens of rows 0 .. kept. A row that was not
sampled (a prompt row, whose successor is given) passes its given successor as its sample.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def kept_rows(tokens: Sequence[int], sampled: Sequence[int], first: Sequence[bool],
              adjacent: Sequence[bool] | None = None) -> np.ndarray:
    """Which rows count, for a window's rows laid out in runs (each slot's rows in position
    order; first[i]: row i begins a run, first[0] must be True): a run's first row counts,
    and row i after it while row i - 1 counts and the token sampled at row i - 1 is row i's
    token (sampled < 0: row i - 1 was not sampled, its successor is given: it passes).
    adjacent[i] (default all): row i's position follows row i - 1's; a row that does not
    ends its run's rows that count. Returns bool [R], one pass over the window."""
    tokens = np.asarray(tokens, dtype=np.int64)
    sampled = np.asarray(sampled, dtype=np.int64)[:len(tokens)]
    first = np.asarray(first, dtype=bool)
    follows = np.ones(len(tokens), dtype=bool)
    follows[1:] = (sampled[:-1] < 0) | (sampled[:-1] == tokens[1:])
    if adjacent is not None:
        follows &= np.asarray(adjacent, dtype=bool)
    broken = np.cumsum(~follows & ~first)          # breaks so far (none at a run's first row)
    run = np.cumsum(first) - 1                     # each row's run
    return broken == broken[np.flatnonzero(first)][run]   # no break since its run began


def kept_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts are kept (kept_rows for one slot): drafts[i] against
    sampled[i], the token sampled at the row before draft i's (sampled may be longer: the
    last row's token follows them all)."""
    n = min(len(drafts), len(sampled))
    if not n:
        return 0
    rows = kept_rows([-1] + list(drafts[:n]), list(sampled[:n]) + [-1], [True] + [False] * n)
    return int(rows.sum()) - 1
