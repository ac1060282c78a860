"""`strata-bench drafts` as a user runs it (in-process, on the session's launch of the tiny
model): both arms give every request the same tokens, the windows and drafts add up, and a
draft count that leaves no row, or the mtp drafter without a head, gets a sentence."""
from __future__ import annotations

import json

from click.testing import CliRunner

from strata.bench.cli import main


def bench(*args: str):
    return CliRunner().invoke(main, ["drafts", *args], prog_name="strata-bench")


def test_drafts_bench_plain_and_drafts(tiny_model, shared_stages, tmp_path):
    out = bench("--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--clients", "2", "--batch", "2", "--tokens", "24",
                "--draft-tokens", "3", "--repeats", "1", "--json-out", str(tmp_path / "d.json"))
    assert out.exit_code == 0, (out.output, out.exception)
    assert len(shared_stages) == 1
    assert "every request has the same tokens" in out.stdout
    report = json.loads((tmp_path / "d.json").read_text())
    rows = {r["arm"]: r for r in report["results"]}
    assert report["same"] and report["draft_tokens"] == 3
    assert report["drafter"] == "lookup"   # the tiny model has no NextN head
    assert "drafts with lookup" in out.stderr
    assert rows["plain"]["drafted"] == 0 and rows["plain"]["windows"] >= 24
    assert 0 <= rows["drafts"]["accepted"] <= rows["drafts"]["drafted"]
    # every window yields at least one token per request it serves, and accepted drafts more
    assert rows["drafts"]["windows"] <= rows["plain"]["windows"]


def test_drafts_need_a_row_for_the_slot(tiny_model):
    out = bench("--model", str(tiny_model), "--devices", "cpu", "--draft-tokens", "8")
    assert out.exit_code == 2, (out.output, out.exception)
    assert "--draft-tokens 8 is not from 0 to 7" in out.stderr


def test_the_mtp_drafter_needs_a_head(tiny_model):
    out = bench("--model", str(tiny_model), "--devices", "cpu", "--drafter", "mtp")
    assert out.exit_code == 2, (out.output, out.exception)
    assert "--drafter mtp needs a NextN head" in out.stderr
