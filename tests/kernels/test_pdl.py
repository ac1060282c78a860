"""Programmatic dependent launch (kernels/pdl.py) changes when a kernel's programs start, never
what they compute: a Q4_K_M stage, with int8 activations and with the float kernels, gives the
same bits with it as without, from CUDA graphs, in windows of 1 to 40 rows (on a Hopper GPU;
elsewhere it is off)."""
from __future__ import annotations

import pytest
import torch

from strata.kernels import pdl
from test_quant_stage import mixed  # noqa: F401 (a fixture)


def test_pdl_is_off_on_the_cpu_and_with_strata_pdl_0(monkeypatch):
    monkeypatch.setenv("STRATA_PDL", "1")
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("STRATA_PDL", "0")
    if torch.cuda.is_available():
        assert pdl.launch_options(torch.device("cuda")) == {"PDL": False}


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA device of compute capability 9.0+")
@pytest.mark.parametrize("activations", ["int8", "float"])
def test_a_stage_gives_the_same_bits_with_pdl_and_without(mixed, activations, monkeypatch):
    from strata.stage_worker.model import KVCache
    from strata.stage_worker.runner import WindowRunner
    from test_batch_invariance import _prefill, _stage_outputs
    from test_quant_a8 import _int8_stage
    from test_quant_stage import CTX, _model
    target, pad = (0, 48, 11), (-1, 0, 0)
    others = [(s, p, (7 * s + p) % 97) for s in range(1, 8) for p in range(40, 46)]
    windows = [([target], 0), ([target] + [pad] * 3, 0),
               (others[:3] + [target] + others[3:7], 3),
               (others[:13] + [target] + others[13:39], 13)]
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("STRATA_PDL", on)
        assert pdl.enabled(torch.device("cuda")) == (on == "1")
        model = _int8_stage(mixed, "cuda") if activations == "int8" else _model(mixed, "cuda")
        cache = KVCache(len(model.layers), 8, model.cfg, CTX, model.device, model.dtype)
        runner = WindowRunner(model, cache, 16)
        with torch.inference_mode():
            _prefill(model, cache, runner)
            outs[on] = [_stage_outputs(model, cache, rows, [at], runner) for rows, at in windows]
    for size, off, on in zip((1, 4, 8, 40), outs["0"], outs["1"]):
        for name, x, y in zip(("hidden", "logits", "argmax", "sampled", "kv", "kv"), off, on):
            assert torch.equal(x, y), f"a {size}-row window's {name} differs with PDL"
