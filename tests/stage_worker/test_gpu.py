"""The CUDA path: bf16 stages, row tensors, the fixed-order attention kernel, CUDA graphs, and
DESIGN.md's exactness 1-2 on a GPU (alone vs together, chunk alignment, graph vs eager, 1 vs 2
stages), each compared with torch.equal.

Tests marked `gpu` need CUDA and are skipped elsewhere (CI is CPU only); the others check the
tensor path's pieces on the CPU (row tensors with masked attention, bf16 frames, config).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from strata.coordinator.engine.generate import generate_solo
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.sequence import Sequence
from strata.kernels.attention.window import attend_reference, attend_rows
from strata.model.gguf_file import ModelFile
from strata.kernels.policy import KernelPolicy
from strata.model.mkmodel import SHAPES, write_random_gguf
from strata.protocol import transport
from strata.protocol.messages import Shutdown
from strata.stage_worker.model import KVCache, Rows, RowTensors, StageModel
from strata.stage_worker.runner import WindowRunner
from strata.stage_worker.worker import WorkerConfig

CTX = 256
WINDOW = 8   # decode window rows
CHUNK = 32   # prompt chunk rows


def cuda_devices() -> list[str]:
    """Two stages' devices: cuda:0 and cuda:1, or cuda:0 twice on a one-GPU machine."""
    n = torch.cuda.device_count()
    return ["cuda:0", "cuda:1" if n > 1 else "cuda:0"]


@pytest.fixture(scope="module")
def smol_shape(tmp_path_factory):
    """A random model of SmolLM2-135M's shape in BF16 (GPU tests: real matmul shapes)."""
    path = tmp_path_factory.mktemp("models") / "smol-shape.gguf"
    return write_random_gguf(path, SHAPES["smollm2-135m"], seed=2, weight_type="BF16", fast=True)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def _run(model, cache, rows: list[tuple[int, int, int]], size: int) -> torch.Tensor:
    """One window of (slot, position, token) rows padded to `size`; returns hidden [size, D]."""
    rows = rows + [(-1, 0, 0)] * (size - len(rows))
    with torch.inference_mode():
        hidden = model(torch.tensor([t for _, _, t in rows], device=model.device),
                       Rows([s for s, _, _ in rows], [p for _, p, _ in rows]), cache)
    for s, p, _ in rows:
        if s >= 0:
            cache.filled[s] = max(cache.filled[s], p + 1)
    return hidden


def _read_prompt(model, cache, slot, tokens, first_chunk=CHUNK) -> torch.Tensor:
    out = []
    bounds = sorted({0, first_chunk, *range(first_chunk + CHUNK, len(tokens), CHUNK)}
                    - {len(tokens)})
    bounds = [b for b in bounds if b < len(tokens)] + [len(tokens)]
    for a, b in zip(bounds, bounds[1:]):
        out.append(_run(model, cache, [(slot, p, tokens[p]) for p in range(a, b)], CHUNK)[: b - a])
    return torch.cat(out)


def _cache(model: StageModel, n_slots: int) -> KVCache:
    return KVCache(len(model.layers), n_slots, model.cfg, CTX, model.device, model.dtype)


# --- on the CPU: the tensor path's pieces ---------------------------------------------------

SMALL_BLOCKS = {kind: ((16, 64, 2),) for kind in ("res", "gate_up", "qkv", "head", "plain",
                                                   "wide")}


