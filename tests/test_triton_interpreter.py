"""The Triton kernels on a CPU, from the default test run: Triton's interpreter must be on
before Python imports triton, so the kernel tests run again in a child pytest with
TRITON_INTERPRET=1 (their "cpu" cases, fp32: the interpreter's bf16 is not the GPU's). Each
kernel is compared there with its plain-torch or float64 reference, and checked for row
independence (the skinny matmul at every row tile). The interpreter runs each program in
Python (~5 ms a program), so the cases of hundreds of rows stay with the GPU: the chunk
attention's 100- and 512-row references (its 1-, 7- and 32-row ones run, across blocks and
partial blocks) and its row independence with 4-row blocks (the default blocks run). Skipped
where triton is not installed (the test extra installs it) or where a GPU runs the kernels
themselves. The kernel test files run in child processes at once, one group each (the
machine's cores are otherwise idle while this test waits), of about a minute each on one
core: the attention, sampling and routed experts' kernels (~35 s of these); the fused,
skinny and invariance checks with the model families' Triton path (~25 s) and a packed MoE
stage (~18 s); the quantized-weight kernels (~17 s) with a quantized stage (~25 s)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# groups of about the same time under the interpreter
KERNEL_TESTS = [["tests/test_attention_triton.py", "tests/test_attention_chunk.py",
                 "tests/test_sampling_triton.py", "tests/test_sampling_sorted_triton.py",
                 "tests/test_moe_triton.py"],
                ["tests/test_fused_kernels.py", "tests/test_skinny.py", "tests/test_gpu.py",
                 "tests/test_batch_invariance.py", "tests/test_families.py",
                 "tests/test_moe_stage.py"],
                ["tests/test_quant_kernels.py", "tests/test_quant_stage.py"]]
CASES = "cpu and not 512 and not 100 and not bm4"


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
        stderr=subprocess.PIPE, text=True) for files in KERNEL_TESTS]
    try:
        outs = [child.communicate(timeout=900) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    passed = 0
    for child, (stdout, stderr) in zip(children, outs):
        assert child.returncode == 0, stdout[-4000:] + stderr[-2000:]
        found = re.search(r"(\d+) passed", stdout)
        assert found, stdout[-2000:]
        passed += int(found.group(1))
    # every kernel's cases ran (none skipped for an interpreter that cannot run them)
    assert passed >= 30, [stdout[-1000:] for stdout, _ in outs]
