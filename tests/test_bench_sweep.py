"""`strata-bench sweep` as a user runs it: one row per mode and client count, a JSON file and a
PNG; and a sentence, not a traceback, for a bad --clients."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from strata.bench.cli import main
from strata.bench.sweep import parse_clients, parse_modes


def bench(*args: str):
    return CliRunner().invoke(main, list(args), prog_name="strata-bench")


def test_sweep_rows_json_and_plot(tiny_model, no_stage_left, shared_stages, tmp_path):
    out = bench("sweep", "--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--clients", "1,2", "--tokens", "4",
                "--json-out", str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "sweep.png"))
    assert out.exit_code == 0, (out.output, out.exception)
    assert len(shared_stages) == 1  # serial and pipelined; 1gpu (one stage) launches its own
    assert len(out.stdout.splitlines()) == 2 + 6  # header, columns, 3 modes x 2 client counts
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["machine"] and report["conditions"]["batch"] == 2  # = the largest count
    rows = {(r["mode"], r["clients"]): r for r in report["results"]}
    assert len(rows) == len(report["results"]) == 6
    assert set(rows) == {(m, c) for m in ("1gpu", "serial", "pipelined") for c in (1, 2)}
    for (mode, _), r in rows.items():
        assert r["total_tok_s"] > 0 and r["per_request_tok_s"] > 0 and r["ttft_median_s"] > 0
        assert (r["stages"], r["groups"]) == {"1gpu": (1, 1), "serial": (2, 1),
                                              "pipelined": (2, 2)}[mode]
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("clients", ["0", "a,b"])
def test_sweep_refuses_bad_clients(tiny_model, clients):
    out = bench("sweep", "--model", str(tiny_model), "--clients", clients)
    assert out.exit_code == 2, (out.output, out.exception)
    assert f"strata-bench sweep: --clients {clients!r} is not a list of client counts" in out.stderr


def test_parse_clients_and_modes():
    assert parse_clients("1,2, 4") == [1, 2, 4]
    assert parse_modes("pipelined,1gpu") == ["1gpu", "pipelined"]  # in the table's order
    with pytest.raises(ValueError, match="choose among 1gpu,serial,pipelined"):
        parse_modes("2gpu")


def test_sweep_takes_the_pipelined_groups_from_batch_groups(tiny_model, no_stage_left, tmp_path):
    out = bench("sweep", "--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--clients", "4", "--tokens", "3", "--modes", "pipelined",
                "--batch-groups", "4", "--json-out", str(tmp_path / "s.json"),
                "--trace-dir", str(tmp_path / "traces"))
    assert out.exit_code == 0, (out.output, out.exception)
    (row,) = json.loads((tmp_path / "s.json").read_text())["results"]
    assert (row["mode"], row["stages"], row["groups"]) == ("pipelined", 2, 4)
    # --trace-dir: the row's decode windows, split per stage, printed and in the JSON
    assert row["trace"]["windows"] > 0 and len(row["trace"]["stages"]) == 2
    assert "# pipelined 4 clients: stage 0 GPU " in out.stdout and "stage 1 GPU" in out.stdout
    bad = bench("sweep", "--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--clients", "4", "--modes", "pipelined", "--batch-groups", "3")
    assert bad.exit_code == 2 and "does not divide --batch 4" in bad.stderr
