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


def kept_rows(tokens: Sequence[int], sampled: Sequence[int], first: Sequence[bool],
              positions: Sequence[int] | None = None) -> list[bool]:
    """Which rows count, for a window's rows laid out in runs (each slot's rows in position
    order; first[i]: row i begins a run, first[0] is True): a run's first row counts, and row
    i after it while row i - 1 counts and the token sampled at row i - 1 is row i's token
    (sampled < 0: row i - 1 was not sampled, its successor is given: it passes). With
    positions, a row whose position does not follow row i - 1's ends its run's rows that
    count. One pass over the window (a window has at most 64 rows: plain Python is quicker
    than array calls at this size)."""
    out, counts = [], False
    for i, token in enumerate(tokens):
        if first[i]:
            counts = True
        elif counts:
            before = sampled[i - 1]
            counts = ((before < 0 or before == token)
                      and (positions is None or positions[i] == positions[i - 1] + 1))
        out.append(counts)
    return out


def kept_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts are kept (kept_rows for one slot): drafts[i] against
    sampled[i], the token sampled at the row before draft i's (sampled may be longer: the
    last row's token follows them all)."""
    n = min(len(drafts), len(sampled))
    return sum(kept_rows([-1] + list(drafts[:n]), sampled, [True] + [False] * n)) - 1
