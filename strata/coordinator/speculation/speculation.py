"""Speculation on the coordinator, the one place the scheduler asks about drafts: which drafts
each slot of a decode window verifies (`offer`), which proposals a window asks the last stage
for (`ask`), what a window's sampled tokens keep (`verify`, `accept`), and the times of each
group's decode windows (`sent`, `landed`) from which draft_tokens auto chooses.

When the slots want more rows than a window may have, the rows go to the drafts most likely
to be kept, by each request's recent acceptance; with draft_tokens auto, K is chosen per group
from its measured window times and acceptance (draft_choice.py).

MTP drafts (drafter "mtp"): each decode window, and a prompt's last chunk, asks the last
stage's drafter for proposals for its slots (`propose`, k = the group's drafts per slot,
within the rows its next decode window may have); its Result carries them, and they wait in
the request's RequestDrafts until the slot's next decode window, which puts as many as fit in
its rows. A group sends a slot's next decode window only after the previous window of the
group has come back (one window in flight per group, and a group's prompt chunks stream only
while it has no decoding slot: scheduler.py), so the proposals are always there in time, with
any number of groups. A request that ends drops its proposals with it; a request new to a
slot has none until its first Result.

The drafts themselves (what a draft row is, the two drafters, the counts): drafts.py. How many
drafts a group's slots get and which slots get the rows: draft_choice.py. The rule that keeps
a draft: protocol/acceptance.py, which the last stage's drafter applies too. None of this
changes a token: a draft only decides how many tokens a window yields (drafts.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from strata.coordinator.config import SchedulerConfig, round_rows
from strata.coordinator.speculation.draft_choice import (UNTIMED, DraftChoice, GroupDrafts,
                                                         RequestDrafts, share_rows)
from strata.coordinator.speculation.drafts import DraftCounts, PromptLookup, draft_limit
from strata.coordinator.sampling_params import TokenLogprob
from strata.protocol.acceptance import kept_rows

if TYPE_CHECKING:
    from strata.coordinator.sequence import Sequence
    from strata.coordinator.slots import Slot


class Request(Protocol):
    """A request as speculation reads it (the engine's Request, engine/scheduler_state.py:
    speculation never imports the engine)."""
    seq: Sequence
    drafts: RequestDrafts


class RowOwner(Protocol):
    """A slot's rows in a window as verify reads them (the engine's RowOwner)."""
    sampled: int
    drafts: list[int]


@dataclass(frozen=True)
class Offer:
    """A decode window's drafts: per slot (in the window's order) the drafts its rows verify,
    the proposals the window asks for, its rows (the slots' and the drafts', rounded up to
    a multiple of 8) and the key its time is kept under (rows, proposals a slot; None: not
    timed)."""
    drafts: list[list[int]]
    propose: list[tuple[int, int]]
    rows: int
    timed: tuple[int, int] | None


class Speculation:
    """Every group's drafting state and every request's draft counts (the scheduler's)."""

    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.mtp = cfg.drafter == "mtp"
        self.groups = [GroupDrafts() for _ in range(cfg.groups)]   # acceptance, times, choice
        self.counts = DraftCounts()     # every request's drafts
        self.landed_at = 0.0            # when the last result came (the scheduler's clock)

    def choices(self) -> tuple[DraftChoice | None, ...]:
        return tuple(g.choice for g in self.groups)

    # --- a decode window out ------------------------------------------------------------------

    def offer(self, group: int, slots: list[Slot]) -> Offer:
        """The drafts of a decode window of these decoding slots: up to the group's drafts per
        slot each (what the grammar allows of them), the window's rows at most
        draft_window_rows of the slots' own size; when the slots want more drafts than fit,
        the rows go to those most likely to be kept (share_rows)."""
        g, n = self.groups[group], len(slots)
        for s in slots:   # the drafts of each slot's last window, kept or not
            s.request.drafts.observe(g.acceptance)
        k = g.per_slot(self.cfg, n)
        room = (self.cfg.draft_window_rows(round_rows(n)) if k else n) - n
        if room:
            wants = [self._drafts(s.request, k) for s in slots]
            wants = [d if not d or s.request.seq.grammar is None
                     else s.request.seq.grammar.drafts(d)
                     for s, d in zip(slots, wants)]   # the drafts the grammar allows
        else:   # no row for a draft: proposals waiting are dropped (used once)
            for s in slots:
                s.request.drafts.proposals = []
            wants = [[] for _ in slots]
        lengths = [len(d) for d in wants]
        if sum(lengths) <= room:   # every draft fits: no choice to make
            drafts = wants
        else:
            prior = g.acceptance.rate()
            shares = share_rows(lengths, [s.request.drafts.acceptance.rate(prior)
                                          for s in slots], room)
            drafts = [d[:m] for d, m in zip(wants, shares)]
        rows = round_rows(n + sum(map(len, drafts)))   # <= MAX_WINDOW_ROWS (draft_window_rows)
        key = (rows, k if self.mtp else 0)
        if not self.cfg.auto_drafts and self.cfg.draft_tokens:
            g.choice = g.describe(k, rows, n, key[1])
        # with mtp, a window where a slot has no proposals on offer (after windows that asked
        # none, or with more NextN rows to write than one window's drafter takes) has the
        # drafter write the rows its slots lack: not timed, or K would be judged by that
        # (but for UNTIMED such windows in a row: proposals that never come cost too)
        catching_up = self.mtp and k and not all(wants) and g.untimed < UNTIMED
        timed = None if catching_up else key
        return Offer(drafts, self.ask(group, slots, n), rows, timed)

    def ask(self, group: int, slots: list[Slot], decoding: int) -> list[tuple[int, int]]:
        """mtp: [(slot, k)] asking for the drafts each slot's next decode window, one of about
        `decoding` slots, has room for (the slot holds one more token by then); else []."""
        if not self.mtp or not self.cfg.draft_tokens:
            return []
        room = self.groups[group].room(self.cfg, decoding)
        if room <= 0:
            return []
        asks = ((s.index, draft_limit(s.request.seq, room, self.cfg.max_draft_tokens, ahead=1))
                for s in slots)
        return [(index, k) for index, k in asks if k >= 1]

    def _drafts(self, req: Request, room: int) -> list[int]:
        """Draft tokens on offer for the request's next window: at most `room`, within the
        context and the tokens it may still generate (the last row's token is sampled anyway);
        the window takes a prefix of them (share_rows)."""
        d, seq = req.drafts, req.seq
        if self.mtp:  # the proposals its last Result carried, used once
            proposals, d.proposals = d.proposals, []
            if not proposals:
                return proposals
            return proposals[:max(draft_limit(seq, room, self.cfg.max_draft_tokens), 0)]
        k = draft_limit(seq, room, self.cfg.max_draft_tokens)
        if k <= 0:
            return []
        if d.lookup is None:
            d.lookup = PromptLookup(seq.prompt)
        d.lookup.extend(seq.generated[len(d.lookup.tokens) - len(seq.prompt):])
        return d.lookup.propose(k)

    # --- a window back ------------------------------------------------------------------------

    def verify(self, owners: list[RowOwner], tokens: list[int]) -> list[int]:
        """The drafts each owner's rows keep (protocol/acceptance.py's rule, the last stage's
        too), given the window's sampled tokens in row order: one pass over the window."""
        if not any(o.drafts for o in owners):
            return [0] * len(owners)
        runs, first = [], []   # each sampling owner's rows: its last token's, its drafts'
        for o in owners:
            if o.sampled:
                runs += [-1] + o.drafts
                first += [True] + [False] * len(o.drafts)
        counted, out, at = kept_rows(runs, tokens, first), [], 0
        for o in owners:   # a run's rows that count are a prefix of it: row 0 and its kept
            n = o.sampled and 1 + len(o.drafts)
            out.append(sum(counted[at:at + n]) - 1 if n else 0)
            at += n
        return out

    def accept(self, req: Request, tokens: list[int], drafts: list[int], kept: int,
               proposals: list[int] = (), logprobs: list[TokenLogprob] = ()
               ) -> tuple[int, bool]:
        """A slot's sampled tokens: tokens[j] was sampled at position L + j (L: the sequence's
        length before); it counts while the drafts before it are kept (`kept` of them:
        verify) and the sequence has not ended. proposals: the drafter's for the positions
        after the tokens that count (the last stage accepts by the same rule), kept for the
        slot's next decode window. logprobs: tokens[j]'s, when the request asks for them.
        Returns (drafts kept before the sequence ended, whether it has)."""
        seq = req.seq
        for j, token in enumerate(tokens[:kept + 1]):
            done = seq.accept(token, logprobs[j] if logprobs else None)
            if done:
                break
        if drafts:   # j: drafts equal to the token sampled at their position
            req.drafts.counts.add(len(drafts), j)
            self.counts.add(len(drafts), j)
        req.drafts.proposals = [] if done else list(proposals)
        return j, done

    # --- the group's decode windows' times (draft_choice.py) ----------------------------------

    def sent(self, group: int, at: float, timed: tuple[int, int] | None,
             decode: bool) -> None:
        """A window of the group left: a decode window (timed under `timed`, or None: not
        timed), or a prompt chunk."""
        rows, k = timed or (None, 0)
        self.groups[group].sent(at, rows, k, decode)

    def landed(self, group: int, at: float) -> None:
        """A window of the group came back."""
        self.groups[group].landed(at, self.landed_at)
        self.landed_at = at

    def restarted(self) -> None:
        """A stage started again: no window in flight is timed."""
        for g in self.groups:
            g.in_flight = None
