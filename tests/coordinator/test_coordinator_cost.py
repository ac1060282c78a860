"""tools/coordinator_cost.py, the coordinator's host work a decode window: its answering
pipeline drives the real Scheduler, whose drafts are kept when the proposals are the tokens
sampled and not when they are not."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from coordinator_cost import run  # noqa: E402


def test_kept_proposals_take_fewer_windows_for_the_same_tokens():
    _, plain, tokens = run(slots=4, tokens=24, k=0, kept=False, prompt=4)
    _, wrong, wrong_tokens = run(slots=4, tokens=24, k=2, kept=False, prompt=4)
    _, kept, kept_tokens = run(slots=4, tokens=24, k=2, kept=True, prompt=4)
    assert tokens == wrong_tokens == kept_tokens == 4 * 24
    assert wrong == plain and kept < plain * 0.5, (plain, wrong, kept)
