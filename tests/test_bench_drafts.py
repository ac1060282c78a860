"""`strata-bench drafts` as a user runs it: both arms give every request the same tokens, the
windows and drafts add up, and a draft count that leaves no row gets a sentence."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.bench", "drafts", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_drafts_bench_plain_and_drafts(tiny_model, no_stage_left, tmp_path):
    out = bench("--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--clients", "2", "--batch", "2", "--tokens", "24",
                "--draft-tokens", "3", "--repeats", "1", "--json-out", str(tmp_path / "d.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every request has the same tokens" in out.stdout
    report = json.loads((tmp_path / "d.json").read_text())
    rows = {r["arm"]: r for r in report["results"]}
    assert report["same"] and report["draft_tokens"] == 3
    assert rows["plain"]["drafted"] == 0 and rows["plain"]["windows"] >= 24
    assert 0 <= rows["drafts"]["accepted"] <= rows["drafts"]["drafted"]
    # every window yields at least one token per request it serves, and accepted drafts more
    assert rows["drafts"]["windows"] <= rows["plain"]["windows"]


def test_drafts_need_a_row_for_the_slot(tiny_model, no_stage_left):
    out = bench("--model", str(tiny_model), "--devices", "cpu", "--draft-tokens", "8")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--draft-tokens 8 must be at least 0 and below --window-rows 8" in out.stderr
