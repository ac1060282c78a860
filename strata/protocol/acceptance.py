"""The one acceptance rule of draft tokens, which the coordinator (Speculation.accept) and the
last stage's drafter (Drafter._plan) both apply to a window's rows.

A slot's rows in a window are consecutive positions: row 0 holds the slot's last token, row
i + 1 holds draft i. The token sampled at row i is the target's token at the next position,
so draft i is kept while it equals the token sampled at row i and every draft before it is
kept; the tokens that count are then the sampled tokens of rows 0 .. kept. A row that was not
sampled (a prompt row, whose successor is given) passes its given successor as its sample.
"""
from __future__ import annotations

from collections.abc import Sequence


def kept_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts are kept: drafts[i] against sampled[i], the token sampled at
    the row before draft i's (sampled may be longer: the last row's token follows them all)."""
    kept = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        kept += 1
    return kept
