"""How many drafts a group's slots verify, and which slots get the rows (speculation.py asks):
`share_rows` gives a window's rows to the drafts most likely to be kept, `Acceptance` estimates
how likely that is, and `GroupDrafts.per_slot` chooses K for draft_tokens auto. The model
behind them (geometric acceptance, expected tokens a second, exploring sizes never timed):
docs/DESIGN.md, "Draft tokens". None of it changes what a row computes (drafts.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from strata.coordinator.config import SchedulerConfig, round_rows
from strata.coordinator.speculation.drafts import DraftCounts, PromptLookup, draft_room

DECAY = 0.9          # weight of the past in the acceptance counts, per window observed
PRIOR = 0.5          # acceptance before anything is observed, worth PRIOR_WEIGHT windows
PRIOR_WEIGHT = 1.0
TIME_WEIGHT = 0.3    # weight of a new window's time in its size's average
EXPLORE_EVERY = 8    # decode windows of a group between two tries of an untimed choice
STALE = 512          # decode windows of the group after which a time counts as untimed
RETRY = 128          # decode windows drafting nothing before a drafting choice that lost is
                     # tried again (doubled at each try until it wins, up to STALE): a try
                     # costs the windows where the drafter writes the NextN rows it lacks
HOLD = 2             # decode windows a choice lasts
# the share by which a choice whose windows differ from the plain window's (drafts that cost
# rows or proposals) must beat it: one group's windows, several groups' (their timed
# intervals alternate between the groups' results, so a few of them say less)
MARGIN = (0.05, 0.15)
UNTIMED = 8          # decode windows in a row left untimed (speculation.py) before one is timed


def expected_tokens(k: int, a: float) -> float:
    """Tokens a slot gets from one window with k drafts kept each with probability a (given
    the ones before): 1 + a + .. + a^k."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def share_rows(wants: list[int], acceptance: list[float], room: int) -> list[int]:
    """Drafts per slot: of each slot's `wants` drafts, the `room` most likely to be kept
    (the j-th draft of a slot at acceptance a by a^j; ties: j, then the slot's order).
    Each slot gets a prefix of its drafts."""
    ranked = sorted((-(a ** j), j, i) for i, (want, a) in enumerate(zip(wants, acceptance))
                    for j in range(1, want + 1))
    counts = [0] * len(wants)
    for _, _, i in ranked[:max(room, 0)]:
        counts[i] += 1
    return counts


@dataclass
class Acceptance:
    """Decayed counts of drafts kept and of first rejections (one per window that had one)."""
    kept: float = 0.0
    rejected: float = 0.0

    def observe(self, drafted: int, kept: int) -> None:
        """One window's drafts of a slot: `kept` of `drafted` (kept < drafted: one rejection)."""
        if drafted:
            self.kept = DECAY * self.kept + kept
            self.rejected = DECAY * self.rejected + (kept < drafted)

    def rate(self, prior: float = PRIOR) -> float:
        return (self.kept + prior * PRIOR_WEIGHT) / (self.kept + self.rejected + PRIOR_WEIGHT)


@dataclass(frozen=True)
class DraftChoice:
    """What a group's decode windows carry, and why (shown per group in /v1/status)."""
    k: int                        # drafts per slot at most
    rows: int                     # the window's rows that implies
    acceptance: float             # the group's acceptance when chosen
    window_ms: float | None       # the measured time of windows of that size and k
    tokens_per_window: float      # expected, all the window's slots
    explored: bool = False        # tried because never (or not lately) timed
    timed: tuple[tuple[int, int, float], ...] = ()   # (rows, k, ms) measured so far

    @property
    def tok_s(self) -> float | None:
        """Expected tokens per second of the group with this choice."""
        return self.tokens_per_window / self.window_ms * 1000 if self.window_ms else None


