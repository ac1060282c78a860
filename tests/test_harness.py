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


def test_exact_command_on_a_pipelined_batch(tiny_model, shared_stages):
    out = CliRunner().invoke(main, ["exact", "--model", str(tiny_model), "--layer-split", "2",
                                    "--ctx-size", "256", "--batch", "4", "--batch-groups", "2",
                                    "--requests", "6", "--tokens", "10"])
    assert out.exit_code == 0, (out.output, out.exception)
    assert len(shared_stages) == 1
    lines = out.stdout.splitlines()
    assert sum("same" in line for line in lines) == 12  # 6 requests, greedy and seeded
    assert lines[-1] == "all requests identical"


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
