"""`strata-bench sweep` as a user runs it: one row per mode and client count, a JSON file and a
PNG; and a sentence, not a traceback, for a bad --clients."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from strata.bench.cli import main
from strata.bench.harness import Workload, decode_phase, prompt_ids, prompt_set
from strata.bench.sweep import parse_clients, parse_modes
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer


def bench(*args: str):
    return CliRunner().invoke(main, list(args), prog_name="strata-bench")


def test_sweep_rows_json_and_plot(tiny_model, no_stage_left, shared_stages, tmp_path):
    out = bench("sweep", "--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--clients", "1,2", "--tokens", "4", "--repeats", "1",
                "--json-out", str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "sweep.png"))
    assert out.exit_code == 0, (out.output, out.exception)
    assert len(shared_stages) == 1  # serial and pipelined; 1gpu (one stage) launches its own
    assert len(out.stdout.splitlines()) == 2 + 6  # header, columns, 3 modes x 2 client counts
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["machine"] and report["conditions"]["batch"] == 2  # = the largest count
    assert report["conditions"]["int8_activations"] == []   # CPU stages compute in fp32
    assert "int8 activations" not in out.stdout.splitlines()[0]
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


def test_sweep_drafted_modes_beside_the_plain_ones(tiny_model, no_stage_left, tmp_path):
    """serial, pipelined, serial-mtp and pipelined-mtp in one launch (the head's), each row
    the median of 3 runs, with the drafts' acceptance and tokens per decode window."""
    from test_mtp import repeating_head
    head = repeating_head(tmp_path / "head.gguf", tiny_model)
    out = bench("sweep", "--model", str(tiny_model), "--mtp-head", str(head), "--layer-split",
                "2", "--devices", "cpu", "--ctx-size", "256", "--clients", "1,2", "--tokens",
                "6", "--modes", "serial,pipelined,serial-mtp,pipelined-mtp", "--draft-tokens",
                "3", "--json-out", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png"))
    assert out.exit_code == 0, (out.output, out.exception)
    lines = out.stdout.splitlines()
    assert "MTP drafts per slot 3 (serial-mtp/pipelined-mtp), medians of 3" in lines[0]
    assert lines[1].split()[-2:] == ["tok/window", "accepted"] and len(lines) == 2 + 8
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["conditions"]["repeats"] == 3
    rows = {(r["mode"], r["clients"]): r for r in report["results"]}
    assert set(rows) == {(m, c) for m in ("serial", "pipelined", "serial-mtp", "pipelined-mtp")
                         for c in (1, 2)}
    for (mode, clients), r in rows.items():
        assert len(r["repeats_total_tok_s"]) == 3
        assert r["total_tok_s"] == sorted(r["repeats_total_tok_s"])[1]   # the median
        assert r["groups"] == (2 if mode.startswith("pipelined") else 1)
        # the decode windows by the proposals a slot they ask, and each group's last choice
        assert sum(r["windows_by_k"].values()) == r["decode_windows"]
        assert len(r["choices"]) == 3 and all(len(c) == r["groups"] for c in r["choices"])
        if mode.endswith("-mtp"):
            assert r["draft_tokens"] == 3 and r["drafted"] > 0 and 0 <= r["acceptance"] <= 1
            # the tiny model's greedy text repeats its token: the head's drafts are kept
            assert r["tokens_per_window"] > 1.5 * clients / r["groups"], r
            assert r["windows_by_k"].get("3", 0) > 0
            # (a group with no slot, one client in two groups, chose nothing)
            assert all(any(rep) for rep in r["choices"]), r
            assert all(c["k"] == 3 for rep in r["choices"] for c in rep if c), r
        else:
            assert r["draft_tokens"] == 0 and r["drafted"] == 0 and r["acceptance"] is None
            assert r["tokens_per_window"] <= clients
            assert set(r["windows_by_k"]) == {"0"}
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_says_a_drafted_mode_needs_a_head(tiny_model, no_stage_left):
    out = bench("sweep", "--model", str(tiny_model), "--modes", "serial,pipelined-mtp")
    assert out.exit_code == 2, (out.output, out.exception)
    assert out.stderr == ("strata-bench sweep: --modes pipelined-mtp draft with a NextN head, "
                          "and the model file tiny.gguf has none; pass --mtp-head PATH (a head "
                          "made for this model) or leave pipelined-mtp out of --modes\n")


def test_parse_clients_and_modes():
    assert parse_clients("1,2, 4") == [1, 2, 4]
    assert parse_modes("pipelined,1gpu") == ["1gpu", "pipelined"]  # in the table's order
    with pytest.raises(ValueError, match="choose among 1gpu,serial,pipelined,serial-mtp,"
                                         "pipelined-mtp"):
        parse_modes("2gpu")
    assert parse_modes("pipelined-mtp,serial") == ["serial", "pipelined-mtp"]


def test_sweep_takes_the_pipelined_groups_from_batch_groups(tiny_model, no_stage_left, tmp_path):
    out = bench("sweep", "--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--clients", "4", "--tokens", "3", "--modes", "pipelined",
                "--batch-groups", "4", "--repeats", "1", "--json-out", str(tmp_path / "s.json"),
                "--trace-dir", str(tmp_path / "traces"), "--temperature", "0.7", "--top-k", "5")
    assert out.exit_code == 0, (out.output, out.exception)
    assert ", temperature 0.7, top-k 5, batch 4," in out.stdout.splitlines()[0]
    report = json.loads((tmp_path / "s.json").read_text())
    assert (report["conditions"]["top_k"], report["conditions"]["top_p"]) == (5, 1.0)
    (row,) = report["results"]
    assert (row["mode"], row["stages"], row["groups"]) == ("pipelined", 2, 4)
    # --trace-dir: the row's decode windows, split per stage, printed and in the JSON
    assert row["trace"]["windows"] > 0 and len(row["trace"]["stages"]) == 2
    assert "# pipelined 4 clients: stage 0 GPU " in out.stdout and "stage 1 GPU" in out.stdout
    bad = bench("sweep", "--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--clients", "4", "--modes", "pipelined", "--batch-groups", "3")
    assert bad.exit_code == 2 and "does not divide --batch 4" in bad.stderr


def test_decode_phase_starts_when_every_prompt_is_read():
    # request 0: tokens at 1, 2, 3; request 1 reads longer, first token at 2.5, then 3.5, 4
    assert decode_phase([[1.0, 2.0, 3.0], [2.5, 3.5, 4.0]]) == (3, 1.5)
    assert decode_phase([[1.0, 1.5, 2.0, 3.0]]) == (3, 2.0)  # one client: after its first


def test_prompt_ids_are_exactly_n_tokens(tiny_model):
    tok = Tokenizer.from_gguf(ModelFile(tiny_model).reader)
    for n in (1, 7, 100):
        prompts = prompt_ids(tok, 20, n)
        assert len(prompts) == 20 and {len(p) for p in prompts} == {n}
    long = prompt_ids(tok, 3, 100)
    assert long[0][:5] == tok.encode(prompt_set(1)[0])[:5] and long[0] != long[1]


def test_sweep_prompt_tokens_counts_as_llamacpp_does(tiny_model, no_stage_left, shared_stages,
                                                     tmp_path):
    out = bench("sweep", "--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--clients", "1,3", "--tokens", "5", "--prompt-tokens",
                "40", "--modes", "serial,pipelined", "--repeats", "1", "--json-out", str(tmp_path / "s.json"))
    assert out.exit_code == 0, (out.output, out.exception)
    assert len(shared_stages) == 1
    assert "40-token prompts, 5 tokens per client" in out.stdout.splitlines()[0]
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["conditions"]["prompt_tokens"] == 40
    for r in report["results"]:
        assert r["prompt_tokens_read"] == 40 * r["clients"]  # every prompt whole, 40 tokens
        generated = 5 * r["clients"]
        # (prompt + generated) and generated tokens over the same run's seconds
        assert r["prompt_and_generated_tok_s"] / r["total_tok_s"] == \
            pytest.approx((40 * r["clients"] + generated) / generated)
        assert r["decode_tok_s"] > 0
    assert len(out.stdout.splitlines()[1].split("tok/s")) == 5  # total, per-req, decode, pp+tg


def peer_report(path, prompt_tokens=40, tokens=5):
    """A report as strata-bench peer --engine llama.cpp --json-out writes it
    (tests/bench/test_bench_peer.py checks that command's file against load_peer)."""
    rows = [{"clients": c, "prompt_tokens": prompt_tokens, "tokens": tokens,
             "decode_tok_s": 100.0 * c, "prompt_and_generated_tok_s": 300.0 * c}
            for c in (1, 8)]
    path.write_text(json.dumps({"machine": "elsewhere", "results": rows, "conditions": {
        "engine": "llama.cpp", "model": "tiny.gguf", "prompt_tokens": prompt_tokens,
        "tokens_per_client": tokens, "clients": [1, 8], "devices": "cuda:0"}}))
    return path


def test_sweep_puts_llamacpp_beside(tiny_model, no_stage_left, shared_stages, tmp_path):
    peer = peer_report(tmp_path / "peer.json")
    out = bench("sweep", "--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--clients", "1,2", "--tokens", "5", "--prompt-tokens",
                "40", "--modes", "pipelined", "--repeats", "1", "--peer-json", str(peer), "--json-out",
                str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png"))
    assert out.exit_code == 0, (out.output, out.exception)
    lines = out.stdout.splitlines()
    assert lines[1].startswith(f"# llama.cpp: {peer}") and lines[2].endswith("llama.cpp decode")
    assert lines[3].split()[-1] == "100.00"  # 1 client: llama.cpp's row for 1
    assert lines[4].split()[-1] == "-"       # 2 clients: llama.cpp has no row for 2
    report = json.loads((tmp_path / "s.json").read_text())
    assert [r["peer_decode_tok_s"] for r in report["results"]] == [100.0, None]
    assert report["peer"]["conditions"]["engine"] == "llama.cpp"
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("extra, says", [
    ([], "run the sweep with --prompt-tokens 40 --tokens 5 so both count the same"),
    (["--prompt-tokens", "40", "--tokens", "6"],
     "run the sweep with --prompt-tokens 40 --tokens 5"),
    (["--prompt-tokens", "300", "--tokens", "5"], "need 305 positions a request, past --ctx-size"),
])
def test_sweep_refuses_a_peer_counted_otherwise(tiny_model, tmp_path, extra, says):
    peer = peer_report(tmp_path / "peer.json")
    out = bench("sweep", "--model", str(tiny_model), "--ctx-size", "256", "--peer-json",
                str(peer), *extra)
    assert out.exit_code == 2, (out.output, out.exception)
    assert says in out.stderr


def test_sweep_refuses_a_file_that_is_no_peer_report(tiny_model, tmp_path):
    (tmp_path / "x.json").write_text('{"results": []}')
    out = bench("sweep", "--model", str(tiny_model), "--peer-json", str(tmp_path / "x.json"),
                "--prompt-tokens", "8")
    assert out.exit_code == 2, (out.output, out.exception)
    assert "is not a report of strata-bench peer --engine llama.cpp --json-out" in out.stderr


def test_workload_pool_turns_and_seeds(tiny_model):
    tok = Tokenizer.from_gguf(ModelFile(tiny_model).reader)
    pool = ((1, 2), (3,), (4, 5, 6))
    work = Workload(pool=pool, temperature=0.7)
    # each repetition reads the next prompts of the pool, around its end
    assert work.prompts(tok, 2, offset=0) == [(0, [1, 2]), (1, [3])]
    assert work.prompts(tok, 2, offset=2) == [(2, [4, 5, 6]), (0, [1, 2])]
    p = work.params(2, 9)
    assert (p.temperature, p.seed, p.max_tokens) == (0.7, 1002, 9)
    assert Workload(pool=pool).params(2, 9).temperature == 0   # greedy
    plain = Workload().prompts(tok, 3)
    assert [p for _, p in plain] == [tok.encode(t) for t in prompt_set(3)]


def test_sweep_reads_a_prompts_file_with_a_temperature(tiny_model, no_stage_left, shared_stages,
                                                       tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about rivers, part {i}.",
                                           "split": "heldout" if i % 2 else "train"}) + "\n"
                               for i in range(8)))
    out = bench("sweep", "--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--clients", "1,2", "--tokens", "4", "--repeats", "2",
                "--modes", "serial,pipelined", "--prompts", str(prompts), "--temperature", "0.7",
                "--json-out", str(tmp_path / "s.json"))
    assert out.exit_code == 0, (out.output, out.exception)
    assert "4 heldout prompts of" in out.stdout and "temperature 0.7" in out.stdout
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["conditions"]["temperature"] == 0.7
    assert report["conditions"]["prompts"].startswith("heldout prompts of")
    assert {(r["mode"], r["clients"]) for r in report["results"]} == {
        (m, c) for m in ("serial", "pipelined") for c in (1, 2)}