@dataclass
class GroupDrafts:
    """A group's drafting state: its acceptance, its decode windows' times, its choice."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    ms: dict[tuple[int, int], float] = field(default_factory=dict)   # (rows, k) -> ms
    timed_at: dict[tuple[int, int], int] = field(default_factory=dict)  # -> window count
    horizon: dict[tuple[int, int], int] = field(default_factory=dict)   # _retry's spans
    windows: int = 0               # decode windows sent
    untimed: int = 0               # of them, the last ones in a row not timed
    explored_at: int = -EXPLORE_EVERY
    choice: DraftChoice | None = None
    chosen_at: int = -HOLD
    in_flight: tuple[float, tuple[int, int]] | None = None   # (its time starts, (rows, k))
    ready_at: float | None = None   # the group's last window came back then, none sent since

    def sent(self, at: float, rows: int | None = None, k: int = 0,
             decode: bool | None = None) -> None:
        """A window of the group left at `at`: a decode window of `rows` rows asking k
        proposals a slot (timed from the group's last window's return, when no other went
        between), or (rows None) a prompt chunk or, `decode`, a decode window not timed;
        decode windows count towards HOLD, EXPLORE_EVERY and STALE, timed or not."""
        start, self.ready_at = self.ready_at, None
        if rows is not None or decode:
            self.windows += 1
            self.untimed = 0 if rows is not None else self.untimed + 1
        if rows is not None:
            self.in_flight = (at if start is None else start, (rows, k))

    def landed(self, at: float, previous: float) -> None:
        """A window of the group came back at `at` (the clock of sent), the result before it
        at `previous`: a decode window's time runs from the later of its start (see sent) and
        `previous`, so that waiting behind other groups' windows does not count."""
        self.ready_at = at
        if self.in_flight is None:
            return
        (t0, key), self.in_flight = self.in_flight, None
        ms = (at - max(t0, previous)) * 1000
        old = self.time(key)
        self.ms[key] = ms if old is None else (1 - TIME_WEIGHT) * old + TIME_WEIGHT * ms
        self.timed_at[key] = self.windows

    def time(self, key: tuple[int, int]) -> float | None:
        """The key's average window time in ms, None if never or not lately timed."""
        if key not in self.ms or self.windows - self.timed_at[key] > STALE:
            return None
        return self.ms[key]

    def timed(self) -> tuple[tuple[int, int, float], ...]:
        return tuple((r, k, round(ms, 3)) for (r, k), ms in sorted(self.ms.items())
                     if self.time((r, k)) is not None)

    def per_slot(self, cfg: SchedulerConfig, decoding: int) -> int:
        """Drafts per slot for the group's windows of `decoding` slots: cfg.draft_tokens, or
        with draft_tokens auto the group's choice (before any of its decode windows is timed,
        the plain window's: see choose)."""
        if not cfg.auto_drafts:
            return cfg.draft_tokens
        decoding = max(decoding, 1)
        return self.choose(decoding, cfg.draft_window_rows(round_rows(decoding)),
                           cfg.max_draft_tokens, cfg.drafter == "mtp",
                           MARGIN[cfg.groups > 1]).k

    def room(self, cfg: SchedulerConfig, decoding: int) -> int:
        """The most drafts a slot of the group may get in a decode window of `decoding` slots:
        its drafts per slot, within the rows drafts may add to such a window."""
        decoding = max(decoding, 1)
        return draft_room(decoding, self.per_slot(cfg, decoding),
                          cfg.draft_window_rows(round_rows(decoding)))

    def describe(self, k: int, rows: int, slots: int, key_k: int) -> DraftChoice:
        """A fixed k's window as a choice (draft_tokens K): for /v1/status."""
        a = self.acceptance.rate()
        return DraftChoice(k, rows, a, self.time((rows, key_k)),
                           _tokens(slots, min(slots * k, rows - slots), a), timed=self.timed())

    def choose(self, slots: int, limit: int, max_k: int, mtp: bool,
               margin: float = 0.0) -> DraftChoice:
        """draft_tokens auto: K for the group's next windows of `slots` decoding slots and at
        most `limit` rows (see the module's docstring). mtp: the time of a window depends on
        the proposals it asks for (the last stage drafts them), so times are kept per K.
        margin: the share by which a window unlike the plain one must beat it (MARGIN)."""
        if self.choice is not None and self.windows - self.chosen_at < HOLD:
            return self.choice
        a = self.acceptance.rate()
        options = []   # (k, rows, tokens, key)
        for k in range(max_k + 1):
            drafts = min(slots * k, limit - slots)
            if k and drafts <= min(slots * (k - 1), limit - slots):
                break   # no row for a k-th draft: more proposals asked for the same drafts
            options.append((k, round_rows(slots + drafts), _tokens(slots, drafts, a),
                            (round_rows(slots + drafts), k if mtp else 0)))
        plain = options[0][3]
        worth = lambda key: 1.0 if key == plain else 1.0 / (1.0 + margin)  # noqa: E731
        timed = [(_rate(tokens, self.time(key)) * worth(key), k, rows, tokens, key)
                 for k, rows, tokens, key in options if self.time(key) is not None]
        best = max(timed, key=lambda t: (t[0], -t[1])) if timed else None
        if best is not None and best[1]:   # drafting wins: its next loss waits RETRY again
            self.horizon.pop(best[4], None)
        explored = False
        if best is None:
            # nothing timed yet: the plain window's key first, every later choice is measured
            # against it; of its drafts the most (the pad rows' without mtp, none with: there
            # each proposal asked costs the drafter). Not an exploration: the most hopeful
            # drafts are tried as soon as it is timed.
            pick = max((o for o in options if o[3] == options[0][3]), key=lambda o: o[0])
            explored = True
        else:
            pick = best[1:]
            # with mtp, K climbs: one proposal beyond the most timed, never a jump to K = 7
            # whose drafter chain a useless head would pay for in full; while the most timed
            # is the best, the next is tried at once
            most = max((key[1] for key in self.ms if self.time(key) is not None), default=0)
            if self.windows - self.explored_at >= EXPLORE_EVERY or (mtp and best[1] >= most):
                # the most hopeful; on a tie (nothing known below either) the smaller window
                untimed = [(_rate(tokens, self._at_least(key)) * worth(key), -rows, k,
                            (k, rows, tokens, key)) for k, rows, tokens, key in options
                           if self.time(key) is None and (not mtp or k <= most + 1)]
                hopeful = max(untimed, default=None)
                if hopeful is not None and hopeful[0] > best[0]:
                    pick, explored = hopeful[-1], True
                elif best[1] == 0:
                    pick, explored = self._retry(options, pick)
        k, rows, tokens, key = pick
        if explored and best is not None:
            self.explored_at = self.windows
        self.chosen_at = self.windows
        self.choice = DraftChoice(k, rows, a, self.time(key), tokens, explored, self.timed())
        return self.choice

    def _retry(self, options: list[tuple], pick: tuple) -> tuple[tuple, bool]:
        """While the group drafts nothing, no drafting choice is timed again, nor is its
        acceptance observed: one that lost (on the acceptance of a few windows, or to a load
        since gone) would lose on that for good. So the fewest drafts timed more than their
        horizon ago (RETRY windows, doubled at each try until one wins, up to STALE) are tried
        again. Returns (the option, whether it is such a try)."""
        due = [o for o in options if o[0] and o[3] in self.ms
               and self.windows - self.timed_at[o[3]] > self.horizon.get(o[3], RETRY)]
        if not due:
            return pick, False
        key = due[0][3]
        self.horizon[key] = min(2 * self.horizon.get(key, RETRY), STALE)
        return due[0], True

    def _at_least(self, key: tuple[int, int]) -> float:
        """An untimed window's ms as far as the timed ones tell: times grow with rows and
        proposals, so at least the slowest timed window with no more of either (0 if none:
        worth a try); between two timed windows of its rows, in proportion to the proposals
        (each is one step of the drafter's chain), and past the most proposals timed at its
        rows, growing as the two largest timed grow a proposal."""
        timed = {k: ms for k, ms in self.ms.items() if self.time(k) is not None}
        low = max((t for (rows, k), t in timed.items() if rows <= key[0] and k <= key[1]),
                  default=0.0)
        ks = [k for rows, k in timed if rows == key[0]]
        lo = max((k for k in ks if k < key[1]), default=None)
        hi = min((k for k in ks if k > key[1]), default=None)
        if lo is not None and hi is not None:
            t0, t1 = timed[(key[0], lo)], timed[(key[0], hi)]
            low = max(low, t0 + (t1 - t0) * (key[1] - lo) / (hi - lo))
        elif lo is not None and hi is None:
            below = max((k for k in ks if k < lo), default=None)
            if below is not None:
                t0, t1 = timed[(key[0], below)], timed[(key[0], lo)]
                low = max(low, t1 + max(t1 - t0, 0.0) * (key[1] - lo) / (lo - below))
        return low


