"""Activations over torch.distributed (gloo between CPU stages here; nccl on GPUs): the same
tokens as ZeroMQ frames, in serial and pipelined groups, and a refused window leaves the link
in step. On the tiny random model whose tokens depend on the whole context (varied_model), so
an activation that arrives wrong, late or out of order changes the text."""
from __future__ import annotations

import time

import pytest
import torch

from strata.coordinator.engine.generate import generate_solo
from strata.coordinator.sequence import Sequence
from strata.coordinator.stages.pipeline import WindowFailed
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import SchedulerConfig
from strata.bench import harness
from strata.launch.joins import host_rendezvous
from strata.launch.plan import PlanError, StagePlan, plan_stages, resolve_link
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer
from strata.protocol.join import free_ports
from strata.protocol.messages import Window
from strata.stage_worker.link import LinkError, StageLink

CTX = 256


@pytest.fixture(scope="module")
def model(varied_model):
    file = ModelFile(varied_model)
    return file, Tokenizer.from_gguf(file.reader)


def test_gloo_link_gives_the_frames_tokens(model, no_stage_left):
    file, tok = model
    prompts = [tok.encode(p) for p in harness.prompt_set(4)]
    params = [harness.request_params(i, i % 2 == 1, 12) for i in range(4)]
    plan = plan_stages("1,2", ["cpu"], file.config.n_layers)
    got = {}
    for link in ("zmq", "gloo"):
        with launch_stages(file, plan, slots=4, ctx=CTX, link=link, say=lambda s: None) as run:
            assert run.procs.link == link
            if link == "gloo":
                assert "--link" in run.procs.command(1)
            for groups in (1, 2):
                cfg = SchedulerConfig(slots=4, groups=groups, ctx=CTX)
                reqs = harness.run_together(run, cfg, tok, prompts, params)
                got[link, groups] = [r.seq.generated for r in reqs]
    assert all(len(t) > 0 for t in got["zmq", 1])
    assert got["gloo", 1] == got["zmq", 1]
    assert got["gloo", 2] == got["zmq", 1]


def test_refused_window_keeps_the_link_in_step(model, no_stage_left):
    """Stage 0 refuses a window with a gap: it sends nothing, so the next window's
    activations still meet their header on stage 1."""
    file, tok = model
    prompt = tok.encode("The capital of France is")
    plan = plan_stages("2", ["cpu"], file.config.n_layers)

    def solo(run):
        seq = Sequence(prompt, SamplingParams(max_tokens=6), frozenset(), CTX)
        generate_solo(run.pipe, seq)
        return seq.generated

    with launch_stages(file, plan, slots=2, ctx=CTX, link="gloo", say=lambda s: None) as run:
        before = solo(run)
        run.pipe.submit(Window(id=run.pipe.new_window_id(), slots=[1], positions=[40],
                               tokens=[5]))
        with pytest.raises(WindowFailed, match="gap"):
            run.pipe.receive(timeout=60)
        assert solo(run) == before


def test_resolve_link():
    cpu2 = [StagePlan(0, 0, 2, "cpu"), StagePlan(1, 2, 4, "cpu")]
    gpu2 = [StagePlan(0, 0, 2, "cuda:0"), StagePlan(1, 2, 4, "cuda:1")]
    mixed = [StagePlan(0, 0, 2, "cuda:0"), StagePlan(1, 2, 4, "cpu")]
    assert resolve_link("auto", cpu2) == "zmq"
    assert resolve_link("auto", gpu2) == "nccl"
    assert resolve_link("auto", mixed) == "zmq"
    assert resolve_link("auto", gpu2[:1]) == "zmq"
    one_gpu = [StagePlan(0, 0, 2, "cuda:0"), StagePlan(1, 2, 4, "cuda")]  # the same device
    assert resolve_link("auto", one_gpu) == "zmq"
    with pytest.raises(PlanError, match="one GPU per stage"):
        resolve_link("nccl", one_gpu)
    assert resolve_link("gloo", cpu2) == "gloo"
    with pytest.raises(PlanError, match="every stage on a CUDA device"):
        resolve_link("nccl", mixed)
    with pytest.raises(PlanError, match="links CPU stages"):
        resolve_link("gloo", gpu2)


def test_resolve_link_across_hosts():
    """Stages joining from other hosts (--listen): auto stays ZeroMQ frames; nccl and gloo are
    taken (they meet through the launcher's TCPStore), and two stages may name the same GPU
    index, on two hosts."""
    cpu2 = [StagePlan(0, 0, 2, "cpu"), StagePlan(1, 2, 4, "cpu")]
    gpu2 = [StagePlan(0, 0, 2, "cuda:0"), StagePlan(1, 2, 4, "cuda:1")]
    same_index = [StagePlan(0, 0, 2, "cuda:0"), StagePlan(1, 2, 4, "cuda:0")]
    assert resolve_link("auto", gpu2, across_hosts=True) == "zmq"
    assert resolve_link("gloo", cpu2, across_hosts=True) == "gloo"
    assert resolve_link("nccl", gpu2, across_hosts=True) == "nccl"
    assert resolve_link("nccl", same_index, across_hosts=True) == "nccl"
    with pytest.raises(PlanError, match="every stage on a CUDA device"):
        resolve_link("nccl", cpu2, across_hosts=True)
    with pytest.raises(PlanError, match="links CPU stages"):
        resolve_link("gloo", gpu2, across_hosts=True)


def test_an_unreachable_rendezvous_is_one_sentence_within_its_timeout():
    """A stage whose link meets at a tcp:// address where nothing answers gives up after
    connect_s with a sentence naming the address, instead of waiting for the group."""
    port = free_ports("127.0.0.1")[0]   # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(LinkError) as e:
        StageLink("gloo", f"tcp://127.0.0.1:{port}", 1, 2, torch.device("cpu"), connect_s=2)
    took = time.monotonic() - t0
    assert took < 2 + 8, f"took {took:.1f} s"
    assert str(e.value).startswith(f"cannot reach the link's rendezvous at 127.0.0.1:{port} "
                                   f"(nothing answered within 2s); check that the launch"), e.value


def test_a_stage_whose_neighbours_never_come_is_one_sentence_within_the_timeout():
    """The store answers but stage 0 never comes: stage 1 gives up after timeout_s with a
    sentence naming the rendezvous, instead of waiting for ever."""
    store = host_rendezvous("127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(LinkError) as e:
        StageLink("gloo", f"tcp://127.0.0.1:{store.port}", 1, 2, torch.device("cpu"),
                  timeout_s=2)
    took = time.monotonic() - t0
    assert took < 2 + 8, f"took {took:.1f} s"
    assert str(e.value).startswith(f"the stages of the link did not all meet at "
                                   f"127.0.0.1:{store.port} within 2s ("), e.value
    assert str(e.value).endswith("the launch or another stage has failed: their logs say why")
