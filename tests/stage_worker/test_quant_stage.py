"""A stage whose weights stay quantized (stage_worker/weights.py): what it keeps packed and
what it widens, its logits against the same file widened, and a decode row's bits alone and
among other rows, eagerly and replayed from CUDA graphs. The file is a Q4_K_M mix as
llama.cpp's llama-quantize makes one (q and k in Q4_K beside v in Q6_K, a Q6_K head), so a
fused projection runs parts of two types. Under Triton's interpreter ("cpu" cases, fp32,
weights="packed") and on CUDA (bf16, marked gpu)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from strata.kernels.policy import KernelPolicy
from strata.model.gguf_file import ModelFile
from strata.model.mkmodel import SHAPES, write_random_gguf
from strata.stage_worker.model import KVCache, Rows, StageModel
from conftest import triton_devices
from test_attention_chunk import rowwise_interpreter_dot  # noqa: F401 (a fixture)
from test_batch_invariance import (_decode_windows, _prefill, _same, _stage_outputs,
                                   eager_and_graphed_rows_are_invariant)

SHAPE = dataclasses.replace(SHAPES["tiny"], n_layers=2, d_model=256, n_heads=4, n_kv_heads=2,
                            d_ffn=512)
CTX = 96


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> ModelFile:
    path = tmp_path_factory.mktemp("quant") / "q4km.gguf"
    return ModelFile(write_random_gguf(path, SHAPE, seed=3, weight_type="Q4_K_M"))


def _mode(device: str) -> str:
    return "packed" if device == "cpu" else "quantized"


def _policy(device: str) -> KernelPolicy:
    """The device's policy; under the interpreter (~50 ms a program) 128-row weight blocks,
    so that each kernel call runs a few programs."""
    policy = KernelPolicy.for_device(device)
    if device != "cpu":
        return policy
    wide = {kind: {"*": (128, 256, 1, 4)} for kind in policy.quant_blocks_by_kind}
    return dataclasses.replace(policy, quant_blocks_by_kind=wide)


def _model(mixed: ModelFile, device: str, weights: str | None = None) -> StageModel:
    return StageModel(mixed, 0, SHAPE.n_layers, ctx=CTX, device=device,
                      weights=weights or _mode(device), policy=_policy(device))


def widened(file: ModelFile, device: str, **kwargs) -> StageModel:
    """The file widened at load: the reference of a packed stage. On the CPU its plain-torch
    path (the Triton path's own tests compare the two; the interpreter would take as long
    again as the packed stage's)."""
    policy = KernelPolicy(triton=False) if device == "cpu" else KernelPolicy.for_device(device)
    return StageModel(file, 0, file.config.n_layers, ctx=CTX, device=device, weights="bf16",
                      policy=policy, **kwargs)


def test_the_loader_keeps_kernel_types_packed_and_counts_bytes(mixed, tmp_path):
    model = StageModel(mixed, 0, SHAPE.n_layers, ctx=CTX, weights="packed")
    report = model.weights.report
    assert set(report.quantized) == {"Q4_K", "Q6_K"} and not report.widened
    matrices = sum(t.n_bytes for t in mixed.reader.tensors if len(t.shape) == 2)
    norms = sum(t.n_elements * 4 for t in mixed.reader.tensors if len(t.shape) == 1)
    assert report.weight_bytes == matrices + norms      # the file's bytes, fp32 norms on a CPU
    # q, k | v: llama.cpp's more-bits layers (here layer 1 of 2) keep v in Q6_K
    assert [[p.qtype for p in layer.wqkv.parts] for layer in model.layers] == [
        ["Q4_K"], ["Q4_K", "Q6_K"]]
    assert model.weights.scratch.numel == 2 * SHAPE.d_ffn * SHAPE.d_model  # gate_up, dense
    assert "kept quantized: Q4_K x" in report.summary(model.dtype)
    # on a CPU stage (and with bf16, the default) every matrix is widened
    dense = StageModel(mixed, 0, SHAPE.n_layers, ctx=CTX, weights="quantized").weights.report
    assert not dense.quantized and dense.widened["Q4_K"] == report.quantized["Q4_K"]
    # a type without a kernel is widened where the others stay packed
    iq = ModelFile(write_random_gguf(tmp_path / "iq.gguf", SHAPE, seed=3, weight_type="IQ3_S"))
    got = StageModel(iq, 0, 1, ctx=CTX, weights="packed").weights.report
    assert not got.quantized and got.widened["IQ3_S"] == 7 + 1   # a layer and the embedding
    assert "loaded as float32: IQ3_S x8" in got.summary(torch.float32)


@pytest.mark.parametrize("device", triton_devices())
def test_quantized_logits_are_the_widened_files(mixed, device):
    """Prompt chunks (the dense weight in the scratch buffer) and decode windows (the
    quantized kernels) give the logits of the same file widened at load."""
    assert_packed_is_widened([_model(mixed, device), widened(mixed, device)], device)


def assert_packed_is_widened(models: list[StageModel], device: str,
                             tol: float | None = None) -> None:
    """models: a stage loaded packed and the same stage widened: a 48-token prompt chunk,
    then a decode window of 16 rows, give each the same hidden states and logits (relative
    error within `tol`: default 1e-4 on the CPU, 5e-2 in bf16)."""
    assert models[0].weights.report.quantized and not models[1].weights.report.quantized
    tol = tol or (1e-4 if device == "cpu" else 5e-2)
    outs = []
    with torch.inference_mode():
        for model in models:
            cache = KVCache(len(model.layers), 8, model.cfg, CTX, model.device, model.dtype)
            prompt = torch.arange(48, device=device) * 7 % model.cfg.vocab
            model(prompt, Rows([0] * 48, list(range(48))), cache, chunk=True)
            cache.filled[0] = 48
            rows, at = next(_decode_windows(model.cfg.vocab, (16,)))
            outs.append(_stage_outputs(model, cache, rows, at)[:2])   # hidden, logits
    for got, want in zip(*outs):
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < tol


@pytest.mark.parametrize("device", triton_devices())
def test_a_quantized_stages_rows_are_invariant(mixed, device, rowwise_interpreter_dot):
    """The target rows alone and among 8, 16, 32 and 64-row windows: hidden states, logits,
    sampled tokens and KV, the same bits (under the interpreter, ~1 s a kernel call: alone,
    in 8 rows with pad rows and among 40, over row blocks; the kernels' own tests take every
    size)."""
    assert_stage_rows_invariant(_model(mixed, device), device)


def assert_stage_rows_invariant(model: StageModel, device: str,
                                sizes: tuple[int, ...] | None = None) -> None:
    """The target rows alone and among others (_decode_windows, of `sizes`: by default 8 and
    40 rows on a CPU, 8 to 64 on CUDA): the same bits."""
    cache = KVCache(len(model.layers), 8, model.cfg, CTX, model.device, model.dtype)
    sizes = sizes or ((1, 8, 40) if device == "cpu" else (1, 8, 16, 32, 64))
    with torch.inference_mode():
        if device != "cpu":
            _prefill(model, cache)
        outs = []
        for rows, at in _decode_windows(model.cfg.vocab, sizes):
            outs.append(_stage_outputs(model, cache, rows, at))
            _same(outs, len(rows))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_quantized_stage_replays_its_graphs_with_the_same_bits(mixed):
    """Every decode size from 8 to 64 rows, eagerly and from CUDA graphs (the prompt chunk's
    dense weights in the scratch buffer inside its graph)."""
    model = StageModel(mixed, 0, SHAPE.n_layers, ctx=CTX, device="cuda:0", weights="quantized")
    assert model.weights.report.quantized
    eager_and_graphed_rows_are_invariant(model, tuple(range(8, 65, 8)))
