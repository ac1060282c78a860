"""The Triton kernels on a CPU, from the default test run: Triton's interpreter must be on
before Python imports triton, so the kernel tests run again in a child pytest with
TRITON_INTERPRET=1 (their "cpu" cases, fp32: the interpreter's bf16 is not the GPU's, and a
whole tiny stage's rows alone and among 8 to 64 rows through the Triton kernels). Each
kernel is compared there with its plain-torch or float64 reference, and checked for row
independence (the skinny matmul at every row tile). The interpreter runs each program in
Python (~5 ms a program), so the cases of hundreds of rows stay with the GPU: the chunk
attention's 100- and 512-row references (its 1-, 7- and 32-row ones run, across blocks and
partial blocks) and its row independence with 4-row blocks (the default blocks run). Skipped
where triton is not installed (the test extra installs it) or where a GPU runs the kernels
themselves. The kernel test files run in child processes at once, one group each (the
machine's cores are otherwise idle while this test waits), of about the same time: the
int8-activation kernels with their dense and MoE stages; the fused, skinny and invariance checks
with the tiny stage, the model families' Triton path, a packed MoE stage, a quantized stage and
the routed experts' kernels; the fused int8 gate/up, the attention and sampling kernels and the
quantized-weight kernels.
Off CUDA the quantized kernels take wider blocks (quant/blocks.program_width): the
interpreter's time goes with a call's programs. Each group must pass exactly its count of
cases (KERNEL_TESTS)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# groups of about the same time under the interpreter, each with the number of its cases that
# must pass there: a case that stops running (renamed out of CASES, skipped, deleted) fails this
# test, and one added must raise its group's count
KERNEL_TESTS = [(52, ["tests/kernels/test_quant_a8.py", "tests/kernels/test_quant_a8_gluon.py"]),
                (41, ["tests/kernels/test_fused_kernels.py", "tests/kernels/test_skinny.py",
                      "tests/stage_worker/test_gpu.py", "tests/kernels/test_batch_invariance.py",
                      "tests/model/test_families.py", "tests/stage_worker/test_moe_stage.py",
                      "tests/stage_worker/test_quant_stage.py",
                      "tests/kernels/test_moe_triton.py"]),
                (81, ["tests/kernels/test_quant_a8_fused.py",
                     "tests/kernels/test_attention_triton.py",
                     "tests/kernels/test_attention_chunk.py",
                     "tests/kernels/test_sampling_triton.py",
                     "tests/kernels/test_sampling_sorted_triton.py",
                     "tests/kernels/test_quant_kernels.py", "tests/kernels/test_arrive.py"])]
# the CPU cases, and a whole stage's rows alone and among others through the Triton kernels
# (the tiny shape; the larger ones take minutes here and run on CUDA)
CASES = ("(cpu or (test_stage_rows_are_invariant and tiny and not on_gpu)) "
         "and not 512 and not 100 and not bm4")


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA runs the Triton kernels themselves (the gpu-marked cases)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already under the interpreter: the kernel tests run in this session")
    children = [subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", CASES, *files],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for _, files in KERNEL_TESTS]
    try:
        # a group takes up to about 7 minutes beside the rest of the suite on two cores
        outs = [child.communicate(timeout=1500) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    for child, (stdout, stderr), (cases, files) in zip(children, outs, KERNEL_TESTS):
        assert child.returncode == 0, stdout[-4000:] + stderr[-2000:]
        found = re.search(r"(\d+) passed", stdout)
        assert found, stdout[-2000:]
        assert int(found.group(1)) == cases, (
            f"{found.group(1)} of the {cases} interpreter cases of {files} passed; "
            f"if cases were added, raise the group's count in KERNEL_TESTS", stdout[-2000:])
