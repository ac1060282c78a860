"""A stage of an MoE family (qwen3moe, glm4moe) on the Triton path: experts kept packed where a
kernel reads their type and widened otherwise (and the load report and the memory plan say
so), the packed stage's logits against the same file widened, and (on CUDA) a decode row's
bits alone and among other rows, eagerly and replayed from CUDA graphs. Files written by
strata-mkmodel's tiny MoE shapes. Under Triton's interpreter ("cpu" cases, fp32,
weights="packed") and on CUDA (bf16, marked gpu)."""
from __future__ import annotations

import pytest
import torch

from strata.kernels.quant.weight import QuantWeight
from strata.launch.memory import stage_bytes
from strata.model.gguf_file import ModelFile
from strata.model.mkmodel import SHAPES, write_random_gguf
from strata.stage_worker.model import KVCache, StageModel
from conftest import triton_devices
from test_quant_stage import assert_packed_is_widened, widened
from test_batch_invariance import (_decode_windows, _prefill, _same, _stage_outputs,
                                   eager_and_graphed_rows_are_invariant)

CTX = 96


@pytest.fixture(scope="module", params=["qwen3moe", "glm4moe"])
def moe_file(request, tmp_path_factory) -> ModelFile:
    """A tiny file of the family in Q8_0 (glm4moe: a dense first layer, a shared expert, its
    NextN layer)."""
    arch = request.param
    path = tmp_path_factory.mktemp(arch) / "q8.gguf"
    return ModelFile(write_random_gguf(path, SHAPES[f"{arch}-tiny"], seed=4, weight_type="Q8_0",
                                       nextn=arch == "glm4moe"))


def _interpreter_skips(file: ModelFile, device: str) -> None:
    if device == "cpu" and file.config.arch != "glm4moe":
        pytest.skip("under the interpreter (~0.1 s a program) glm4moe covers qwen3moe's "
                    "experts, and its shared expert and dense layer too")


def _mode(device: str) -> str:
    return "packed" if device == "cpu" else "quantized"


def _model(file: ModelFile, device: str, weights: str) -> StageModel:
    return StageModel(file, 0, file.config.n_layers, ctx=CTX, device=device, weights=weights)


def test_the_loader_packs_experts_and_the_report_and_plan_say_so(moe_file, tmp_path):
    cfg = moe_file.config
    model = _model(moe_file, "cpu", "packed")
    report = model.weights.report
    assert set(report.quantized) == {"Q8_0"} and not report.widened
    routed = [layer.experts for layer in model.layers if layer.experts is not None]
    assert len(routed) == cfg.n_layers - cfg.n_dense_first
    e, f, d = cfg.n_experts, cfg.d_ffn_expert, cfg.d_model
    for experts in routed:
        assert isinstance(experts.gate_up, QuantWeight) and experts.gate_up.shape == (2 * e * f, d)
        assert isinstance(experts.down, QuantWeight) and experts.down.shape == (e * d, f)
    # the file's bytes of every packed tensor (experts, 3-D, included) and fp32 vectors
    mine = [t for t in moe_file.reader.tensors
            if not t.name.startswith(f"blk.{cfg.n_layers}.")]   # not the NextN layer's
    packed = sum(int(t.n_bytes) for t in mine if t.tensor_type.name == "Q8_0")
    vectors = sum(int(t.n_elements) * 4 for t in mine if t.tensor_type.name == "F32")
    assert report.weight_bytes == packed + vectors
    # the memory plan counts the experts packed on CUDA (vectors in bf16), and none of them
    # in the scratch (bf16 bytes of the largest packed matrix a prompt chunk widens)
    weights, scratch = stage_bytes(moe_file, 0, cfg.n_layers, "cuda:0", "quantized")
    assert weights == packed + vectors // 2 and scratch < 2 * (2 * e * f * d)
    # widened on a CPU stage, and where the type has no kernel (MXFP4); a Q4_K_M file's
    # choice for rows of 64 values (Q5_0) stays packed
    dense = _model(moe_file, "cpu", "quantized")
    assert not dense.weights.report.quantized
    assert all(layer.experts.gate_up.shape == (e, 2 * f, d) for layer in dense.layers
               if layer.experts is not None)
    mix = ModelFile(write_random_gguf(tmp_path / "mix.gguf", SHAPES["glm4moe-tiny"],
                                      weight_type="Q4_K_M"))
    got = _model(mix, "cpu", "packed").weights.report
    assert got.quantized["Q5_0"] and "Q5_0" not in got.widened
    fp4 = ModelFile(write_random_gguf(tmp_path / "fp4.gguf", SHAPES["glm4moe-tiny"],
                                      weight_type="MXFP4"))
    got = _model(fp4, "cpu", "packed").weights.report
    assert got.widened["MXFP4"] and "MXFP4" not in got.quantized
    assert "loaded as float32: MXFP4 x" in got.summary(torch.float32)


@pytest.mark.parametrize("device", triton_devices())
def test_packed_experts_give_the_widened_files_logits(moe_file, device):
    """A prompt chunk and a decode window through packed experts (float_triton's tiles in the
    expert kernels) against the same file widened at load (on CUDA the expert kernels on
    dense weights, on the CPU plain torch)."""
    _interpreter_skips(moe_file, device)
    assert_packed_is_widened([_model(moe_file, device, _mode(device)),
                              widened(moe_file, device)], device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_moe_stages_rows_are_invariant(moe_file):
    """The target rows alone and among 8, 16, 32 and 64 rows: hidden states, logits, sampled
    tokens and KV, the same bits (under the interpreter the expert kernels' own test takes a
    row alone and among others: tests/kernels/test_moe_triton.py)."""
    model = _model(moe_file, "cuda:0", "quantized")
    cache = KVCache(len(model.layers), 8, model.cfg, CTX, model.device, model.dtype)
    with torch.inference_mode():
        _prefill(model, cache)
        outs = []
        for rows, at in _decode_windows(model.cfg.vocab, (1, 8, 16, 32, 64)):
            outs.append(_stage_outputs(model, cache, rows, at))
            _same(outs, len(rows))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("weights", ["quantized", "bf16"])
def test_an_moe_stage_replays_its_graphs_with_the_same_bits(moe_file, weights):
    """Decode windows of 8, 24, 40 and 64 rows, eagerly and from CUDA graphs: the routing, the
    aligned blocks and the experts inside each window's graph."""
    model = _model(moe_file, "cuda:0", weights)
    eager_and_graphed_rows_are_invariant(model, (8, 24, 40, 64))


def test_the_launcher_plans_moe_stages_on_cuda(moe_file):
    from strata.launch.options import prepare
    prep = prepare(model=str(moe_file.path), layer_split="1", devices="cpu,cuda:0",
                   ctx_size=64, batch=1, batch_groups="1", window_rows="auto",
                   chunk_rows="auto", cuda_devices=1, check_memory=False)
    assert [p.device for p in prep.plan] == ["cpu", "cuda:0"]
