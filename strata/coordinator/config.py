"""The scheduler's configuration, checked once here; a front end names the fields its own way
(strata-launch: `--batch` for slots, see strata/launch/options.py)."""
from __future__ import annotations

from dataclasses import dataclass

from strata.config_error import ConfigError

WINDOW_ROW_STEP = 8    # decode windows have a multiple of this many rows
MAX_WINDOW_ROWS = 64   # the stages' largest decode window
# a slot's row and its drafts fit in the smallest decode window
MAX_DRAFT_TOKENS = WINDOW_ROW_STEP - 1
DRAFTERS = ("mtp", "lookup")   # the last stage's NextN head, or prompt lookup (drafts.py)
DRAFT_SAMPLINGS = ("coupled", "argmax")   # how mtp proposes for sampled requests (drafts.py)


def round_rows(rows: int) -> int:
    """Rows of a decode window that holds `rows` live rows: rounded up to WINDOW_ROW_STEP."""
    return -(-rows // WINDOW_ROW_STEP) * WINDOW_ROW_STEP


def auto_window_rows(slots: int, groups: int) -> int:
    """The largest decode window a group needs: the smallest multiple of WINDOW_ROW_STEP that
    holds all its slots (slots / groups), at most MAX_WINDOW_ROWS."""
    return min(round_rows(max(slots // groups, 1)), MAX_WINDOW_ROWS)


@dataclass(frozen=True)
class SchedulerConfig:
    slots: int = 1
    groups: int = 1
    # the most rows of a decode window: a multiple of WINDOW_ROW_STEP up to MAX_WINDOW_ROWS;
    # None (auto) is resolved here to auto_window_rows(slots, groups). Each decode window has
    # its live rows rounded up to WINDOW_ROW_STEP, at most this (scheduler.py).
    window_rows: int | None = None
    chunk_rows: int = 32
    ctx: int = 2048
    prompt_depth: int = 1   # prompt chunks of one slot in flight at once (> 1: pipelined)
    draft_tokens: int = 0   # at most this many draft rows per slot in a decode window (drafts.py)
    drafter: str = "lookup"  # where drafts come from: DRAFTERS
    draft_sampling: str = "coupled"   # mtp proposals for sampled requests: DRAFT_SAMPLINGS

    def __post_init__(self):
        for name in ("slots", "chunk_rows", "ctx", "prompt_depth"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(name, f"{{{name}}} {value} is below 1", "use 1 or more")
        if self.groups < 1 or self.slots % self.groups:
            raise ConfigError("groups", f"{{groups}} {self.groups} does not divide {{slots}} "
                              f"{self.slots}", f"use a divisor of {self.slots}")
        if self.window_rows is None:
            object.__setattr__(self, "window_rows", auto_window_rows(self.slots, self.groups))
        rows = self.window_rows
        if rows % WINDOW_ROW_STEP or not WINDOW_ROW_STEP <= rows <= MAX_WINDOW_ROWS:
            near = min(max(round_rows(rows), WINDOW_ROW_STEP), MAX_WINDOW_ROWS)
            raise ConfigError("window_rows", f"{{window_rows}} {rows} is not a multiple of "
                              f"{WINDOW_ROW_STEP} from {WINDOW_ROW_STEP} to {MAX_WINDOW_ROWS} "
                              f"(the most rows a stage takes in a decode window)",
                              f"use {near}")
        if not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError("draft_tokens", f"{{draft_tokens}} {self.draft_tokens} is not "
                              f"from 0 to {MAX_DRAFT_TOKENS} (a slot's row and its drafts share "
                              f"one decode window of at least {WINDOW_ROW_STEP} rows)",
                              f"use 0 (off) to {MAX_DRAFT_TOKENS}")
        if self.drafter not in DRAFTERS:
            raise ConfigError("drafter", f"{{drafter}} {self.drafter!r} is not one of "
                              f"{', '.join(DRAFTERS)}", "use mtp or lookup")
        if self.draft_sampling not in DRAFT_SAMPLINGS:
            raise ConfigError("draft_sampling", f"{{draft_sampling}} {self.draft_sampling!r} is "
                              f"not one of {', '.join(DRAFT_SAMPLINGS)}",
                              "use coupled or argmax")


def auto_groups(slots: int, stages: int) -> int:
    """One group per stage, or the largest count below that divides the slots (1 when there
    are no slots: SchedulerConfig says what is wrong). 64 slots over 2 stages: 2 groups, so
    with auto window rows each group's decode window grows to 32 rows."""
    return max(g for g in range(1, max(min(slots, stages), 1) + 1) if slots % g == 0)
