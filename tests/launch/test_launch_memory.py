"""What a launch plans a stage to hold before any stage starts (launch/memory.py): each
tensor's bytes by its type and --weights, the choice --weights auto makes, a split that does
not fit refused with the numbers, and --layer-split auto balancing the layers' bytes."""
from __future__ import annotations

import dataclasses

import pytest

from strata.launch.memory import (HEADROOM, check_fits, head_bytes, kv_bytes_per_slot,
                                  layer_bytes, stage_bytes, tensor_bytes)
from strata.launch.plan import PlanError, StagePlan, balanced_bounds, plan_stages
from strata.model.gguf_file import ModelFile
from strata.model.mkmodel import SHAPES, write_random_gguf

SHAPE = dataclasses.replace(SHAPES["tiny"], n_layers=4, d_model=256, n_heads=4, n_kv_heads=2,
                            d_ffn=512)
GIB = 2 ** 30


@pytest.fixture(scope="module")
def q4km(tmp_path_factory) -> ModelFile:
    path = tmp_path_factory.mktemp("memory") / "q4km.gguf"
    return ModelFile(write_random_gguf(path, SHAPE, seed=1, weight_type="Q4_K_M"))


def test_a_tensor_costs_its_blocks_when_kept_quantized(q4km):
    t = q4km.tensors["blk.0.ffn_up.weight"]
    assert t.tensor_type.name == "Q4_K"
    assert tensor_bytes(q4km, t.name, "cuda:0", "quantized") == t.n_bytes
    assert tensor_bytes(q4km, t.name, "cuda:0", "bf16") == 2 * t.n_elements
    assert tensor_bytes(q4km, t.name, "cpu", "quantized") == 4 * t.n_elements
    norm = "blk.0.attn_norm.weight"   # vectors are always dense
    assert tensor_bytes(q4km, norm, "cuda:0", "quantized") == 2 * 256
    whole, scratch = stage_bytes(q4km, 0, 4, "cuda:0", "quantized")
    assert whole == sum(tensor_bytes(q4km, n, "cuda:0", "quantized") for n in q4km.tensors)
    assert scratch == 2 * (2 * 512 * 256)      # the fused gate/up matrix in bf16
    assert stage_bytes(q4km, 0, 4, "cuda:0", "bf16")[1] == 0
    # the tied head: the last stage holds the embedding again when it is not the first
    assert stage_bytes(q4km, 2, 4, "cuda:0", "quantized")[0] > sum(
        tensor_bytes(q4km, n, "cuda:0", "quantized") for n in q4km.tensors
        if n.startswith(("blk.2.", "blk.3.", "output_norm")))


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M"])
def test_the_plan_counts_what_the_loader_holds(tmp_path, mix):
    """Q3_K_M's v in Q5_K beside q and k in Q3_K (no kernel): the whole projection widened,
    in the plan as in the stage (on a CPU with weights "packed", as the kernel tests run)."""
    from strata.stage_worker.model import StageModel
    file = ModelFile(write_random_gguf(tmp_path / "m.gguf", SHAPE, seed=2, weight_type=mix))
    for start, end in ((0, 4), (1, 3), (2, 4)):
        model = StageModel(file, start, end, ctx=16, weights="packed")
        weights, scratch = stage_bytes(file, start, end, "cpu", "packed")
        assert weights == model.weights.report.weight_bytes
        assert scratch == 4 * model.weights.scratch.numel   # fp32 scratch on a CPU


def _plan(devices: str) -> list[StagePlan]:
    return plan_stages("2", devices.split(","), SHAPE.n_layers)


def test_auto_widens_where_it_fits_and_keeps_blocks_where_only_they_fit(q4km):
    plan = _plan("cuda:0,cuda:0")
    need = {w: sum(sum(stage_bytes(q4km, p.layer_start, p.layer_end, p.device, w))
                   for p in plan) for w in ("quantized", "bf16")}
    assert need["quantized"] < 0.6 * need["bf16"]
    roomy = lambda device: 100 * need["bf16"]    # noqa: E731
    assert check_fits(q4km, plan, 1, 64, "auto", roomy) == "bf16"
    tight = lambda device: int(1.2 * need["quantized"] / 0.85) + 2 ** 20   # noqa: E731
    assert check_fits(q4km, plan, 1, 64, "auto", tight) == "quantized"
    with pytest.raises(PlanError, match=r"on cuda:0 need .* GiB of weights \(--weights bf16, "
                                        r"layers 0-1, 2-3\).*--weights quantized"):
        check_fits(q4km, plan, 1, 64, "bf16", tight)
    starved = lambda device: need["quantized"] // 4    # noqa: E731
    with pytest.raises(PlanError, match="spread the layers over more devices"):
        check_fits(q4km, plan, 1, 64, "auto", starved)
    # CPU stages widen to fp32 whatever --weights says
    assert check_fits(q4km, _plan("cpu"), 1, 64, "auto", roomy) == "quantized"


