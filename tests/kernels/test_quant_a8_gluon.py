"""The int8-activation Gluon MMA (kernels/quant/a8_gluon.py, a8_mm's dot "gluon"): a row's bits
the same as from the Triton MMA and from the dp4a GEMV alone, Q4_K and Q6_K, with and without a
residual, in whole and ragged row blocks, and a stage's rows with STRATA_A8_DOT=gluon. Gluon
runs on CUDA only (not under Triton's interpreter): those tests are marked gpu. The rows' dc
plane (a Triton kernel) is checked under the interpreter too."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import triton_devices
from test_quant_kernels import _weight
from test_quant_stage import mixed  # noqa: F401 (a fixture)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _x(rows: int, k: int, seed: int, device: str = "cuda") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, 5] *= 30.0                      # an outlier column, as real activations have
    return x.to(device, torch.float32 if device == "cpu" else torch.bfloat16)


@pytest.mark.parametrize("device", triton_devices())
def test_the_dc_plane_is_the_rows_scales_and_sums(device):
    """The row quantizer's dc plane: each group of 32's dx, its codes' sum times dx, then each
    16's, the products rounded once as the Triton kernels round them, for row slices too."""
    from strata.kernels.quant.a8_triton import quantize_rows
    c = quantize_rows(_x(6, 512, seed=3, device=device))[1:5]
    dx, qs = c.dx.cpu(), c.qs.cpu()
    want = [dx, (qs[:, 0::2] + qs[:, 1::2]).float() * dx, qs[:, 0::2].float() * dx,
            qs[:, 1::2].float() * dx]
    assert torch.equal(c.dc.cpu(), torch.stack(want, -1))
    assert (c.dc[:, :, 1:].abs().amax((0, 1)) > 0).all()


