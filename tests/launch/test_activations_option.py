"""--activations (kernels/quant/a8.py) as strata-launch and strata-worker take it: int8 refused
with a sentence where it cannot apply (CPU stages, weights widened), passed to the CUDA stages
that run it, and the stage's policy that the kernels read; auto resolved from the plan, and
--min-window-rows auto with it."""
from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from strata.config_error import ConfigError
from strata.launch.cli import main as launch
from strata.launch.options import prepare
from strata.launch.processes import StageProcesses
from strata.stage_worker.config import WorkerConfig


def _prepare(model, devices: str, weights: str, activations: str, **kw):
    args = dict(model=str(model), layer_split="2", devices=devices, ctx_size=64, batch=1,
                batch_groups="1", window_rows="auto", chunk_rows="auto", cuda_devices=1,
                check_memory=False, weights=weights, activations=activations)
    return prepare(**{**args, **kw})


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    """The tiny shape's matrices in Q8_0, a type the quantized kernels keep in blocks."""
    from strata.model.mkmodel import SHAPES, write_random_gguf
    return write_random_gguf(tmp_path_factory.mktemp("q8") / "q8.gguf", SHAPES["tiny"], seed=1,
                             weight_type="Q8_0")


def test_auto_activations_are_int8_for_quantized_weights_in_small_windows(q8_model):
    """auto: int8 where CUDA stages keep the blocks and no decode window passes 16 rows (a
    group's slots and a fixed count of drafts; --draft-tokens auto may draft none), and then
    windows of 1 row; float otherwise, and windows of 8 rows; a --min-window-rows given
    stays."""
    def resolved(**kw):
        args = dict(model=q8_model, devices="cuda:0", weights="quantized", activations="auto")
        prep = _prepare(**{**args, **kw})
        return prep.activations, prep.sched.min_window_rows

    assert resolved() == ("int8", 1)
    assert resolved(batch=16) == ("int8", 1)
    assert resolved(batch=17) == ("float", 8)                    # windows of 24 rows
    assert resolved(batch=4, draft_tokens=3) == ("int8", 1)      # 4 slots x 4 rows
    assert resolved(batch=8, draft_tokens=1) == ("int8", 1)
    assert resolved(batch=8, draft_tokens=2) == ("float", 8)     # 24 rows
    assert resolved(batch=8, draft_tokens="auto") == ("int8", 1)  # auto may draft none
    assert resolved(batch=17, draft_tokens="auto") == ("float", 8)
    assert resolved(batch=32, window_rows="16") == ("int8", 1)   # slots take turns in 16
    assert resolved(min_window_rows="8") == ("int8", 8)
    assert resolved(weights="bf16") == ("float", 8)
    assert resolved(devices="cpu") == ("float", 8)
    assert resolved(activations="float", min_window_rows="2") == ("float", 2)


def test_auto_activations_are_float_where_no_matrix_stays_in_blocks(tiny_model):
    prep = _prepare(tiny_model, "cuda:0", "quantized", "auto")   # an F32 file
    assert (prep.activations, prep.sched.min_window_rows) == ("float", 8)


def test_min_window_rows_takes_a_number_or_auto(q8_model):
    runner = CliRunner()
    for value, says in (("x", "--min-window-rows 'x' is not a number or auto"),
                        ("3", "--min-window-rows 3 is not one of 1, 2, 4 or 8")):
        out = runner.invoke(launch, ["--model", str(q8_model), "--min-window-rows", value,
                                     "--prompt", "hi"])
        assert out.exit_code == 2 and says in out.stderr, (out.output, out.exception)


def test_cpu_stages_refuse_int8_activations_with_a_sentence(tiny_model):
    out = CliRunner().invoke(launch, ["--model", str(tiny_model), "--activations", "int8",
                                      "--prompt", "hi"])
    assert out.exit_code == 2, (out.output, out.exception)
    assert ("--activations int8 runs on CUDA stages, and every stage is on the CPU" in out.stderr
            and "leave --activations out" in out.stderr)


def test_widened_weights_refuse_int8_activations(tiny_model):
    with pytest.raises(ConfigError, match="multiplies quantized weights, and the stages widen "
                                          "them to bf16"):
        _prepare(tiny_model, "cuda:0", "bf16", "int8")