def test_layer_split_auto_balances_bytes():
    assert balanced_bounds([1] * 30, 2) == [15] and balanced_bounds([1] * 30, 3) == [10, 20]
    assert balanced_bounds([4, 1, 1, 1, 1], 2) == [1]            # a heavy first layer alone
    assert balanced_bounds([1, 1, 1, 1, 1, 1, 6], 2) == [6]
    assert balanced_bounds([1, 1, 1, 10], 3) == [2, 3]           # every stage keeps a layer
    for sizes in ([3, 1, 2, 5, 1, 1, 2], [1] * 9, [9, 1, 1, 1, 1, 1, 1, 1, 1]):
        for n in (2, 3, 4):
            b = balanced_bounds(sizes, n)
            assert len(b) == n - 1 and all(x < y for x, y in zip([0] + b, b + [len(sizes)]))
    plan = plan_stages("auto", ["cuda:0", "cuda:1"], 4, [1, 1, 1, 5])
    assert [(p.layer_start, p.layer_end) for p in plan] == [(0, 3), (3, 4)]


def test_layer_bytes_follow_each_layers_types(q4km):
    per = layer_bytes(q4km, "cuda:0", "quantized")
    types = {i: q4km.tensor_type(f"blk.{i}.ffn_down.weight") for i in range(4)}
    heavy = [i for i, t in types.items() if t == "Q6_K"]
    light = [i for i, t in types.items() if t == "Q4_K"]
    assert heavy and light and min(per[i] for i in heavy) > max(per[i] for i in light)
    assert len(set(layer_bytes(q4km, "cuda:0", "bf16"))) == 1


def test_a_nextn_drafter_is_counted_on_the_last_stages_device(tmp_path):
    file = ModelFile(write_random_gguf(tmp_path / "n.gguf", SHAPE, seed=2, weight_type="Q4_K_M",
                                       nextn=True))
    last = plan_stages("2", ["cuda:0", "cuda:1"], SHAPE.n_layers)[1:]
    block = sum(tensor_bytes(file, n, "cuda:1", "quantized") for n in file.tensors
                if n.startswith(f"blk.{SHAPE.n_layers}."))
    assert head_bytes(file, file, SHAPE.n_layers, last[0], "quantized") == block > 0
    alone = sum(stage_bytes(file, 2, 4, "cuda:1", "quantized"))
    budget = lambda device: int((alone + block // 2) / 0.85)   # noqa: E731  fits only alone
    assert check_fits(file, last, 0, 64, "quantized", budget) == "quantized"
    with pytest.raises(PlanError, match="on cuda:1 need"):
        check_fits(file, last, 0, 64, "quantized", budget, head=(file, SHAPE.n_layers))


def test_a_drafter_keeps_each_slots_hidden_states_beside_its_kv(tmp_path):
    """The drafter keeps a hidden state and a token a position for every slot: with a head,
    a slot needs that beside the KV of the stage's layers and the head's."""
    file = ModelFile(write_random_gguf(tmp_path / "n.gguf", SHAPE, seed=2, weight_type="Q4_K_M",
                                       nextn=True))
    last = plan_stages("2", ["cuda:0", "cuda:1"], SHAPE.n_layers)[1:]
    head = (file, SHAPE.n_layers)
    weights = (sum(stage_bytes(file, 2, 4, "cuda:1", "quantized"))
               + head_bytes(file, *head, last[0], "quantized"))
    kv = kv_bytes_per_slot(file.config, 3, 64, 2)      # its 2 layers and the head's
    store = 64 * (SHAPE.d_model * 2 + 8)
    budget = lambda device: int((weights + 4 * kv + 2 * store + 1) / HEADROOM) + 1  # noqa: E731
    assert check_fits(file, last, 3, 64, "quantized", budget, head=head) == "quantized"
    with pytest.raises(PlanError, match="--batch 4 needs"):
        check_fits(file, last, 4, 64, "quantized", budget, head=head)
