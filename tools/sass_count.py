"""The SASS instructions a quantized decode kernel spends per weight, without a GPU: compile
kernels/quant/float_triton.py's `_quant_mm_kernel` for sm_90 with the Triton installed here (its
bundled ptxas and nvdisasm), find the main loop (the longest body that a branch jumps back
to), and count its instructions per weight a thread dequantizes (BLOCK_N x BLOCK_K / threads
per step). Integer arguments and pointers are taken as divisible by 16, as Triton specializes
them at launch, so loads vectorize as they do on the device.

On an H200 this count tracks what `ncu --section InstructionStats` measures for the same
kernel (the Q4_K decode kernel at 64 x 128 blocks: 9.2 here, 9.4 measured with Triton 3.6);
it says how much arithmetic a change removes, not the time, which also depends on latency
and occupancy (`ncu --section WarpStateStats`).

    python tools/sass_count.py [--type Q4_K] [--block-n 64] [--block-k 128] [--stages 2]
        [--rows 16] [--warps 4] [--sass-out FILE]
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import click
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from strata.kernels.quant.float_triton import TYPE_IDS, _quant_mm_kernel
from strata.kernels.quant.weight import BLOCKS

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")
_ADDR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")
_BRANCH = re.compile(r"BRA\s+`\(\.(L_x_\d+)\)")
_OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def compile_sass(fn, types: dict[str, str], constants: dict, warps: int,
                 plain: tuple[str, ...] = ("M",)) -> str:
    """The SASS of `fn` for sm_90: `types` gives each runtime argument's Triton type,
    `constants` the constexprs; arguments outside `plain` are taken as divisible by 16."""
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in types and name not in plain
             and (types[name].startswith("*") or types[name] == "i32")}
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest loop: from a label to the branch that jumps back."""
    labels, pending, code = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"\.(L_x_\d+):", line.strip())
        if label:
            pending.append(label.group(1))
            continue
        addr = _ADDR.match(line)
        if addr:
            at = int(addr.group(1), 16)
            labels.update({name: at for name in pending})
            pending = []
            code.append((at, line))
    best: list[str] = []
    for at, line in code:
        branch = _BRANCH.search(line)
        if branch and labels.get(branch.group(1), at + 1) < at:
            body = [text for a, text in code if labels[branch.group(1)] <= a <= at]
            best = max(best, body, key=len)
    return best


def histogram(body: list[str]) -> collections.Counter:
    return collections.Counter(m.group(1) for m in map(_OPCODE.search, body) if m)


@click.command()
@click.option("--type", "qtype", type=click.Choice(sorted(TYPE_IDS)), default="Q4_K",
              show_default=True)
@click.option("--block-n", type=int, default=64, show_default=True)
@click.option("--block-k", type=int, default=128, show_default=True)
@click.option("--stages", type=int, default=2, show_default=True)
@click.option("--rows", type=click.Choice(["16", "32", "64"]), default="16", show_default=True,
              help="The row tile (BLOCK_M).")
@click.option("--warps", type=int, default=4, show_default=True)
@click.option("--sass-out", type=click.Path(dir_okay=False), default=None,
              help="Also write the whole SASS here.")
def cli(qtype, block_n, block_k, stages, rows, warps, sass_out):
    """Count the SASS of the quantized decode kernel's main loop per weight."""
    types = {"x_ptr": "*bf16", "g_ptr": "*bf16", "p0": "*i32", "p1": "*i32",
             "p2": "*i32" if qtype.endswith("_K") and qtype != "Q6_K" else "*fp16",
             "p3": "*fp16", "s0": "i32", "s1": "i32", "s2": "i32", "s3": "i32",
             "res_ptr": "*bf16", "out_ptr": "*fp32", "sq_ptr": "*fp32", "M": "i32", "N": "i32",
             "K": "i32", "KS": "i32", "eps": "fp32", "stride_xm": "i32", "stride_rm": "i32",
             "stride_om": "i32"}
    if qtype == "Q6_K":
        types["p2"] = "*i8"
    constants = dict(QTYPE=TYPE_IDS[qtype], S=BLOCKS[qtype][2], NORM=False, HAS_RES=False,
                     SPLIT=True, BLOCK_M=int(rows), BLOCK_N=block_n, BLOCK_K=block_k,
                     STAGES=stages)
    sass = compile_sass(_quant_mm_kernel, types, constants, warps)
    if sass_out:
        with open(sass_out, "w") as f:
            f.write(sass)
    body = main_loop(sass)
    weights = block_n * block_k / (32 * warps)
    click.echo(f"{qtype} blocks {block_n} x {block_k}, {rows}-row tile, {stages} stages, "
               f"{warps} warps, Triton {triton.__version__}: {len(body)} instructions a step, "
               f"{weights:.0f} weights a thread: {len(body) / weights:.2f} a weight")
    for op, n in histogram(body).most_common(16):
        click.echo(f"  {op:10} {n:5}  {n / weights:5.2f}")


if __name__ == "__main__":
    cli()