@pytest.mark.parametrize("env", [None, "gluon", "ring", "triton", "groups"])
def test_which_windows_take_the_gluon_kernels(monkeypatch, env):
    """a8_mm's choice where no way is asked: on CUDA, Q4_K's 4- and 8-row tiles by the
    registers' kernels and its 16- to 64-row tiles by the ring's, Q6_K's 16- to 64-row tiles,
    IQ4_XS's 8- to 64-row ones, Q5_K's 8-, 16- and 64-row ones and Q8_0's 16- and 64-row ones
    by the ring's (where each was faster); with STRATA_A8_DOT=gluon or ring
    that way at every tile from 4 rows (ring: Q8_0, IQ4_XS and Q5_K too); with triton or a Triton
    way none; never off CUDA, on a GPU before sm_80, for other types, or where a part of K is
    not whole super-blocks."""
    import types

    from strata.kernels.quant import a8_triton
    from strata.kernels.quant.a8_triton import _gluon
    from strata.kernels.quant.blocks import Part
    monkeypatch.setattr(a8_triton, "_sm80", lambda index: True)   # an sm_80 or later GPU
    if env is None:
        monkeypatch.delenv("STRATA_A8_DOT", raising=False)
    else:
        monkeypatch.setenv("STRATA_A8_DOT", env)
    cuda = types.SimpleNamespace(device=torch.device("cuda"), shape=(64, 4096))
    cpu = types.SimpleNamespace(device=torch.device("cpu"), shape=(64, 4096))
    tiles = (1, 2, 4, 8, 16, 32, 64)
    every = {t: env for t in (4, 8, 16, 32, 64)}
    want = {None: {"Q4_K": {4: "gluon", 8: "gluon", 16: "ring", 32: "ring", 64: "ring"},
                   "Q6_K": {16: "ring", 32: "ring", 64: "ring"},
                   "IQ4_XS": {8: "ring", 16: "ring", 32: "ring", 64: "ring"},
                   "Q5_K": {8: "ring", 16: "ring", 64: "ring"},
                   "Q8_0": {16: "ring", 64: "ring"}},
            "gluon": {"Q4_K": every, "Q6_K": every},
            "ring": {"Q4_K": every, "Q6_K": every, "Q8_0": every, "IQ4_XS": every,
                     "Q5_K": every}}.get(env, {})
    for qtype in ("Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "Q5_K", "Q4_0"):
        part = Part(qtype, 4096, 4096, {})
        got = {t: _gluon(cuda, part, t) for t in tiles if _gluon(cuda, part, t)}
        assert got == want.get(qtype, {}), (qtype, env)
        assert not any(_gluon(cpu, part, t) for t in tiles)
    monkeypatch.setattr(a8_triton, "_sm80", lambda index: False)  # older GPUs: none
    assert not any(_gluon(cuda, Part(q, 4096, 4096, {}), t) for q in ("Q4_K", "Q6_K")
                   for t in tiles)
    # K of 4160 (one part, k_parts) is 16.25 super-blocks: not for Gluon
    assert not _gluon(types.SimpleNamespace(device=torch.device("cuda"), shape=(16, 4160)),
                      Part("Q4_K", 64, 4160, {}), 16)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n,k", [(128, 1024), (64, 2048)])
@pytest.mark.gpu
@needs_cuda
def test_gluon_rows_have_the_triton_kernels_bits(qtype, n, k):
    """Rows in tiles of 8, 16, 32 and 64 (3, 20 and 40 rows: ragged blocks), against the
    Triton kernels at their defaults (the GEMV up to 8 rows, the MMA from 16) and each row
    alone through the GEMV, with a residual and without."""
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    w, _ = _weight(qtype, n, k, "cuda", seed=11)
    part = w.parts[0]
    x, res = _x(64, k, seed=12), _x(64, n, seed=13)
    c = quantize_rows(x)
    alone = torch.cat([a8_mm(c[i:i + 1], part, res[i:i + 1]) for i in range(64)])
    for rows in (3, 8, 16, 20, 32, 40, 64):
        for r in (res[:rows], None):
            got = a8_mm(c[:rows], part, r, dot="gluon")
            assert torch.equal(got, a8_mm(c[:rows], part, r)), f"{qtype}: {rows} rows, Triton"
            if r is not None:
                assert torch.equal(got, alone[:rows]), f"{qtype}: {rows} rows, alone"
    assert alone.abs().max() > 0


@pytest.mark.gpu
@needs_cuda
def test_loading_a_step_ahead_or_capping_registers_keeps_the_bits():
    """gluon_mm(ahead=True) and gluon_mm(maxnreg=128), Q4_K, four super-blocks in K's one part
    and in each of two: the rows' bits without them, for whole and ragged row blocks."""
    from strata.kernels.quant.a8_gluon import gluon_mm
    from strata.kernels.quant.a8_triton import quantize_rows
    for k, parts in ((1024, 1), (2048, 2)):
        w, _ = _weight("Q4_K", 128, k, "cuda", seed=14)
        c, res = quantize_rows(_x(20, k, seed=15)), _x(20, 128, seed=16)
        for rows, block_m in ((8, 8), (16, 16), (20, 16)):
            kw = dict(block_m=block_m, parts=parts)
            want = gluon_mm(c[:rows], w.parts[0], res[:rows], **kw)
            for variant in ({"ahead": True}, {"maxnreg": 128}):
                got = gluon_mm(c[:rows], w.parts[0], res[:rows], **variant, **kw)
                assert torch.equal(got, want), f"{variant}: K {k} in {parts} parts, {rows} rows"
            assert want.abs().max() > 0


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "Q5_K"])
@pytest.mark.gpu
@needs_cuda
def test_the_shared_memory_ring_keeps_the_bits(qtype):
    """a8_ring.ring_mm, 2, 3 and 4 stages: the rows' bits from the Triton kernels (the GEMV to
    8 rows, the MMA's "groups" way from 16), K of four super-blocks in one part and in two
    (parts shorter than the ring), weight rows and window rows in whole and ragged blocks,
    with a residual and without."""
    from strata.kernels.quant.a8_ring import ring_mm, ring_stages
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    for n, k, parts in ((128, 1024, 1), (96, 2048, 2)):
        w, _ = _weight(qtype, n, k, "cuda", seed=17)
        c, res = quantize_rows(_x(64, k, seed=18)), _x(64, n, seed=19)
        for rows, block_m in ((3, 8), (8, 8), (16, 16), (20, 16), (40, 32), (64, 64)):
            for r in (None, res[:rows]):
                want = a8_mm(c[:rows], w.parts[0], r, dot="groups", parts=parts)
                assert want.abs().max() > 0
                for stages in (2, 3, 4):   # those that fit this GPU's shared memory
                    if not ring_stages(w.parts[0], 64, block_m, c.q.device, stages)[0]:
                        continue
                    got = ring_mm(c[:rows], w.parts[0], r, stages=stages, block_m=block_m,
                                  parts=parts)
                    assert torch.equal(got, want), (
                        f"{stages} stages: [{n}, {k}] in {parts} parts, {rows} rows")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.gpu
