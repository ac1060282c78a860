"""Decoding ahead through a real stage process (CPU, one stage, the varied model): requests
batched with decode windows sent ahead give their tokens alone without it, greedy and seeded,
with arrivals while others decode, a cancel and a stop string; and strata-launch turns it on
where it can (one stage, one group, no drafts)."""
from __future__ import annotations

import pytest

from strata.bench import harness
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.coordinator.sampling_params import SamplingParams
from strata.launch.options import prepare
from strata.launch.plan import plan_stages
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer

CTX = 256
TOKENS = 20


@pytest.fixture(scope="module")
def one_stage(varied_model):
    file = ModelFile(varied_model)
    plan = plan_stages("auto", ["cpu"], file.config.n_layers)
    assert len(plan) == 1
    with launch_stages(file, plan, slots=4, ctx=CTX, say=lambda s: None) as run:
        yield run, Tokenizer.from_gguf(file.reader)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_batched_ahead_equals_alone(one_stage, seeded, monkeypatch):
    run, tok = one_stage
    prompts = [tok.encode(p) for p in harness.prompt_set(8)]
    params = [harness.request_params(i, seeded, TOKENS) for i in range(8)]
    alone = harness.run_alone(run, SchedulerConfig(slots=1, ctx=CTX), tok, prompts, params)
    sched = Scheduler(run.pipe, SchedulerConfig(slots=4, ctx=CTX, decode_ahead=True),
                      tok.stop_ids, tok.decode)
    ahead = followed(monkeypatch, run.pipe)
    reqs = [sched.submit(prompts[i], params[i]) for i in range(3)]
    while min(len(r.seq.generated) for r in reqs) < 4:   # the rest arrive while these decode
        sched.step()
    reqs += [sched.submit(p, sp) for p, sp in zip(prompts[3:], params[3:])]
    cancelled = reqs[1]
    while len(cancelled.seq.generated) < 8:
        sched.step()
    sched.cancel(cancelled)
    sched.run()
    for i, (a, r) in enumerate(zip(alone, reqs)):
        if r is cancelled:
            assert r.seq.finish_reason == "cancelled"
            assert r.seq.generated == a.seq.generated[:len(r.seq.generated)]
        else:
            assert r.seq.generated == a.seq.generated, i
    assert sum(len(a.seq.generated) for a in alone) > 8 * TOKENS // 2
    assert sched.idle
    assert len(ahead) > TOKENS   # most decode windows went ahead


def followed(monkeypatch, pipe) -> list[int]:
    """The ids of the windows that decode ahead, as the pipeline sends them."""
    ids, submit = [], pipe.submit

    def counting(w):
        if w.follows:
            ids.append(w.id)
        return submit(w)
    monkeypatch.setattr(pipe, "submit", counting)
    return ids


def test_a_stop_string_ends_a_request_decoded_ahead(one_stage, monkeypatch):
    """The row sent ahead of the window whose text holds the stop string is dropped."""
    run, tok = one_stage
    prompt = tok.encode(harness.prompt_set(1)[0])
    free = harness.run_alone(run, SchedulerConfig(slots=1, ctx=CTX), tok, [prompt],
                             [SamplingParams(max_tokens=TOKENS, ignore_eos=True)])[0]
    stop = tok.decode(free.seq.generated[5:7])
    cfg = SchedulerConfig(slots=1, ctx=CTX, decode_ahead=True)
    ahead = followed(monkeypatch, run.pipe)
    for c in (SchedulerConfig(slots=1, ctx=CTX), cfg):
        req = harness.run_together(run, c, tok, [prompt], [SamplingParams(
            max_tokens=TOKENS, ignore_eos=True, stop=[stop])])[0]
        assert req.seq.finish_reason == "stop"
        assert req.seq.final_text() == tok.decode(free.seq.generated).split(stop)[0]
    assert len(ahead) >= 5   # the second run's windows went ahead, the first's did not
    again = harness.run_together(run, cfg, tok, [prompt], [SamplingParams(
        max_tokens=TOKENS, ignore_eos=True)])[0]
    assert again.seq.generated == free.seq.generated   # the slot kept no row decoded ahead


def test_strata_launch_decodes_ahead_where_it_can(varied_model):
    def sched(split: str, **options):
        return prepare(model=str(varied_model), layer_split=split, devices="cpu", ctx_size=64,
                       batch=4, batch_groups=options.pop("groups", "1"), window_rows="auto",
                       chunk_rows="auto", check_memory=False, **options).sched

    assert sched("auto").decode_ahead
    assert not sched("auto", decode_ahead="off").decode_ahead
    assert not sched("2").decode_ahead
    assert not sched("auto", groups="2").decode_ahead
    assert not sched("auto", draft_tokens="2").decode_ahead
