"""`strata-bench prompt` as a user runs it (in-process, on the session's launch of the tiny
model): both arms read the whole prompt, figures add up, and a context too small for the prompt
gets a sentence."""
from __future__ import annotations

import json

from click.testing import CliRunner

from strata.bench.cli import main
from strata.bench.promptbench import model_flops
from strata.model.gguf_file import ModelConfig


def bench(*args: str):
    return CliRunner().invoke(main, ["prompt", *args], prog_name="strata-bench")


def test_prompt_bench_serial_and_pipelined(tiny_model, shared_stages, tmp_path):
    out = bench("--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--ctx-size", "256", "--chunk-rows", "16", "--prompt-tokens", "100",
                "--repeats", "2", "--peak-tflops", "1", "--json-out", str(tmp_path / "p.json"))
    assert out.exit_code == 0, (out.output, out.exception)
    assert len(shared_stages) == 1
    report = json.loads((tmp_path / "p.json").read_text())
    rows = {r["arm"]: r for r in report["results"]}
    assert rows["serial"]["prompt_depth"] == 1 and rows["pipelined"]["prompt_depth"] == 3
    assert report["stages"] == 2 and report["chunk_rows"] == 16
    for r in rows.values():
        assert r["tok_s"] > 0 and abs(r["tok_s"] * r["seconds"] - 100) < 1e-6
    assert rows["serial"]["speedup_vs_serial"] == 1.0


def test_prompt_bench_needs_room_for_the_prompt(tiny_model):
    out = bench("--model", str(tiny_model), "--devices", "cpu", "--ctx-size", "64",
                "--prompt-tokens", "100")
    assert out.exit_code == 2, (out.output, out.exception)
    assert "--ctx-size 64 cannot hold a prompt of 100 tokens" in out.stderr


def test_flops_of_the_llama3_8b_shape():
    """2 x 8.03e9 parameters per token (untied head); the stages execute the layers for every
    row, attention over the causal keys, and the head for one row."""
    cfg = ModelConfig("llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                      head_dim=128, d_ffn=14336, vocab=128256, ctx_len=8192, rope_base=5e5,
                      rope_dim=128, rms_eps=1e-5, tied_head=False)
    nominal, executed = model_flops(cfg, 4096)
    assert abs(nominal / 4096 / 1e9 - 16.06) < 0.01
    layers = 2 * 32 * 218_103_808 * 4096
    attention = 4 * 4096 * 32 * (4096 * 4097 / 2)
    assert executed == layers + attention + 2 * 128256 * 4096