def test_triton_kernels_compute_what_their_fallbacks_compute_on_cpu(tiny_model, monkeypatch):
    """The model with the Triton kernels (RMSNorm, RoPE + KV write, attention; decode windows'
    projections on the skinny kernels, at blocks small enough for the tiny model, with the
    FFN's norm and SiLU folded in and the qkv's norm apart) computes what it computes with
    their plain-torch fallbacks, in fp32 on the CPU: under TRITON_INTERPRET=1, else there is
    nothing to tell. Two layers and 8-row windows: the interpreter takes ~0.1 s a row-layer."""
    if not KernelPolicy.for_device("cpu").triton:
        pytest.skip("the Triton kernels run on the CPU under TRITON_INTERPRET=1")
    triton = KernelPolicy(triton=True, blocks=SMALL_BLOCKS, fold=frozenset({"gate_up"}))
    from strata.kernels import skinny_triton
    calls = []
    for name in ("gate_up_silu", "skinny_mm"):
        kernel = getattr(skinny_triton, name)
        monkeypatch.setattr(skinny_triton, name, lambda *a, _k=kernel, _n=name, **kw:
                            calls.append(_n) or _k(*a, **kw))
    file = ModelFile(tiny_model)
    ref = StageModel(file, 0, 2, ctx=CTX, policy=KernelPolicy(triton=False))
    got = StageModel(file, 0, 2, ctx=CTX, policy=triton)
    a, b = _cache(ref, 3), _cache(got, 3)
    assert b.trash == 3 and b.k[0].shape[0] == 4
    for slot, n in [(0, 6), (2, 7)]:   # each prompt read as one decode window
        tokens = _prompt(n, slot, file.config.vocab)
        rows = [(slot, p, t) for p, t in enumerate(tokens)]
        torch.testing.assert_close(_run(got, b, rows, WINDOW)[:n],
                                   _run(ref, a, rows, WINDOW)[:n], rtol=1e-5, atol=1e-5)
    rows = [(0, 6, 5), (2, 7, 9)]
    torch.testing.assert_close(_run(got, b, rows, WINDOW)[:2], _run(ref, a, rows, WINDOW)[:2],
                               rtol=1e-5, atol=1e-5)
    for x, y in zip(a.k + a.v, b.k + b.v):
        torch.testing.assert_close(x[:3], y[:3], rtol=1e-5, atol=1e-5)  # slot 1 untouched
        assert x[1].abs().sum() == 0 and y[1].abs().sum() == 0
    # 3 windows of 2 layers: qkv (norm apart), o, down on skinny_mm; gate_up folded
    assert calls.count("gate_up_silu") == 6 and calls.count("skinny_mm") == 18


def test_rows_fill_a_staging_buffer_as_pack_makes_them():
    """A graphed window writes its rows (and the first stage's tokens) straight into its
    staging buffer: the same values as RowTensors.pack, pad rows on the trash slot."""
    rows = Rows([2, -1, 0], [7, 0, 3])
    for tokens in (None, [5, 0, 9]):
        packed = RowTensors.pack(rows, 4, tokens)
        buf = np.full(tuple(packed.shape), -7, dtype=np.int64)
        RowTensors.fill(buf, rows, 4, tokens)
        assert torch.equal(torch.from_numpy(buf), packed)
    assert packed.tolist() == [[2, 4, 0], [7, 0, 3], [8, 0, 4], [5, 0, 9]]


def test_bf16_frames_round_trip_bit_for_bit():
    x = torch.randn(8, 576).to(torch.bfloat16)
    frame = transport.tensor_frame(x)
    assert frame.dtype == np.uint16 and frame.shape == (8, 576)
    back = transport.frame_tensor(frame)
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16),
                                                        x.view(torch.int16))
    f = torch.randn(3, 4)
    assert transport.frame_tensor(transport.tensor_frame(f)).equal(f)
    # and through the wire format (the header lists uint16)
    _, tensors = transport.unpack(transport.pack(Shutdown("x"), [frame]))
    assert torch.equal(transport.frame_tensor(tensors[0]).view(torch.int16), x.view(torch.int16))


def test_graph_cache_must_not_be_negative():
    with pytest.raises(ValueError, match="graph_cache -1 is below 0"):
        WorkerConfig(model="m", stage=0, layer_start=0, layer_end=1, listen="ipc://a",
                     coordinator="ipc://b", next=None, graph_cache=-1)


# --- on a GPU ---------------------------------------------------------------------------------