def _rate(tokens: float, ms: float) -> float:
    return tokens / ms if ms > 0 else float("inf")


def _tokens(slots: int, drafts: int, a: float) -> float:
    """Expected tokens of a window whose `slots` slots share `drafts` drafts evenly."""
    per, extra = divmod(max(drafts, 0), slots)
    return (slots - extra) * expected_tokens(per, a) + extra * expected_tokens(per + 1, a)


@dataclass
class RequestDrafts:
    """A request's drafting between two of its windows."""
    counts: DraftCounts = field(default_factory=DraftCounts)   # its drafts, and kept
    proposals: list[int] = field(default_factory=list)  # mtp: for its next decode window
    lookup: PromptLookup | None = None                  # the lookup drafter's index
    acceptance: Acceptance = field(default_factory=Acceptance)   # of its recent windows
    observed: tuple[int, int] = (0, 0)   # (drafted, accepted) already in `acceptance`

    def observe(self, group: Acceptance) -> None:
        """Counts the drafts verified since the last call (its last decode window's) into its
        acceptance and its group's."""
        drafted = self.counts.drafted - self.observed[0]
        if not drafted:   # nothing verified since: nothing to count
            return
        accepted = self.counts.accepted - self.observed[1]
        self.observed = (self.counts.drafted, self.counts.accepted)
        self.acceptance.observe(drafted, accepted)
        group.observe(drafted, accepted)