def test_the_cuda_stages_are_given_int8_activations(tiny_model):
    prep = _prepare(tiny_model, "cpu,cuda:0", "quantized", "int8")
    assert prep.activations == "int8"
    procs = StageProcesses(prep.file.path, prep.plan, slots=1, ctx=64, weights=prep.weights,
                           activations=prep.activations)
    try:
        cpu, cuda = procs.command(0), procs.command(1)
    finally:
        shutil.rmtree(procs.run_dir)
    assert "--activations" not in cpu                       # a CPU stage computes in fp32
    assert cuda[cuda.index("--activations") + 1] == "int8"
    assert _prepare(tiny_model, "cuda:0", "quantized", "float").activations == "float"


def test_a_worker_takes_int8_activations_only_over_quantized_weights_on_cuda():
    base = dict(model="m.gguf", stage=0, layer_start=0, layer_end=1, listen="unix:///tmp/a",
                coordinator="unix:///tmp/b", next=None)
    WorkerConfig(**base, device="cuda:0", weights="quantized", activations="int8")
    for device, weights in (("cpu", "quantized"), ("cuda:0", "bf16")):
        with pytest.raises(ConfigError, match="int8 multiplies quantized weights on a CUDA "
                                              "device"):
            WorkerConfig(**base, device=device, weights=weights, activations="int8")
    with pytest.raises(ConfigError, match="'int4' is not float or int8"):
        WorkerConfig(**base, activations="int4")


def test_row_weights_are_the_matrices_a_decode_row_reads(tiny_model, tmp_path):
    """The layers' matrices and the tied head (the config's own count); a MoE file's routed
    experts only at the share a row takes."""
    from strata.launch.activations import row_weights
    from strata.model.gguf_file import ModelFile
    from strata.model.mkmodel import SHAPES, write_random_gguf
    file = ModelFile(tiny_model)
    c = file.config
    layer = (2 * c.d_model * c.n_heads * c.head_dim + 2 * c.d_model * c.n_kv_heads * c.head_dim
             + 3 * c.d_model * c.d_ffn)
    assert c.tied_head and row_weights(file) * 1e9 == c.n_layers * layer + c.vocab * c.d_model
    moe = ModelFile(write_random_gguf(tmp_path / "moe.gguf", SHAPES["qwen3moe-tiny"], seed=1))
    every = sum(int(t.n_elements) for t in moe.tensors.values() if len(t.shape) >= 2)
    assert moe.config.n_experts_used < moe.config.n_experts
    assert row_weights(moe) * 1e9 < every - moe.tensors["token_embd.weight"].n_elements


def test_auto_weights_keep_the_blocks_of_a_large_model_in_small_windows(q8_model, monkeypatch):
    """--weights auto on a CUDA stage: quantized (and int8 activations) where a row reads at
    least a billion weights and no decode window passes 16 rows, else bf16 (check_memory off:
    a cluster's memory is not seen); quantized wherever int8 is asked; bf16 where float is."""
    from strata.launch import activations

    def resolved(billions, **kw):
        monkeypatch.setattr(activations, "row_weights", lambda file: billions)
        prep = _prepare(**{**dict(model=q8_model, devices="cuda:0", weights="auto",
                                  activations="auto"), **kw})
        return prep.weights, prep.activations

    assert resolved(8.0) == ("quantized", "int8")
    assert resolved(8.0, batch=16) == ("quantized", "int8")
    assert resolved(8.0, batch=17) == ("bf16", "float")              # windows of 24 rows
    assert resolved(8.0, batch=8, draft_tokens=2) == ("bf16", "float")   # 8 slots x 3 rows
    assert resolved(1.0, batch=8) == ("quantized", "int8")
    assert resolved(0.9) == ("bf16", "float")
    assert resolved(8.0, activations="float") == ("bf16", "float")
    assert resolved(0.1, activations="int8") == ("quantized", "int8")
    assert resolved(8.0, weights="bf16") == ("bf16", "float")
    assert resolved(8.0, devices="cpu")[1] == "float"
    monkeypatch.undo()
    assert _prepare(q8_model, "cuda:0", "auto", "auto").weights == "bf16"   # 0.0002 billion
