"""`strata-bench drafts` as a user runs it (in-process, on the session's launch of the tiny
model): both arms give every request the same tokens, the windows and drafts add up, and a
draft count that leaves no row, or the mtp drafter without a head, gets a sentence. With a
prompts file: its parsing and its mistakes, and held-out prompts with a temperature,
coupled and argmax proposals side by side, per draft position."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from test_mtp import markov_target, repeating_head

from strata.bench.cli import main
from strata.bench.harness import read_prompts
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer


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


def write_prompts(path, lines):
    path.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
    return path


PROMPTS = [{"prompt": "The capital of France is", "split": "heldout"},
           {"prompt": "Once upon a time", "split": "train"},
           {"prompt": "def add(a, b):", "split": "heldout"},
           {"prompt": "Water boils at", "split": "heldout"}]


def test_read_prompts_takes_the_split_asked_for(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2] + [""] + PROMPTS[2:])
    assert read_prompts(str(path), "heldout") == [
        "The capital of France is", "def add(a, b):", "Water boils at"]
    assert read_prompts(str(path), "train") == ["Once upon a time"]
    assert read_prompts(str(path), "all") == [p["prompt"] for p in PROMPTS]


@pytest.mark.parametrize("lines, args, words", [
    (None, [], ["--prompts", "no such file", "strata-train-mtp --write-prompts"]),
    ([PROMPTS[1]], [], ['has no line of split "heldout"', "use --split all"]),
    ([], ["--split", "all"], ["has no prompt", "give a file with at least one prompt"]),
    ([PROMPTS[0], '{"prompt": "x"}'], [], ["line 2 is not a JSON object", '"split" of']),
    (["not json"], [], ["line 1 is not a JSON object with a string \"prompt\""]),
    (None, ["--requests", "2"], ["--requests takes the first prompts of a --prompts file"]),
])
def test_prompts_file_mistakes_get_a_sentence(tiny_model, tmp_path, lines, args, words):
    path = tmp_path / "p.jsonl"
    if lines is not None:
        write_prompts(path, lines)
    prompts = [] if args[:1] == ["--requests"] else ["--prompts", str(path)]
    out = bench("--model", str(tiny_model), "--devices", "cpu", *prompts, *args)
    assert out.exit_code == 2, (out.output, out.exception)
    lines_out = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines_out) == 1 and lines_out[0].startswith("strata-bench drafts: "), out.stderr
    for w in words:
        assert w in lines_out[0], (w, lines_out[0])


def test_held_out_prompts_with_a_temperature_per_draft_position(tmp_path, no_stage_left):
    """A head that computes its target's distribution (test_mtp's Markov target), held-out
    prompts, temperature 0.7 and top-p 0.95, coupled and argmax proposals: every arm has the tokens of plain
    decoding; each coupled proposal is the target's own draw, so every draft position keeps
    nearly all it proposes, while argmax proposals are kept far less; the positions add up to
    the totals, in the output and the JSON."""
    target = markov_target(tmp_path / "markov.gguf")
    head = repeating_head(tmp_path / "head.gguf", target)
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    out = bench("--model", str(target), "--mtp-head", str(head), "--layer-split", "2",
                "--devices", "cpu", "--ctx-size", "256", "--batch", "2", "--clients", "2",
                "--tokens", "24", "--draft-tokens", "3", "--drafter", "mtp",
                "--draft-sampling", "both", "--temperature", "0.7", "--top-p", "0.95",
                "--prompts", str(prompts), "--repeats", "1",
                "--json-out", str(tmp_path / "d.json"))
    assert out.exit_code == 0, (out.output, out.exception)
    assert "3 request(s) (heldout prompts of" in out.stdout
    assert "temperature 0.7, top-p 0.95, " in out.stdout
    assert "every request has the same tokens" in out.stdout
    report = json.loads((tmp_path / "d.json").read_text())
    rows = {r["arm"]: r for r in report["results"]}
    assert report["same"] and report["requests"] == 3 and report["temperature"] == 0.7
    assert (report["top_k"], report["top_p"], report["min_p"]) == (0, 0.95, 0.0)
    assert set(rows) == {"plain", "coupled", "argmax"} and rows["plain"]["positions"] == []
    # the held-out prompts, each as a user message through the model's chat template
    tok = Tokenizer.from_gguf(ModelFile(target).reader)
    assert report["prompt_tokens"] == sum(
        len(tok.encode(tok.render_chat([{"role": "user", "content": p["prompt"]}])))
        for p in PROMPTS if p["split"] == "heldout")
    for arm in ("coupled", "argmax"):
        positions = rows[arm]["positions"]
        assert [p["position"] for p in positions] == [1, 2, 3]
        assert sum(p["proposed"] for p in positions) == rows[arm]["drafted"] > 0
        assert sum(p["accepted"] for p in positions) == rows[arm]["accepted"]
        line = next(x for x in out.stdout.splitlines()
                    if x.strip().startswith(f"{arm} accepted per draft position: "))
        assert line.endswith(", ".join(f"{p['position']}: {p['rate']:.2f} "
                                       f"({p['accepted']}/{p['proposed']})" for p in positions))
    # a request that samples its stop token drops the drafts after it: nearly all are kept
    assert all(p["rate"] >= 0.85 for p in rows["coupled"]["positions"]), rows["coupled"]
    assert rows["argmax"]["positions"][0]["rate"] < 0.6, rows["argmax"]


def test_a_token_difference_between_the_arms_exits_1(tiny_model, shared_stages, monkeypatch,
                                                      tmp_path):
    """The drafts arm's second measured run (its third: one warm-up first) is made to differ
    from plain in one token: the bench says which arm differs and exits 1."""
    from strata.bench import draftbench
    real, runs = draftbench.run_arm, []

    def run_arm(run, cfg, *args):
        row = real(run, cfg, *args)
        if cfg.draft_tokens:
            runs.append(cfg)
            if len(runs) == 3:
                row["generated"][0][-1] += 1
        return row

    monkeypatch.setattr(draftbench, "run_arm", run_arm)
    out = bench("--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--tokens", "8", "--draft-tokens", "3", "--repeats", "2",
                "--json-out", str(tmp_path / "d.json"))
    assert out.exit_code == 1, (out.output, out.exception)
    assert "TOKENS DIFFER in drafts" in out.stdout and len(runs) == 3
    assert json.loads((tmp_path / "d.json").read_text())["same"] is False


def test_filters_need_a_temperature(tiny_model):
    out = bench("--model", str(tiny_model), "--top-k", "20")
    assert out.exit_code != 0 and out.stderr == (
        "strata-bench drafts: --top-k filter sampled tokens, and greedy requests sample none; "
        "add --temperature above 0 or leave --top-k out\n")
