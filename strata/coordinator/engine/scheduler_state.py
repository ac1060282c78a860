"""What the scheduler keeps between two steps: its requests, the windows in flight (whose rows
serve whom), each group's window state, and the snapshot of the slots it shows
(scheduler.py decides; this module only holds)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from strata.coordinator.speculation.draft_choice import DraftChoice, RequestDrafts
from strata.coordinator.speculation.drafts import DraftCounts
from strata.coordinator.sequence import Sequence
from strata.coordinator.slots import Slot


@dataclass
class Request:
    id: int                  # unique within its scheduler, in order of submission
    seq: Sequence
    on_done: Callable[["Request"], None] = lambda r: None
    slot: Slot | None = None
    cancelled: bool = False
    reused: int = 0          # prompt tokens the slot already held
    error: str | None = None
    notified: bool = False   # on_done was called (exactly once)
    drafts: RequestDrafts = field(default_factory=RequestDrafts)   # draft_choice.py

    @property
    def done(self) -> bool:
        return self.seq.finish_reason is not None


@dataclass(frozen=True)
class RowOwner:
    """A slot's rows in a window in flight: the request they serve, how many of them sample
    (0 for a prompt chunk before the last), and the draft tokens those sampled rows verify.
    Their log-probabilities come in row order: the prompt positions `scores` names (a
    request that scores its prompt), then one per sampled row if the request asks for them.
    `ends`: the window reads the end of a prompt that samples nothing (max_tokens 0)."""
    slot: Slot
    request: Request
    sampled: int
    drafts: list[int] = field(default_factory=list)
    scores: tuple[int, ...] = ()
    ends: bool = False

    @property
    def logprobs(self) -> int:
        """The log-probabilities the rows report (Result.logprobs entries)."""
        asks = self.request.seq.params.logprobs is not None
        return len(self.scores) + (self.sampled if asks else 0)


@dataclass
class Flight:
    group: int
    owners: list[RowOwner]   # in row order; sampled tokens come back in this order


@dataclass(frozen=True)
class DecodeWindow:
    """A decode window's size: `rows` in all, `live` of them rows of requests (decoding slots
    and their drafts); the rest are pad rows."""
    rows: int
    live: int


@dataclass
class Group:
    """A group's window state: a group has one window in flight, or while it has no decoding
    slot, up to prompt_depth chunks of the slot whose prompt streams, or decoding ahead, a
    window and the next one sent behind it (ahead.py)."""
    flights: int = 0                 # windows in flight
    streaming: Slot | None = None    # the slot whose chunks stream
    prefer_read: bool = True         # alternate prompt chunks and decode windows
    ahead: int = 0                   # chunks sent in a row while slots decode
    cursor: int = -1                 # the slot that ended the last decode window
    last_decode: DecodeWindow | None = None   # the last decode window sent
    # decoding ahead: the window in flight the group's next may go behind, reading its picks
    # (its last window sent, while decoding ahead is allowed); None: no such window
    followable: int | None = None


@dataclass(frozen=True)
class SlotState:
    """One slot as the scheduler sees it between two steps."""
    slot: int
    group: int
    state: str                 # idle | reading | rebuilding | decoding
    request: int | None = None
    prompt_tokens: int = 0
    read: int = 0              # prompt tokens in the slot's KV so far
    reused: int = 0            # of them, held from an earlier request (the conversation cache)
    generated: int = 0
    held: int = 0              # an idle slot's cached prompt tokens
    draft_counts: DraftCounts = field(default_factory=DraftCounts)   # its request's (a copy)


@dataclass(frozen=True)
class SchedulerSnapshot:
    slots: tuple[SlotState, ...]
    in_flight: tuple[int, ...]   # per group: its windows out
    queued: int
    decode_windows: tuple[DecodeWindow | None, ...] = ()   # per group: its last decode window
    # every request's drafts since the start (a copy)
    draft_counts: DraftCounts = field(default_factory=DraftCounts)
    draft_choices: tuple[DraftChoice | None, ...] = ()   # per group: what its windows carry
