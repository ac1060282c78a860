"""The scheduler's configuration, checked once here; a front end names the fields its own way
(strata-launch: `--batch` for slots, see strata/launch/options.py)."""
from __future__ import annotations

from dataclasses import dataclass

from strata.config_error import ConfigError


@dataclass(frozen=True)
class SchedulerConfig:
    slots: int = 1
    groups: int = 1
    window_rows: int = 8
    chunk_rows: int = 32
    ctx: int = 2048
    prompt_depth: int = 1   # prompt chunks of one slot in flight at once (> 1: pipelined)
    draft_tokens: int = 0   # at most this many draft rows per slot in a decode window (drafts.py)

    def __post_init__(self):
        for name in ("slots", "window_rows", "chunk_rows", "ctx", "prompt_depth"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(name, f"{{{name}}} {value} is below 1", "use 1 or more")
        if not 0 <= self.draft_tokens < self.window_rows:
            raise ConfigError("draft_tokens", f"{{draft_tokens}} {self.draft_tokens} must be at "
                              f"least 0 and below {{window_rows}} {self.window_rows} (a slot's "
                              f"row and its drafts share one window)")
        if self.groups < 1 or self.slots % self.groups:
            raise ConfigError("groups", f"{{groups}} {self.groups} does not divide {{slots}} "
                              f"{self.slots}", f"use a divisor of {self.slots}")


def auto_groups(slots: int, stages: int) -> int:
    """One group per stage, or the largest count below that divides the slots (1 when there
    are no slots: SchedulerConfig says what is wrong)."""
    return max(g for g in range(1, max(min(slots, stages), 1) + 1) if slots % g == 0)