@needs_cuda
def test_warps_along_the_window_keep_the_bits(qtype):
    """ring_mm(warps_m=2 or 4): 4 warps with 2 or 4 of them along the window's rows (32 and 16
    weight rows a program), the rows' bits from the Triton MMA's, whole and ragged."""
    from strata.kernels.quant.a8_ring import ring_mm
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    w, _ = _weight(qtype, 96, 1024, "cuda", seed=22)
    c, res = quantize_rows(_x(64, 1024, seed=23)), _x(64, 96, seed=24)
    for rows, block_m in ((20, 16), (40, 32), (64, 64)):
        want = a8_mm(c[:rows], w.parts[0], res[:rows], dot="groups")
        for block_n, warps_m in ((32, 2), (16, 4)):
            if block_m < 8 * warps_m:
                continue
            got = ring_mm(c[:rows], w.parts[0], res[:rows], block_m=block_m, block_n=block_n,
                          warps_m=warps_m)
            assert torch.equal(got, want), f"{block_n} x {block_m}, {warps_m} warps along m"


def test_the_ring_refuses_what_it_does_not_take():
    """a8_ring.ring_mm takes RING_TYPES' types in whole super-blocks a part, with 2
    stages or more that fit shared memory: a sentence saying so for the rest, before any
    launch (on the CPU too)."""
    from strata.kernels.quant.a8 import Codes
    from strata.kernels.quant.a8_ring import ring_mm
    c = Codes.empty(4, 256, torch.device("cpu"))          # never read: refused first
    for qtype, kw, match in (("Q4_K", dict(stages=1), "1 stages .it takes 2 or more"),
                             ("Q6_K", dict(stages=6, block_m=64), "over the device's 232448: take"),
                             ("Q4_K", dict(block_m=16, warps_m=4), "do not tile 64 x 16"),
                             ("Q4_0", dict(stages=3), "not Q4_K or Q6_K or Q8_0 or IQ4")):
        w, _ = _weight(qtype, 64, 256, "cpu", seed=21)
        with pytest.raises(ValueError, match=f"ring MMA.*{match}"):
            ring_mm(c, w.parts[0], **kw)


def test_the_ring_caps_registers_where_its_table_says(monkeypatch):
    """ring_mm hands ptxas a8_ring.REGISTERS' cap for the weight's type and row tile (Q4_K's
    64-row tiles), none elsewhere, and an asked cap as asked (on the CPU: plan stopped)."""
    from strata.kernels.quant import a8_ring
    from strata.kernels.quant.a8 import Codes
    seen = []

    def plan(*args):
        seen.append(args[8])
        raise RuntimeError("planned")

    monkeypatch.setattr(a8_ring, "plan", plan)
    c = Codes.empty(4, 256, torch.device("cpu"))
    for qtype, kw in (("Q4_K", dict(block_m=64)), ("Q4_K", dict(block_m=32)),
                      ("Q6_K", dict(block_m=64)), ("Q4_K", dict(block_m=64, maxnreg=200))):
        w, _ = _weight(qtype, 64, 256, "cpu", seed=21)
        with pytest.raises(RuntimeError, match="planned"):
            a8_ring.ring_mm(c, w.parts[0], **kw)
    assert seen == [a8_ring.REGISTERS[("Q4_K", 64)], None, None, 200]


