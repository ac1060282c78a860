"""The SASS instructions a quantized decode kernel spends per weight, without a GPU: compile
one of the kernels for sm_90 with the Triton installed here (its bundled ptxas and nvdisasm),
find the main loop (the longest body that a branch jumps back to), and count its instructions
per weight a thread covers a step (BLOCK_N x BLOCK_K / threads; the GEMV's step is 256 quants).
Kernels: `float`, kernels/quant/float_triton.py's `_quant_mm_kernel` (16 to 64 rows); `a8-gemv`
and `a8-mma`, the int8-activation GEMV (1 to 8 rows) and MMA (16 to 64) of a8_gemv.py and
a8_triton.py, compiled as they launch (no FP fusion); `sb-mma`, tools/gpu/superblock.py's
prototype (Q4_K only, a super-block a step, 12-bit codes a scale per 256). Integer arguments
and pointers are taken as divisible by 16, as Triton specializes them at launch, so loads
vectorize as on the device.

Besides the count, the ALU issue slots a weight: an FP32 add, multiply or fma counts 1, an
integer or logic instruction 2 and a conversion 8 (sm_90 issues 128, 64 and 16 of them a clock
per SM). On an H200 the count tracks what `ncu --section InstructionStats` measures for the same
kernel (the Q4_K decode kernel at 64 x 128 blocks: 9.2 here, 9.4 measured with Triton 3.6); it
says how much arithmetic a change removes, not the time, which also depends on latency and
occupancy. Count with the device's Triton: versions compile the same kernel differently (a
chain of dp4a that Triton 3.9 made 256 instructions a step, Triton 3.6 made 735, and it ran 2-3x
slower on a 3.6 device). `pip install --no-deps --target DIR triton==3.6.0`, then
`PYTHONPATH=DIR python tools/sass_count.py ...`; time what it suggests with
tools/gpu/bench_a8.py or bench_quant.py.

    python tools/sass_count.py [--kernel float|a8-gemv|a8-mma] [--type Q4_K] [--rows 16]
        [--block-n 64] [--block-k 128] [--stages 2] [--dot batched] [--warps 4] [--sass-out F]
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import click
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from strata.kernels.quant.a8_gemv import _a8_gemv_kernel
from strata.kernels.quant.a8_parts import STEP
from strata.kernels.quant.a8_mma import DOTS, _a8_mm_kernel
from strata.kernels.quant.float_triton import _quant_mm_kernel
from strata.kernels.quant.reads import TYPE_IDS
from strata.kernels.quant.weight import BLOCKS

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")
_ADDR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")
_BRANCH = re.compile(r"BRA\s+`\(\.(L_x_\d+)\)")
_OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


FP32 = {"FADD", "FMUL", "FFMA", "FSEL", "FMNMX", "HADD2", "HMUL2", "HFMA2"}
INTEGER = {"IADD3", "VIADD", "IMAD", "LOP3", "SHF", "PRMT", "LEA", "ISETP", "SEL", "IMNMX",
           "SGXT", "IABS", "BMSK", "IDP", "PLOP3"}
CONVERSIONS = {"I2FP", "F2FP", "F2I", "I2F", "F2F"}


def compile_sass(fn, types: dict[str, str], constants: dict, warps: int,
                 plain: tuple[str, ...] = ("M",), options: dict | None = None) -> str:
    """The SASS of `fn` for sm_90: `types` gives each runtime argument's Triton type,
    `constants` the constexprs; arguments outside `plain` are taken as divisible by 16;
    `options`: more compile options (as a launch passes them)."""
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in types and name not in plain
             and (types[name].startswith("*") or types[name] == "i32")}
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, **(options or {})})
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


def issue_slots(ops: collections.Counter) -> int:
    """The ALU issue slots of an instruction mix (the module says the weights)."""
    return sum(n * (1 if op in FP32 else 2 if op in INTEGER else 8 if op in CONVERSIONS else 0)
               for op, n in ops.items())


def _kernel(kernel: str, qtype: str, rows: int, block_n: int, block_k: int, stages: int,
            dot: str, ahead: bool = False):
    """(jit function, argument types, constexprs, compile options, quants a step)."""
    weight = {"p0": "*i32", "p1": "*i32", "p3": "*fp16", "s0": "i32", "s1": "i32", "s2": "i32",
              "s3": "i32", "p2": ("*i8" if qtype == "Q6_K" else
                                  "*i32" if qtype.endswith("_K") else
                                  "*i16" if qtype == "IQ4_XS" else "*fp16")}
    shape = {"res_ptr": "*bf16", "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
             "stride_rm": "i32", "stride_om": "i32"}
    common = dict(QTYPE=TYPE_IDS[qtype], S=BLOCKS[qtype][2], HAS_RES=False, BLOCK_M=rows,
                  BLOCK_N=block_n)
    if kernel == "float":
        types = {**weight, **shape, "x_ptr": "*bf16", "g_ptr": "*bf16", "sq_ptr": "*fp32",
                 "KS": "i32", "eps": "fp32", "stride_xm": "i32"}
        return (_quant_mm_kernel, types, dict(common, NORM=False, SPLIT=True, BLOCK_K=block_k,
                                              STAGES=stages),
                {"enable_fp_fusion": True}, block_k)   # as it launches: Triton's default
    if kernel == "a8-gemv":
        types = {**weight, **shape, "qw_ptr": "*i32", "dx_ptr": "*fp32", "xrow_ptr": "*i32",
                 "wrow_ptr": "*i32", "L": "i32", "L4": "i32", "L8": "i32", "L32": "i32",
                 "cq_ptr": "*i8", "cqp_ptr": "*i8", "cdx_ptr": "*fp32", "cqs_ptr": "*i32",
                 "UP": "i32"}
        return (_a8_gemv_kernel, types, dict(common, ASM=True, PAIRS=False, STEP=STEP, PDL=False,
                                             STAGES=stages, P=1, ACT=-1, CODES=False),
                {"enable_fp_fusion": False}, STEP)
    if kernel == "sb-mma":   # tools/gpu/superblock.py's prototype (Q4_K, a super-block a step)
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
        from superblock import _sb_mm_kernel
        types = {**weight, "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "L": "i32",
                 "lo_ptr": "*i8", "hi_ptr": "*i8", "d_ptr": "*fp32"}
        return _sb_mm_kernel, types, dict(BLOCK_M=rows, BLOCK_N=block_n), {}, 256
    types = {**weight, **shape, "q_ptr": "*i8", "dx_ptr": "*fp32", "qs_ptr": "*i32"}
    return (_a8_mm_kernel, types, dict(common, STEP=block_k, DOT=DOTS.index(dot), P=1,
                                       AHEAD=ahead, PDL=False),
            {"enable_fp_fusion": False, "num_stages": stages}, block_k)


@click.command()
@click.option("--kernel", type=click.Choice(["float", "a8-gemv", "a8-mma", "sb-mma"]),
              default="float",
              show_default=True)
@click.option("--type", "qtype", type=click.Choice(sorted(TYPE_IDS)), default="Q4_K",
              show_default=True)
@click.option("--block-n", type=int, default=64, show_default=True)
@click.option("--block-k", type=int, default=128, show_default=True,
              help="Quants a step (the GEMV's is 256).")
@click.option("--stages", type=int, default=2, show_default=True)
@click.option("--rows", type=click.Choice(["1", "2", "4", "8", "16", "32", "64"]),
              default="16", show_default=True,
              help="The row tile (BLOCK_M): 1 to 8 for a8-gemv, 16 to 64 for the others.")
@click.option("--dot", type=click.Choice(list(DOTS)), default="batched", show_default=True,
              help="a8-mma's way to the groups' integer sums.")
@click.option("--ahead", is_flag=True, help="a8-mma: the scales a step ahead (a8_mm's ahead).")
@click.option("--warps", type=int, default=4, show_default=True)
@click.option("--sass-out", type=click.Path(dir_okay=False), default=None,
              help="Also write the whole SASS here.")
def cli(kernel, qtype, block_n, block_k, stages, rows, dot, ahead, warps, sass_out):
    """Count the SASS of a quantized decode kernel's main loop per weight."""
    rows = int(rows)
    if kernel == "sb-mma" and qtype != "Q4_K":
        raise click.UsageError("--kernel sb-mma is a Q4_K prototype: --type Q4_K")
    if kernel.startswith("a8-gemv") != (rows <= 8):
        raise click.UsageError(f"--rows {rows} is not a tile of --kernel {kernel}: a8-gemv "
                               f"takes 1, 2, 4 or 8 rows, the others 16, 32 or 64")
    fn, types, constants, options, step = _kernel(kernel, qtype, rows, block_n, block_k,
                                                  stages, dot, ahead)
    sass = compile_sass(fn, types, constants, warps, options=options,
                        plain=("M", "L") if kernel == "sb-mma" else ("M",))
    if sass_out:
        with open(sass_out, "w") as f:
            f.write(sass)
    body = main_loop(sass)
    ops = histogram(body)
    weights = block_n * step / (32 * warps)
    click.echo(f"{kernel} {qtype} blocks {block_n} x {step}, {rows}-row tile, {stages} stages, "
               f"{warps} warps, Triton {triton.__version__}: {len(body)} instructions a step, "
               f"{weights:.0f} weights a thread: {len(body) / weights:.2f} a weight, "
               f"{issue_slots(ops) / weights:.2f} ALU issue slots a weight")
    for op, n in ops.most_common(16):
        click.echo(f"  {op:10} {n:5}  {n / weights:5.2f}")


if __name__ == "__main__":
    cli()
