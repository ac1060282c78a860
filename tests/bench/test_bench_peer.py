"""`strata-bench peer --engine llama.cpp`: llama-batched-bench's table read back, and the
command run against a stand-in llama-batched-bench (a script that prints what the real one
prints), so no llama.cpp build is needed here."""
from __future__ import annotations

import json
import stat
import sys

import pytest
from click.testing import CliRunner

from strata.bench import llamacpp
from strata.bench.cli import main
from strata.bench.sweep import load_peer

# llama-batched-bench's stdout for -npp 128 -ntg 128 -npl 1,8,16 (its format strings:
# tools/batched-bench/batched-bench.cpp); the load messages go to stderr
SAMPLE = """
main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
n_gpu_layers = 99, n_threads = 8, n_threads_batch = 8

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.021 |  6095.24 |    0.630 |   203.17 |    0.651 |   393.24 |
|   128 |    128 |    8 |   2048 |    0.102 | 10039.22 |    0.943 |  1085.89 |    1.045 |  1959.81 |
|   128 |    128 |   16 |   4096 |    0.190 | 10778.95 |    1.027 |  1994.16 |    1.217 |  3365.65 |

llama_perf_context_print:        load time =    1502.33 ms
"""


def test_parse_table_reads_every_row_by_its_header():
    rows = llamacpp.parse_table(SAMPLE)
    assert [r["clients"] for r in rows] == [1, 8, 16]
    assert rows[1] == {"prompt_tokens": 128, "tokens": 128, "clients": 8, "positions": 2048,
                       "prompt_seconds": 0.102, "prompt_tok_s": 10039.22,
                       "decode_seconds": 0.943, "decode_tok_s": 1085.89, "seconds": 1.045,
                       "prompt_and_generated_tok_s": 1959.81}
    # the rates are llama.cpp's: S_TG = B*TG / T_TG, S = N_KV / T (to the printed digits)
    for r in rows:
        assert r["decode_tok_s"] == pytest.approx(r["clients"] * 128 / r["decode_seconds"],
                                                  rel=2e-3)
        assert r["prompt_and_generated_tok_s"] == pytest.approx(r["positions"] / r["seconds"],
                                                                rel=2e-3)
    assert llamacpp.parse_table("no table here\n| a | b |\n") == []


def test_command_line():
    assert llamacpp.context_size(128, 128, [1, 64, 8]) == 64 * 256
    assert llamacpp.context_size(100, 10, [3]) == 512  # 330, rounded up to llama.cpp's 256
    assert llamacpp.llama_devices("cuda:0, cuda:1") == ["CUDA0", "CUDA1"]
    assert llamacpp.llama_devices("cpu") == []
    with pytest.raises(ValueError, match="give cpu or CUDA devices"):
        llamacpp.llama_devices("gpu0")


FAKE = """\
#!{python}
# stands in for llama-batched-bench: checks its arguments, prints its table
import sys
args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1]
open({log!r}, "a").write(" ".join(args) + "\\n")
if "refused" in opt("-m"):
    print("llama_model_loader: loaded meta data with 25 key-value pairs", file=sys.stderr)
    print("llama_model_load: error loading model: error loading model vocabulary: unknown "
          "pre-tokenizer type: 'gpt2'", file=sys.stderr)
    print("main: error: unable to load model", file=sys.stderr)
    sys.exit(1)
pp, tg, ctx = int(opt("-npp")), int(opt("-ntg")), int(opt("-c"))
print("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s "
      "|    S t/s |")
print("|-------|--------|------|--------|----------|----------|----------|----------|----------"
      "|----------|")
for b in map(int, opt("-npl").split(",")):
    if b * (pp + tg) > ctx:
        continue  # as llama-batched-bench does: a count that does not fit is left out
    t_pp, t_tg = 0.01 * b, 0.5 + 0.01 * b
    print("|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |" % (
        pp, tg, b, b * (pp + tg), t_pp, b * pp / t_pp, t_tg, b * tg / t_tg, t_pp + t_tg,
        b * (pp + tg) / (t_pp + t_tg)))
"""