def test_sweep_refuses_two_sources_of_prompts(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi", "split": "heldout"}) + "\n")
    out = bench("sweep", "--model", str(tiny_model), "--prompts", str(prompts),
                "--prompt-tokens", "8")
    assert out.exit_code != 0 and "give one" in out.output and "Traceback" not in out.output


def test_serial_windows_hold_every_slot(tiny_model):
    """With --window-rows auto, the serial mode's windows take all the slots (one window of
    16 rows for 16 clients), a pipelined group's its share (8 rows each for 2 groups)."""
    from strata.bench.sweep import plan_layouts, sweep
    ctx = sweep.make_context("sweep", ["--model", str(tiny_model), "--layer-split", "2",
                                       "--devices", "cpu", "--ctx-size", "256"])
    own = {"clients", "modes", "repeats", "tokens", "prompt_tokens", "prompts_file", "split",
           "temperature", "json_out", "plot_path", "peer_json", "trace_dir"}
    launch = {k: v for k, v in ctx.params.items() if k not in own}
    (layout,) = plan_layouts(launch, ["serial", "pipelined"], 16)
    assert {m: (c.groups, c.window_rows) for m, c in layout.modes.items()} == {
        "serial": (1, 16), "pipelined": (2, 8)}
    (layout,) = plan_layouts({**launch, "window_rows": "8"}, ["serial", "pipelined"], 16)
    assert {c.window_rows for c in layout.modes.values()} == {8}


def test_workload_filters_reach_every_request_and_need_a_temperature(tiny_model):
    work = Workload(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05)
    params = work.params(3, 16)
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.seed,
            params.max_tokens) == (0.7, 20, 0.9, 0.05, 1003, 16)
    out = bench("sweep", "--model", str(tiny_model), "--top-p", "0.9", "--min-p", "0.1")
    assert out.exit_code != 0 and out.stderr == (
        "strata-bench sweep: --top-p, --min-p filter sampled tokens, and greedy requests sample "
        "none; add --temperature above 0 or leave --top-p, --min-p out\n")
    out = bench("sweep", "--model", str(tiny_model), "--temperature", "0.7", "--top-p", "1.5")
    assert out.exit_code != 0
    assert out.stderr == "strata-bench sweep: top_p 1.5 is outside (0, 1]; use 1 to turn it off\n"