def _attention_inputs(dtype, device, n_rows=12, heads=9, kv=3, hd=64, slots=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots + 1, kv, CTX, hd, generator=g).to(dtype).to(device)
    v = torch.randn(slots + 1, kv, CTX, hd, generator=g).to(dtype).to(device)
    q = torch.randn(n_rows, heads, hd, generator=g).to(dtype).to(device)
    return q, k, v


def _row_tensors(slots, positions, trash, device):
    return (torch.tensor([s if s >= 0 else trash for s in slots], device=device),
            torch.tensor([p + 1 if s >= 0 else 0 for s, p in zip(slots, positions)],
                         device=device))


SLOTS = [0, 1, -1, 2, 3, 4, 0, 1, 2, -1, 3, 4]
POSITIONS = [0, 1, 5, 63, 64, 65, 127, 128, 200, 0, 254, 255]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_kernel_matches_reference_on_gpu(dtype):
    q, k, v = _attention_inputs(dtype, "cuda")
    slot, length = _row_tensors(SLOTS, POSITIONS, 5, "cuda")
    out = attend_rows(q, k, v, slot, length)
    ref = attend_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), SLOTS, POSITIONS)
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.equal(out[9], out[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n_rows", [1, 8, 32, 64])
def test_attention_kernel_is_row_independent_on_gpu(n_rows):
    """A row's output is the same bits alone, among other rows at any index, in any window
    size: the kernel never mixes rows."""
    q, k, v = _attention_inputs(torch.bfloat16, "cuda", n_rows=64, seed=3)
    slots = [i % 5 for i in range(64)]
    positions = [(37 * i) % CTX for i in range(64)]
    for target in (0, 5, 13):
        alone_slot, alone_len = _row_tensors([slots[target]], [positions[target]], 5, "cuda")
        alone = attend_rows(q[target:target + 1], k, v, alone_slot, alone_len)[0]
        order = [r for r in range(n_rows) if r != target][: n_rows - 1]
        at = len(order) // 2
        order.insert(at, target)
        s, ln = _row_tensors([slots[r] for r in order], [positions[r] for r in order], 5, "cuda")
        together = attend_rows(q[order], k, v, s, ln)[at]
        assert torch.equal(alone, together), (n_rows, target)


@pytest.fixture(scope="module", params=["tiny", "smol-shape", "smol-rowblocks"])
def gpu_model(request, tiny_model):
    """Every decode-window projection on the skinny Triton kernels, the norms and SiLU folded
    in; smol-rowblocks: SmolLM2's shape with the skinny kernels' 16-row tile over row blocks
    instead of a tile that fits the window."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = tiny_model if request.param == "tiny" else request.getfixturevalue("smol_shape")
    file = ModelFile(path)
    policy = KernelPolicy.for_device("cuda:0")
    assert all(policy.skinny_blocks(n, k, kind) for n, k, kind in (
        (960, 576, "qkv"), (576, 576, "res"), (3072, 576, "gate_up"), (576, 1536, "res"),
        (49152, 576, "head")))
    if request.param == "smol-rowblocks":
        policy = dataclasses.replace(policy, row_tiles=(16,))
    return file, StageModel(file, 0, file.config.n_layers, ctx=CTX, device="cuda:0",
                            policy=policy)


@pytest.mark.gpu
def test_gpu_model_is_bf16_and_close_to_fp32_cpu(tiny_model):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    file = ModelFile(tiny_model)
    cpu = StageModel(file, 0, 4, ctx=CTX)
    dev = StageModel(file, 0, 4, ctx=CTX, device="cuda:0")
    assert dev.dtype == torch.bfloat16 and dev.policy.triton and dev.layers[0].wqkv.is_cuda
    tokens = _prompt(70, 1, file.config.vocab)
    ref = _read_prompt(cpu, _cache(cpu, 1), 0, tokens)
    got = _read_prompt(dev, _cache(dev, 1), 0, tokens).float().cpu()
    assert ((got - ref).norm() / ref.norm()) < 3e-2
    lg = dev.logits(got[-1:].to("cuda:0", torch.bfloat16))
    assert lg.dtype == torch.float32


@pytest.mark.gpu
def test_decode_row_alone_equals_row_among_others_on_gpu(gpu_model):
    """DESIGN.md exactness 1 on CUDA: in a fixed 8-row window, a slot's row gives the same
    hidden state and KV alone (beside pad rows) as beside 7 other slots, at any index."""
    file, model = gpu_model
    vocab = file.config.vocab
    prompts = [_prompt(20 + 9 * s, 20 + s, vocab) for s in range(WINDOW)]
    alone, together = _cache(model, WINDOW), _cache(model, WINDOW)
    for cache in (alone, together):
        for s, pr in enumerate(prompts):
            _read_prompt(model, cache, s, pr)
    for step, at in enumerate([0, 5, 7]):
        nxt = _prompt(WINDOW, 50 + step, vocab)
        rows = [(s, len(prompts[s]) + step, nxt[s]) for s in range(WINDOW)]
        h_alone = _run(model, alone, [rows[0]], WINDOW)[0]
        order = rows[1:at + 1] + [rows[0]] + rows[at + 1:]
        h_together = _run(model, together, order, WINDOW)[at]
        assert torch.equal(h_alone, h_together), f"step {step}, index {at}"
        p = rows[0][1]
        for x, y in zip(alone.k + alone.v, together.k + together.v):
            assert torch.equal(x[0, :, : p + 1], y[0, :, : p + 1])
        for r in rows[1:]:
            _run(model, alone, [r], WINDOW)


@pytest.mark.gpu
@pytest.mark.parametrize("first_chunk", [1, 7, 31])
def test_prompt_chunk_alignment_gives_identical_kv_on_gpu(gpu_model, first_chunk):
    """DESIGN.md exactness 2 on CUDA: the same KV and hidden states whatever the chunks'
    alignment (as when a prompt is resumed from a cache at any point), in another slot too."""
    file, model = gpu_model
    tokens = _prompt(150, 1, file.config.vocab)
    a, b = _cache(model, 2), _cache(model, 2)
    ref = _read_prompt(model, a, 0, tokens)
    got = _read_prompt(model, b, 1, tokens, first_chunk)
    assert torch.equal(got, ref)
    for x, y in zip(a.k + a.v, b.k + b.v):
        assert torch.equal(x[0, :, :150], y[1, :, :150])
    assert ref.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [8, 1])
def test_graph_replay_equals_eager_on_gpu(gpu_model, capacity):
    """Windows replayed from CUDA graphs give the same hidden states, KV, logits and argmax
    bits as the eager path; capacity 1 evicts and recaptures at every change of shape."""
    file, model = gpu_model
    vocab = file.config.vocab
    eager, graphed = WindowRunner(model, _cache(model, 4), 0), \
        WindowRunner(model, _cache(model, 4), capacity)
    prompts = [_prompt(40 + 11 * s, 70 + s, vocab) for s in range(4)]
    with torch.inference_mode():
        for runner in (eager, graphed):
            for s, pr in enumerate(prompts):
                for a in range(0, len(pr), CHUNK):
                    chunk = [(s, p, pr[p]) for p in range(a, min(a + CHUNK, len(pr)))]
                    chunk += [(-1, 0, 0)] * (CHUNK - len(chunk))
                    runner.run(torch.tensor([t for *_, t in chunk]),
                               Rows([c[0] for c in chunk], [c[1] for c in chunk]))
        for step in range(6):
            rows = [(s, len(prompts[s]) + step, (7 * s + step) % vocab) for s in range(4)]
            rows += [(-1, 0, 0)] * (WINDOW - len(rows))
            out = []
            for runner in (eager, graphed):
                h, head = runner.run(torch.tensor([t for *_, t in rows]),
                                     Rows([r[0] for r in rows], [r[1] for r in rows]),
                                     sample_rows=[0, 1, 2, 3])
                logits, argmax = runner.logits(h[:4])
                out.append((h.clone(), logits.clone(), argmax.clone(),
                            head.logits[head.rows].clone(), head.argmax[head.rows].clone()))
            for x, y in zip(*out):
                assert torch.equal(x, y), step
            # the eager head ran blocks of the sampled rows; a decode window's graph ran the
            # head of all its rows (pad rows too): a live row's logits are the same bits
            assert torch.equal(out[0][3], out[0][1]) and torch.equal(out[0][4], out[0][2])
    for x, y in zip(eager.cache.k + eager.cache.v, graphed.cache.k + graphed.cache.v):
        assert torch.equal(x[:4], y[:4])
    assert graphed.captures >= 2 and len(graphed.graphs) <= capacity


@pytest.mark.gpu
def test_one_and_two_gpu_stages_give_the_same_tokens(tiny_model, no_stage_left):
    """Launched workers on CUDA (bf16 activations as uint16 frames between stages, graphs on):
    greedy and seeded tokens are the same with 1 stage and with 2 stages on two devices."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from strata.launch.plan import plan_stages
    from strata.launch.session import launch_stages
    file = ModelFile(tiny_model)
    prompt = _prompt(45, 5, file.config.vocab)
    results = {}
    for split, devices in [("auto", ["cuda:0"]), ("2", cuda_devices())]:
        plan = plan_stages(split, devices, file.config.n_layers)
        with launch_stages(file, plan, slots=1, ctx=CTX, say=lambda s: None) as run:
            for name, params in [("greedy", SamplingParams(max_tokens=20)),
                                 ("seeded", SamplingParams(temperature=0.8, top_k=40, seed=7,
                                                           max_tokens=20))]:
                seq = Sequence(prompt, params, frozenset(), CTX)
                generate_solo(run.pipe, seq)
                results[split, name] = seq.generated
    assert results["auto", "greedy"] == results["2", "greedy"]
    assert results["auto", "seeded"] == results["2", "seeded"]
    assert len(results["auto", "greedy"]) == 20


@pytest.mark.gpu
def test_sampled_rows_picked_on_the_device_give_the_tokens_alone_and_together(varied_model,
                                                                             no_stage_left):
    """A CUDA last stage picks sampled rows on the device behind the window (the Triton pick
    for a window whose sampled rows have no top-k, top-p or min-p; the sort for the others):
    each request's tokens alone equal its tokens among the others, greedy, sampled without
    filters, with top-p and with min-p."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
    from strata.launch.plan import plan_stages
    from strata.launch.session import launch_stages
    file = ModelFile(varied_model)
    prompts = [_prompt(3 + 2 * i, 20 + i, file.config.vocab) for i in range(6)]
    params = [SamplingParams(max_tokens=24),
              SamplingParams(temperature=0.8, seed=1, max_tokens=24),
              SamplingParams(temperature=1.3, seed=2, max_tokens=24),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24),
              SamplingParams(temperature=1.0, min_p=0.05, seed=4, max_tokens=24),
              SamplingParams(temperature=0.7, seed=5, max_tokens=24)]
    cfg = SchedulerConfig(slots=6, ctx=CTX)
    plan = plan_stages("auto", ["cuda:0"], file.config.n_layers)
    with launch_stages(file, plan, slots=6, ctx=CTX, say=lambda s: None) as run:
        alone = []
        for p, sp in zip(prompts, params):
            sched = Scheduler(run.pipe, dataclasses.replace(cfg, slots=1), [], str)
            alone.append(sched.submit(p, sp))
            sched.run()
        sched = Scheduler(run.pipe, cfg, [], str)
        together = [sched.submit(p, sp) for p, sp in zip(prompts, params)]
        sched.run()
    for i, (a, t) in enumerate(zip(alone, together)):
        assert a.error is None and t.error is None, i
        assert len(a.seq.generated) == 24 and a.seq.generated == t.seq.generated, i
    assert len({tuple(a.seq.generated) for a in alone}) == 6
