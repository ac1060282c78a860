"""Draft tokens for a decoding slot, verified in its next window (speculative decoding).

A slot with drafts d_1..d_k sends k + 1 rows in one window, every row sampled; the last stage
answers t_0..t_k, and t_j (j >= 1) counts only while d_1..d_j equal t_0..t_{j-1}
(protocol/acceptance.py). The tokens are plain decoding's (docs/DESIGN.md, exactness and Draft
tokens): drafts change how many windows a request takes, never a token. Here: the
prompt-lookup drafter (`PromptLookup`: what followed the latest earlier occurrence of
the request's last 3, 2 or 1 tokens), the room drafts may take (`draft_room`, `draft_limit`)
and the counts (`DraftCounts`: d_j is accepted at position j when d_1..d_j all matched; a
request's, the scheduler's totals, /v1/status and /metrics). The MTP drafter runs on the last
stage (stage_worker/drafter.py); speculation.py asks it for proposals.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from strata.coordinator.sequence import Sequence

MAX_NGRAM = 3


def draft_room(decoding: int, draft_tokens: int, window_rows: int) -> int:
    """The most drafts a slot may get in a decode window of `decoding` slots and at most
    `window_rows` rows (SchedulerConfig.draft_window_rows): the rows beyond the slots' own,
    at most draft_tokens. The slots share those rows (draft_choice.share_rows)."""
    return max(min(draft_tokens, window_rows - decoding), 0)


@dataclass
class DraftCounts:
    """Draft tokens put in windows and kept of them (equal to the token sampled at their
    position), in all and per draft position j = 1.. (index j - 1): a slot's drafts d_1..d_n
    in a window count as drafted at 1..n, and d_j as kept at j when d_1..d_j all were. A
    request's, or every request's (the scheduler's); /v1/status, /metrics and the bench
    report these. Kept as how many windows of a slot had n drafts and kept j of them (index
    n, j), so that a window counts in O(1)."""
    drafted: int = 0
    accepted: int = 0
    by_drafted: list[int] = field(default_factory=lambda: [0])   # [n]: windows with n drafts
    by_kept: list[int] = field(default_factory=lambda: [0])      # [j]: windows that kept j

    def add(self, drafted: int, accepted: int) -> None:
        """One slot's window: `accepted` of its `drafted` drafts kept."""
        if not drafted:
            return
        self.drafted += drafted
        self.accepted += accepted
        if drafted >= len(self.by_drafted):
            self.by_drafted.extend([0] * (drafted + 1 - len(self.by_drafted)))
        self.by_drafted[drafted] += 1
        if accepted >= len(self.by_kept):
            self.by_kept.extend([0] * (accepted + 1 - len(self.by_kept)))
        self.by_kept[accepted] += 1

    @property
    def drafted_at(self) -> list[int]:
        """Drafts put at position j = 1.. (index j - 1): the windows with at least j."""
        return _at_least(self.by_drafted)

    @property
    def accepted_at(self) -> list[int]:
        """Drafts kept at position j = 1.. (index j - 1): the windows that kept at least j."""
        return _at_least(self.by_kept)

    def __add__(self, other: DraftCounts) -> DraftCounts:
        return DraftCounts(self.drafted + other.drafted, self.accepted + other.accepted,
                           _plus(self.by_drafted, other.by_drafted),
                           _plus(self.by_kept, other.by_kept))

    def copy(self) -> DraftCounts:
        return DraftCounts(self.drafted, self.accepted, list(self.by_drafted),
                           list(self.by_kept))

    def since(self, before: DraftCounts) -> DraftCounts:
        """What was counted after `before` (an earlier copy of these counts)."""
        less = lambda a, b: _plus(a, [-c for c in b])  # noqa: E731
        return DraftCounts(self.drafted - before.drafted, self.accepted - before.accepted,
                           less(self.by_drafted, before.by_drafted),
                           less(self.by_kept, before.by_kept))

    def report(self, positions: int = 0) -> dict:
        """Proposed, kept, and the share kept (None before any); with "positions" the same for
        each draft position j = 1..max(positions, those counted)."""
        counts = _rate(self.drafted, self.accepted)
        drafted_at, accepted_at = self.drafted_at, self.accepted_at
        n = max(positions, len(drafted_at))
        if n:
            at = lambda c, j: c[j] if j < len(c) else 0  # noqa: E731
            counts["positions"] = [dict(position=j + 1, **_rate(at(drafted_at, j),
                                                                at(accepted_at, j)))
                                   for j in range(n)]
        return counts


def _rate(proposed: int, accepted: int) -> dict:
    return {"proposed": proposed, "accepted": accepted,
            "rate": round(accepted / proposed, 4) if proposed else None}


def _plus(a: list[int], b: list[int]) -> list[int]:
    """Two counts by index added (a missing index counts 0)."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def _at_least(windows: list[int]) -> list[int]:
    """From windows by count [n] to counts at positions 1..: [sum(windows[j:]) for j >= 1]."""
    out, total = [], 0
    for c in reversed(windows[1:]):
        total += c
        out.append(total)
    return out[::-1]


def draft_limit(seq: Sequence, room: int, draft_tokens: int, ahead: int = 0) -> int:
    """How many drafts the sequence can use in a window once it holds `ahead` more tokens:
    within the room, the context, and the tokens it may still generate (the window's last
    row samples one more anyway)."""
    return min(draft_tokens, room, seq.ctx - seq.length - ahead,
               seq.params.max_tokens - len(seq.generated) - 1 - ahead)


class PromptLookup:
    """Incremental n-gram index of one request's tokens: proposing is O(1), each new token
    O(MAX_NGRAM)."""

    def __init__(self, tokens: list[int] = ()):
        self.tokens: list[int] = []
        # n-gram -> where the tokens after its latest occurrence (that has any) begin
        self.follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here now have a continuation
            for n in range(1, MAX_NGRAM + 1):
                if end >= n:
                    self.follow[n][tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest tail
        n-gram seen before; [] when none was."""
        if k <= 0:
            return []
        for n in range(min(MAX_NGRAM, len(self.tokens)), 0, -1):
            start = self.follow[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []
