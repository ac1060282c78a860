"""--activations int8 (kernels/quant/a8.py) as strata-launch and strata-worker take it: refused
with a sentence where it cannot apply (CPU stages, weights widened), passed to the CUDA stages
that run it, and the stage's policy that the kernels read."""
from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from strata.config_error import ConfigError
from strata.launch.cli import main as launch
from strata.launch.options import prepare
from strata.launch.processes import StageProcesses
from strata.stage_worker.config import WorkerConfig


def _prepare(model, devices: str, weights: str, activations: str):
    return prepare(model=str(model), layer_split="2", devices=devices, ctx_size=64, batch=1,
                   batch_groups="1", window_rows="auto", chunk_rows="auto", cuda_devices=1,
                   check_memory=False, weights=weights, activations=activations)


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
