"""The scheduler's configuration, checked once here; a front end names the fields its own way
(strata-launch: `--batch` for slots, see strata/launch/options.py)."""
from __future__ import annotations

from dataclasses import dataclass

from strata.config_error import ConfigError

WINDOW_ROW_STEP = 8    # decode windows have a multiple of this many rows
MAX_WINDOW_ROWS = 64   # the stages' largest decode window
SMALL_WINDOWS = (1, 2, 4)   # decode windows below WINDOW_ROW_STEP rows (min_window_rows)
# a slot's row and its drafts fit in the smallest decode window
MAX_DRAFT_TOKENS = WINDOW_ROW_STEP - 1
DRAFTERS = ("mtp", "lookup")   # the last stage's NextN head, or prompt lookup (drafts.py)
AUTO = "auto"
# draft_rows auto: drafts may fill a decode window up to the row tile its size without drafts
# falls in, 32 rows for windows up to 32, else 64. Measured on one H200 (docs/results/
# window_sizes_h200.txt), a window of 32 rows costs at most 1.16x one of 8, 16 or 24 rows
# (the 8B shape: 4.41, 4.54, 5.11 -> 5.08 ms; SmolLM2: 0.87-0.90 -> 0.92 ms), and one of 64 at
# most 1.10x one of 40-56 rows; growing past a tile costs more (8B: 32 -> 40 rows 1.28x).
DRAFT_TILES = (32, 64)
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
    # the fewest rows of a decode window: WINDOW_ROW_STEP, or 1, 2 or 4 (SMALL_WINDOWS): then
    # a window of up to 4 rows (live rows and drafts) has the smallest of those that holds
    # them and is at least this, so a lone request pays for 1 row, not 8 (window_shape)
    min_window_rows: int = WINDOW_ROW_STEP
    chunk_rows: int = 32
    ctx: int = 2048
    prompt_depth: int = 1   # prompt chunks of one slot in flight at once (> 1: pipelined)
    # at most this many draft rows per slot in a decode window (drafts.py); "auto": the
    # scheduler picks 0..MAX_DRAFT_TOKENS per group from window times and acceptance
    # (draft_choice.py)
    draft_tokens: int | str = 0
    drafter: str = "lookup"  # where drafts come from: DRAFTERS
    # the most rows drafts may add to a decode window beyond its decoding slots rounded up to
    # WINDOW_ROW_STEP (a multiple of it); None: up to the window's row tile (DRAFT_TILES;
    # strata-launch's --draft-rows auto on CUDA stages, 0 on CPU stages)
    draft_rows: int | None = None
    draft_sampling: str = "argmax"   # mtp proposals for sampled requests: DRAFT_SAMPLINGS
    # decode ahead: send a group's next window while the one before it is in flight, a decode
    # row whose token that window samples reading the stage's pick (Window.follows), so the
    # stage need not wait for the coordinator between them. Only a stage that is both first
    # and last holds its picks: set it for pipelines of one stage. The scheduler does it with
    # one group and no drafts, for decode windows while no request in them has a grammar or
    # a penalty (engine/ahead.py).
    decode_ahead: bool = False

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
        if self.min_window_rows not in (*SMALL_WINDOWS, WINDOW_ROW_STEP):
            raise ConfigError("min_window_rows", f"{{min_window_rows}} {self.min_window_rows} "
                              f"is not one of {', '.join(map(str, SMALL_WINDOWS))} or "
                              f"{WINDOW_ROW_STEP}", f"use {WINDOW_ROW_STEP} (the default) or 1")
        if self.draft_tokens != AUTO and not (isinstance(self.draft_tokens, int)
                                              and 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS):
            raise ConfigError("draft_tokens", f"{{draft_tokens}} {self.draft_tokens} is not "
                              f"from 0 to {MAX_DRAFT_TOKENS} (a slot's row and its drafts share "
                              f"one decode window of at least {WINDOW_ROW_STEP} rows)",
                              f"use 0 (off) to {MAX_DRAFT_TOKENS} or {AUTO}")
        rows = self.draft_rows
        if rows is not None and (rows % WINDOW_ROW_STEP
                                 or not 0 <= rows <= MAX_WINDOW_ROWS - WINDOW_ROW_STEP):
            near = min(max(round_rows(rows), 0), MAX_WINDOW_ROWS - WINDOW_ROW_STEP)
            raise ConfigError("draft_rows", f"{{draft_rows}} {rows} is not a multiple of "
                              f"{WINDOW_ROW_STEP} from 0 to {MAX_WINDOW_ROWS - WINDOW_ROW_STEP} "
                              f"(a decode window has at most {MAX_WINDOW_ROWS} rows)",
                              f"use {near}")
        if self.drafter not in DRAFTERS:
            raise ConfigError("drafter", f"{{drafter}} {self.drafter!r} is not one of "
                              f"{', '.join(DRAFTERS)}", "use mtp or lookup")
        if self.draft_sampling not in DRAFT_SAMPLINGS:
            raise ConfigError("draft_sampling", f"{{draft_sampling}} {self.draft_sampling!r} is "
                              f"not one of {', '.join(DRAFT_SAMPLINGS)}",
                              "use coupled or argmax")

    def window_shape(self, rows: int) -> int:
        """Rows of a decode window holding `rows` rows (its slots' and their drafts'): with
        min_window_rows below WINDOW_ROW_STEP, the smallest of SMALL_WINDOWS, at least
        min_window_rows, that holds them; else (and past 4 rows) round_rows(rows)."""
        if self.min_window_rows < WINDOW_ROW_STEP:
            for size in SMALL_WINDOWS:
                if max(rows, self.min_window_rows) <= size:
                    return size
        return round_rows(rows)

    @property
    def auto_drafts(self) -> bool:
        """draft_tokens auto: the scheduler picks each group's drafts per slot."""
        return self.draft_tokens == AUTO

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts a slot verifies in one window."""
        return MAX_DRAFT_TOKENS if self.auto_drafts else self.draft_tokens

    def draft_window_rows(self, rows: int) -> int:
        """The most rows a decode window of `rows` rows without drafts (a multiple of
        WINDOW_ROW_STEP) may have with them: rows + draft_rows, or with draft_rows auto its row
        tile (DRAFT_TILES); never more than MAX_WINDOW_ROWS."""
        if self.draft_rows is not None:
            return min(rows + self.draft_rows, MAX_WINDOW_ROWS)
        return max(rows, next(t for t in DRAFT_TILES if rows <= t))


def auto_groups(slots: int, stages: int) -> int:
    """One group per stage, or the largest count below that divides the slots (1 when there
    are no slots: SchedulerConfig says what is wrong). 64 slots over 2 stages: 2 groups, so
    with auto window rows each group's decode window grows to 32 rows."""
    return max(g for g in range(1, max(min(slots, stages), 1) + 1) if slots % g == 0)