@pytest.fixture
def fake_bin(tmp_path):
    """A folder holding a stand-in llama-batched-bench; its arguments go to args.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / llamacpp.BINARY
    script.write_text(FAKE.format(python=sys.executable, log=str(tmp_path / "args.log")))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def bench(*args: str):
    return CliRunner().invoke(main, list(args), prog_name="strata-bench")


def test_peer_llamacpp_prints_and_writes_each_client_count(tiny_model, fake_bin, tmp_path):
    out = bench("peer", "--engine", "llama.cpp", "--bin", str(fake_bin), "--model",
                str(tiny_model), "--devices", "cuda:0,cuda:1", "--prompt-tokens", "16",
                "--tokens", "8", "--clients", "1,8,64", "--json-out", str(tmp_path / "p.json"))
    assert out.exit_code == 0, (out.output, out.exception)
    args = (tmp_path / "args.log").read_text().split()
    opt = lambda name: args[args.index(name) + 1]  # noqa: E731
    assert (opt("-m"), opt("-ngl"), opt("-npp"), opt("-ntg"), opt("-npl")) == \
        (str(tiny_model), "99", "16", "8", "1,8,64")
    assert (opt("-dev"), opt("-sm")) == ("CUDA0,CUDA1", "layer")
    assert int(opt("-c")) >= 64 * (16 + 8)  # else llama.cpp would leave 64 clients out
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# llama.cpp llama-batched-bench, tiny.gguf, 16-token prompts")
    assert "torch" in lines[0]  # the machine line
    table = [line.split() for line in lines[3:]]
    assert [t[0] for t in table] == ["1", "8", "64"]
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["machine"] and report["conditions"]["prompt_tokens"] == 16
    assert report["conditions"]["tokens_per_client"] == 8
    for t, r in zip(table, report["results"]):
        b = r["clients"]
        assert (r["prompt_tokens"], r["tokens"]) == (16, 8)
        assert r["decode_tok_s"] == pytest.approx(b * 8 / (0.5 + 0.01 * b), rel=1e-3)
        assert float(t[2]) == pytest.approx(r["decode_tok_s"], abs=0.01)
        assert float(t[3]) == pytest.approx(r["prompt_and_generated_tok_s"], abs=0.01)
    # the file strata-bench sweep --peer-json reads, for a sweep counting the same tokens
    assert load_peer(str(tmp_path / "p.json"), 16, 8)["decode_tok_s"] == \
        {r["clients"]: r["decode_tok_s"] for r in report["results"]}


def test_peer_llamacpp_on_one_device_has_no_split(tiny_model, fake_bin, tmp_path):
    out = bench("peer", "--engine", "llama.cpp", "--bin", str(fake_bin), "--model",
                str(tiny_model), "--clients", "2", "--prompt-tokens", "4", "--tokens", "4")
    assert out.exit_code == 0, (out.output, out.exception)
    args = (tmp_path / "args.log").read_text().split()
    assert args[args.index("-dev") + 1] == "CUDA0" and "-sm" not in args


def test_peer_llamacpp_missing_binary_says_where_to_get_it(tiny_model, tmp_path):
    for extra in ([], ["--bin", str(tmp_path)]):
        out = bench("peer", "--engine", "llama.cpp", "--model", str(tiny_model), *extra)
        assert out.exit_code == 2, (out.output, out.exception)
        assert "llama-batched-bench" in out.stderr and "cmake" in out.stderr
        assert "github.com/ggml-org/llama.cpp" in out.stderr


def test_peer_llamacpp_shows_why_llamacpp_refused_the_model(tiny_model, fake_bin, tmp_path):
    refused = tmp_path / "refused.gguf"
    refused.write_bytes(tiny_model.read_bytes())
    out = bench("peer", "--engine", "llama.cpp", "--bin", str(fake_bin), "--model", str(refused))
    assert out.exit_code == 2, (out.output, out.exception)
    assert "llama-batched-bench failed (exit 1)" in out.stderr
    assert "unknown pre-tokenizer type: 'gpt2'" in out.stderr
    assert "loaded meta data" not in out.stderr  # the error lines, not the whole log


def test_peer_llamacpp_says_when_a_count_is_missing(tiny_model, fake_bin, tmp_path):
    """A row llama.cpp left out (here: the stand-in given too small a context) is an error,
    not a shorter table."""
    bin_dir = fake_bin
    script = bin_dir / llamacpp.BINARY
    script.write_text(script.read_text().replace('int(opt("-c"))', "100"))
    out = bench("peer", "--engine", "llama.cpp", "--bin", str(bin_dir), "--model",
                str(tiny_model), "--clients", "1,8", "--prompt-tokens", "16", "--tokens", "8")
    assert out.exit_code == 2, (out.output, out.exception)
    assert "printed no row for [8] client(s)" in out.stderr


def test_peer_refuses_options_of_the_other_engine(tiny_model):
    out = bench("peer", "--model", str(tiny_model), "--bin", "/tmp")
    assert out.exit_code == 2, (out.output, out.exception)
    assert "--bin is for --engine llama.cpp, not transformers" in out.stderr
    out = bench("peer", "--engine", "llama.cpp", "--model", str(tiny_model), "--batch", "4")
    assert out.exit_code == 2 and "--batch is for --engine transformers" in out.stderr