@pytest.mark.parametrize("way", ["gluon", "ring"])
@pytest.mark.gpu
@needs_cuda
def test_a_stage_with_the_gluon_kernels_keeps_its_rows_bits(mixed, monkeypatch, way):
    """A Q4_K_M stage (Q4_K and Q6_K matrices) with int8 activations and STRATA_A8_DOT=gluon
    or ring: the target rows alone and among 8 to 64 rows give the same bits."""
    from strata.stage_worker.model import StageModel
    from test_quant_stage import CTX, SHAPE, _mode, _policy, assert_stage_rows_invariant
    monkeypatch.setenv("STRATA_A8_DOT", way)
    policy = dataclasses.replace(_policy("cuda"), int8_activations=True)
    model = StageModel(mixed, 0, SHAPE.n_layers, ctx=CTX, device="cuda",
                       weights=_mode("cuda"), policy=policy)
    assert_stage_rows_invariant(model, "cuda")


def _run_ptx(asm: str, arg, outs: int = 1):
    """The 32-bit PTX of a code lookup (a8_ring_iq4._codebook_asm, a8_gemv._codebook_asm,
    a8_codes._high_asm) run on one word or a tuple of them, its inputs after its outs outputs
    (its instructions only: and, or, not, shr, shl, add, mov, mul.lo and prmt's default mode,
    bytes {b, a} picked by 4-bit selectors whose top bit replicates the byte's sign); the
    output, or a list of outs."""
    args = arg if isinstance(arg, tuple) else (arg,)
    regs, mask = {f"${outs + i}": x for i, x in enumerate(args)}, 0xFFFFFFFF

    def val(x):
        return regs[x] if x in regs else int(x, 0)

    for ins in asm.strip("{} ").split(";"):
        op, *args = ins.replace(",", " ").split() or [".reg"]
        if op == ".reg":
            continue
        d, *src = args
        a = [val(x) for x in src]
        if op == "prmt.b32":
            pool = [(w >> (8 * k)) & 0xFF for w in a[:2] for k in range(4)]
            r = 0
            for k in range(4):
                sel = (a[2] >> (4 * k)) & 0xF
                byte = pool[sel & 7]
                r |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * k)
        else:
            r = {"and.b32": lambda: a[0] & a[1], "or.b32": lambda: a[0] | a[1],
                 "not.b32": lambda: ~a[0], "shr.b32": lambda: a[0] >> a[1],
                 "mov.b32": lambda: a[0], "mul.lo.u32": lambda: a[0] * a[1],
                 "shl.b32": lambda: a[0] << a[1], "add.u32": lambda: a[0] + a[1]}[op]()
        regs[d] = r & mask
    return regs["$0"] if outs == 1 else [regs[f"${i}"] for i in range(outs)]


def test_the_codebook_asm_gives_the_iq4_values():
    """The IQ4_XS ring's prmt lookup (a8_ring_iq4._codebook_asm), run instruction by instruction on
    words of random nibbles: each byte's low or high nibble becomes its codebook value (the
    signed code, blocks.IQ4_VALUES) in that byte."""
    import random

    from strata.kernels.quant.a8_ring_iq4 import _codebook_asm
    from strata.kernels.quant.blocks import IQ4_VALUES
    rng = random.Random(5)
    for hi in (0, 1):
        asm = _codebook_asm(hi)
        for word in [0, 0xFFFFFFFF, 0x87654321] + [rng.getrandbits(32) for _ in range(500)]:
            got = _run_ptx(asm, word)
            want = [IQ4_VALUES[(word >> (8 * k + 4 * hi)) & 15] & 0xFF for k in range(4)]
            assert [(got >> (8 * k)) & 0xFF for k in range(4)] == want, (hi, hex(word))


def test_the_gemv_codebook_asm_gives_the_iq4_values_in_pairs():
    """The IQ4 GEMV's prmt lookup (a8_gemv._codebook_asm), run instruction by instruction on
    words of eight random codes (code j in bits 4j): its two words are the codebook values +
    128 of codes 0, 2, 4, 6 and of 1, 3, 5, 7, a byte each, as the table words give them."""
    import random

    from strata.kernels.quant.a8_gemv import _codebook_asm
    from strata.kernels.quant.blocks import IQ4_VALUES
    rng = random.Random(7)
    asm = _codebook_asm()
    words = [0, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98, 0x8F7E6D5C]
    for word in words + [rng.getrandbits(32) for _ in range(1000)]:
        even, odd = _run_ptx(asm, word, outs=2)
        for got, first in ((even, 0), (odd, 1)):
            want = [IQ4_VALUES[(word >> (4 * (2 * k + first))) & 15] + 128 for k in range(4)]
            assert [(got >> (8 * k)) & 0xFF for k in range(4)] == want, (first, hex(word))


