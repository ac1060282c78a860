"""Draft tokens for a decoding slot, verified in its next window (speculative decoding).

A slot with drafts d_1..d_k sends k + 1 rows in one window: its last token at position L - 1
and the drafts at L..L + k - 1, every row sampled. The last stage answers t_0..t_k, where t_j
is the token for position L + j given the rows before it. t_0 is always the slot's next token;
t_j (j >= 1) counts only if d_1..d_j equal t_0..t_{j-1}. So a window yields 1 to k + 1 tokens,
and they are exactly the tokens of plain decoding (DESIGN.md, exactness 4): each row is
computed as a decode row (the stages' kernels give a row the same bits in a decode window of
any size, so it does not matter that drafts fill pad rows or grow the window past its decoding
slots' rounded size, nor which slots get draft rows), with the same KV before it (the accepted
drafts wrote the same keys and values a decode row of that token would), and each draw is
keyed by (seed, position). Drafts only change how many windows a request takes and how large
they are. The KV rows of rejected drafts are dropped by a commit on the next window.

How many rows drafts may add to a window (SchedulerConfig.draft_rows, draft_room), which slots
get them and, with draft_tokens auto, how many drafts per slot: draft_choice.py.

Two drafters (SchedulerConfig.drafter):
- lookup: prompt lookup (n-gram matching) here, the tokens that followed the latest earlier
  occurrence of the request's last n tokens (n = 3, 2, 1), from its prompt and what it
  generated. It needs no model and pays on text that repeats what came before (quoting,
  editing code, summaries, loops of a small model).
- mtp: the model's NextN head on the last stage. A window asks it for proposals
  (`Window.propose`: [slot, k] for slots with rows in it); right after sampling, the last
  stage runs the head on the rows equality accepts and answers them with the tokens
  (`Result.proposals`: [slot, d1..dk]). The coordinator keeps them on the request
  (speculation.py) and puts as many as fit in the slot's next decode window: no window of
  its own is spent on drafting.
  For a request that samples with a temperature the proposals can be coupled
  (SchedulerConfig.draft_sampling "coupled"; the default is "argmax"): the token at position q is drawn
  with u(q) = Philox(seed, q) whatever the window (sampling.py), so the window that asks for
  proposals sends, with each propose entry, the draws of the positions they can take past its
  own rows (`Window.propose_u`), and the drafter picks each proposal with the target's own
  sampler (a Gumbel-max pick keyed by the draw and the token) over its own distribution,
  filtered and tempered as the target's, with the draw the target will use there. Where head and target agree closely, one u lands both on the same token (a
  head that computes its target's distribution has nearly every proposal kept, against a
  third for argmax: tests/test_mtp.py); an argmax proposal ("argmax") is kept only when the
  target's draw happens to pick the head's most likely token. Coupling pays only as far as the
  head's distribution is close to its target's (docs/BENCHMARKS.md measures the shipped head's).
  Each draw is made once (draw_uniform is memoised): the window that samples the position
  finds it.
Either way acceptance is the same equality, so the drafter changes the windows, never a token.

Acceptance per draft position: a slot's drafts d_1..d_k in a window count as proposed at
positions 1..k, and d_j as accepted at position j when d_1..d_j all equal the tokens sampled
before them (DraftCounts: a request's, the scheduler's totals, /v1/status, /metrics).
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
