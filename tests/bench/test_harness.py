"""`strata-bench exact` as a user runs it (in-process, on the session's launch of the tiny
model), and the comparison it rests on; `strata-bench peer` through the console script."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from click.testing import CliRunner

from strata.bench.cli import main
from strata.bench.harness import first_mismatch, prompt_set

BENCH = (shutil.which("strata-bench", path=os.path.dirname(sys.executable))
         or shutil.which("strata-bench"))


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2, 3], [1, 2]) == 2       # one stopped early: a mismatch too
    assert first_mismatch([], [4]) == 0


def test_prompt_set_is_distinct():
    prompts = prompt_set(40)
    assert len(prompts) == 40 and len(set(prompts)) == 40


def exact(*args):
    return CliRunner().invoke(main, ["exact", "--model", args[0], "--layer-split", "2",
                                     "--ctx-size", "256", *args[1:]])


def test_exact_command_on_a_pipelined_batch(tiny_model, shared_stages):
    out = exact(str(tiny_model), "--batch", "12", "--batch-groups", "2", "--requests", "12",
                "--tokens", "10")
    assert out.exit_code == 0, (out.output, out.exception)
    assert len(shared_stages) == 1
    lines = out.stdout.splitlines()
    # 12 requests, greedy and seeded, each the same alone, together and staggered
    assert sum("same" in line and "together, staggered" in line for line in lines) == 24
    assert lines[-1] == "all requests identical (240 tokens compared)"
    # two groups of 6 slots: 8-row windows, as alone; the harness says no size was varied
    assert "# greedy alone: decode windows of 8 rows x" in out.stdout
    assert "no row was compared across window sizes" in out.stdout


def test_exact_command_compares_window_sizes(tiny_model, shared_stages):
    """12 requests (the harness's 13th prompt is too long for 256 positions in bytes) in 12
    slots: the together arm runs 16-row windows and the staggered arm's windows grow from 8 to
    16 rows while its first requests decode."""
    out = exact(str(tiny_model), "--requests", "12", "--batch", "12", "--tokens", "8",
                "--sampling", "greedy")
    assert out.exit_code == 0, (out.output, out.exception)
    assert len(shared_stages) == 1
    sizes = {line.split(":")[0]: line for line in out.stdout.splitlines()
             if "decode windows of" in line}
    assert "16 rows x" in sizes["# greedy together"]
    assert "8 rows x" in sizes["# greedy staggered"] and "16 rows x" in sizes["# greedy staggered"]
    assert "no row was compared across window sizes" not in out.stdout
    assert out.stdout.splitlines()[-1] == "all requests identical (96 tokens compared)"


def test_exact_command_exits_1_on_a_perturbed_window(tiny_model, shared_stages, monkeypatch):
    """A stage that computes a row of a 16-row window differently (here: its input token
    changed on the way) makes the together and staggered arms differ from alone: exit 1."""
    from strata.bench import exactness

    class Perturbing(exactness.CountingPipe):
        def submit(self, w):
            if len(w.slots) == 16 and not w.chunk:
                row = next(i for i, s in enumerate(w.slots) if s >= 0)
                w.tokens[row] = (w.tokens[row] + 1) % 200
            super().submit(w)

    monkeypatch.setattr(exactness, "CountingPipe", Perturbing)
    out = exact(str(tiny_model), "--requests", "12", "--batch", "12", "--tokens", "8",
                "--sampling", "greedy")
    assert out.exit_code == 1, (out.output, out.exception)
    assert "MISMATCH together at token" in out.stdout
    assert "FAILED: greedy request" in out.stdout and "differs" in out.stdout
    assert "identical" not in out.stdout


def test_exact_command_refuses_to_pass_on_nothing(tiny_model, shared_stages):
    out = exact(str(tiny_model), "--requests", "0")
    assert out.exit_code == 1, (out.output, out.exception)
    assert "FAILED: no request was compared" in out.stdout


def test_failed_and_short_runs_fail():
    """A request that fails the same way in both arms is not 'the same'; too few tokens are
    not a pass."""
    from types import SimpleNamespace

    from strata.bench import exactness

    def req(tokens, reason, error=None):
        return SimpleNamespace(seq=SimpleNamespace(generated=tokens, finish_reason=reason),
                               error=error)

    alone = exactness.Arm("alone", [req([], "error", "stage 1 failed"), req([5, 6], "length")])
    other = exactness.Arm("together", [req([], "error", "stage 1 failed"), req([5, 6], "length")])
    v = exactness.compare("greedy", alone, [other])
    assert v.failures == ["greedy request 0 failed in the alone arm: stage 1 failed",
                          "greedy request 0 failed in the together arm: stage 1 failed"]
    assert v.compared == 2
    assert "only 2 of 2 x 4 tokens" in exactness.enough(2, 2, 4, stopped=0)
    assert exactness.enough(4, 2, 4, stopped=0) is None
    assert "no request" in exactness.enough(0, 0, 4, stopped=0)


def test_exact_command_refuses_bad_groups(tiny_model):
    out = CliRunner().invoke(main, ["exact", "--model", str(tiny_model), "--batch", "4",
                                    "--batch-groups", "3"])
    assert out.exit_code == 2, (out.output, out.exception)
    assert "--batch-groups 3 does not divide --batch 4" in out.stderr


def test_peer_arm_prints_its_rate(tiny_model):
    """The tiny model: transformers loads any llama GGUF, and this checks the command, not
    SmolLM2's speed."""
    out = subprocess.run([BENCH, "peer", "--model", str(tiny_model), "--device", "cpu",
                          "--batch", "2", "--tokens", "2"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    batch, tokens, rate, ms = out.stdout.splitlines()[-1].split()
    assert (batch, tokens) == ("2", "2") and float(rate) > 0 and float(ms) > 0


def test_exact_command_compares_1_row_windows_with_16_row_ones(tiny_model, shared_stages):
    """--min-window-rows 1: alone, each request decodes in 1-row windows."""
    out = exact(str(tiny_model), "--requests", "12", "--batch", "12", "--tokens", "6",
                "--sampling", "greedy", "--min-window-rows", "1")
    assert out.exit_code == 0, (out.output, out.exception)
    assert "# greedy alone: decode windows of 1 rows x" in out.stdout
    assert "16 rows x" in out.stdout and "no row was compared" not in out.stdout
    assert out.stdout.splitlines()[-1].startswith("all requests identical")


def test_a_header_says_what_cuda_stages_multiply():
    """--weights and --activations as a launch resolved them, where a stage is on CUDA; on CPU
    stages (fp32) nothing."""
    from types import SimpleNamespace

    from strata.bench.harness import arithmetic
    stage = SimpleNamespace
    cuda = SimpleNamespace(plan=[stage(device="cpu"), stage(device="cuda:0")],
                           weights="quantized", activations="int8")
    assert arithmetic(cuda) == ", weights quantized, int8 activations"
    assert arithmetic(SimpleNamespace(plan=[stage(device="cpu")], weights="quantized",
                                      activations="float")) == ""