@pytest.mark.parametrize("qtype,bits,group", [("Q5_K", 1, 32), ("Q6_K", 2, 16)])
def test_the_high_bits_asm_reads_the_planes_as_packed(qtype, bits, group):
    """a8_codes._high_asm (the ring's Q5_K and Q6_K codes), run instruction by instruction on
    planes packed as weight.py packs them from random codes: a group's qs word a with its qh
    word and shift bits * a gives codes 8a, 8a + 2, .. (low nibbles) and 8a + 1, 8a + 3, ..
    (high nibbles), a byte each."""
    from strata.kernels.quant.a8_codes import _high_asm
    from strata.kernels.quant.weight import _bits_to_words, _high_words
    mask = (1 << bits) - 1
    g = torch.Generator().manual_seed(11)
    u = torch.randint(0, 16 << bits, (1, 256), generator=g)
    qs = (_bits_to_words(u & 15, 4) & 0xFFFFFFFF).tolist()[0]
    qh = (_high_words(u >> 4, bits, group) & 0xFFFFFFFF).tolist()[0]
    lo_asm, hi_asm = _high_asm(mask * 0x01010101, 0), _high_asm(mask * 0x01010101, 1)
    for c in range(256 // 8):                       # qs word c: group c // (group / 8), word a
        a = c % (group // 8)
        for asm, odd in ((lo_asm, 0), (hi_asm, 1)):
            got = _run_ptx(asm, (qs[c], qh[c // (group // 8)], bits * a))
            want = [int(u[0, 8 * c + 2 * k + odd]) for k in range(4)]
            assert [(got >> (8 * k)) & 0xFF for k in range(4)] == want, (qtype, c, odd)


def test_the_ring_takes_the_stages_a_gpu_has_room_for(monkeypatch):
    """a8_ring.ring_stages: the type's default stages made fewer until two programs fit the
    device's shared memory (227 KB: Q6_K's 3 stay at 32 rows, become 2 at 64), else until one
    does (99 KB: Q6_K's 2 at 16 rows, two programs, and at 64, one), none where not even 2 fit;
    asked stages are kept or refused, never made fewer."""
    from strata.kernels.quant import a8_ring
    from strata.kernels.quant.blocks import Part
    cuda = torch.device("cuda", 0)
    q4k, q6k = Part("Q4_K", 4096, 4096, {}), Part("Q6_K", 4096, 4096, {})
    monkeypatch.setattr(a8_ring, "_shared_limit", lambda index: 227 * 1024)
    assert a8_ring.ring_stages(q6k, 64, 64, cuda)[0] == 2
    assert a8_ring.ring_stages(q6k, 64, 32, cuda)[0] == 3
    assert a8_ring.ring_stages(q6k, 64, 64, cuda, 3)[0] == 3
    assert a8_ring.ring_stages(q4k, 64, 64, cuda)[0] == 2
    assert a8_ring.ring_stages(q4k, 64, 64, cuda, 4)[0] == 4
    monkeypatch.setattr(a8_ring, "_shared_limit", lambda index: 99 * 1024)
    assert a8_ring.ring_stages(q6k, 64, 64, cuda)[:2] == (2, 272 * 64 + 384 * 64)
    assert a8_ring.ring_stages(q6k, 64, 16, cuda)[0] == 2
    assert a8_ring.ring_stages(q6k, 64, 16, cuda, 3)[0] == 3
    assert a8_ring.ring_stages(q6k, 64, 64, cuda, 3)[0] == 0
    monkeypatch.setattr(a8_ring, "_shared_limit", lambda index: 40 * 1024)
    assert a8_ring.ring_stages(q6k, 64, 64, cuda)[0] == 0
