"""Batch slots and groups on the real SmolLM2: every request gets exactly its solo tokens.

"Alone" is computed once (2 stages, one request at a time) and every batched run, with 2 or 3
stages, batch 4 or 8, groups 1, 2 or auto, greedy or seeded, is compared with it token by token.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from strata.coordinator.sampling import SamplingParams
from strata.coordinator.scheduler import Scheduler, SchedulerConfig, auto_groups
from strata.bench import harness
from strata.launch.plan import plan_stages
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer

CTX = 512
N_REQUESTS = 8
N_TOKENS = 24
SPLITS = {2: "15", 3: "10,20"}


@pytest.fixture(scope="module")
def model(smollm2):
    file = ModelFile(smollm2)
    return file, Tokenizer.from_gguf(file.reader)


@pytest.fixture(scope="module")
def prompts(model):
    _, tok = model
    return [tok.encode(p) for p in harness.prompt_set(N_REQUESTS)]


def params_for(mode: str, n: int = N_REQUESTS, tokens: int = N_TOKENS):
    return [harness.request_params(i, mode == "seeded", tokens) for i in range(n)]


def launched(file, split, slots):
    plan = plan_stages(split, ["cpu"], file.config.n_layers)
    return launch_stages(file, plan, slots=slots, ctx=CTX, say=lambda s: None)


@pytest.fixture(scope="module")
def alone(model, prompts):
    """Each request alone: 2 stages, one slot, one request at a time."""
    file, tok = model
    cfg = SchedulerConfig(slots=1, groups=1, ctx=CTX)
    with launched(file, SPLITS[2], 1) as run:
        return {mode: [r.seq.generated for r in
                       harness.run_alone(run, cfg, tok, prompts, params_for(mode))]
                for mode in ("greedy", "seeded")}


def assert_same(alone_tokens, requests, label):
    for i, (want, req) in enumerate(zip(alone_tokens, requests)):
        at = harness.first_mismatch(want, req.seq.generated)
        assert at is None, (f"{label}: request {i} differs at token {at}: alone "
                            f"{want[at:at + 4]}, together {req.seq.generated[at:at + 4]}")


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("batch", [4, 8])
def test_batched_equals_alone(model, prompts, alone, stages, batch):
    file, tok = model
    with launched(file, SPLITS[stages], batch) as run:
        for groups in sorted({1, 2, auto_groups(batch, stages)}):
            cfg = SchedulerConfig(slots=batch, groups=groups, ctx=CTX)
            for mode in ("greedy", "seeded"):
                got = harness.run_together(run, cfg, tok, prompts, params_for(mode))
                assert_same(alone[mode], got, f"{stages} stages, batch {batch}, groups {groups}, "
                                              f"{mode}")
    assert any(len(t) == N_TOKENS for t in alone["greedy"])  # the comparison saw real output


@pytest.mark.slow
def test_staggered_lifecycle(model, prompts, alone):
    """A long prompt admitted while 3 slots decode, one request cancelled and its slot reused,
    one finishing early; pipelined over 3 stages."""
    file, tok = model
    long_prompt = tok.encode(harness.PROMPTS[12] * 4)  # ~12 chunks of 32
    assert len(long_prompt) > 300
    seeded = params_for("seeded")
    with launched(file, SPLITS[3], 4) as run:
        sched = Scheduler(run.pipe, SchedulerConfig(slots=4, groups=2, ctx=CTX), tok.stop_ids,
                          tok.decode)
        a, b, c = (sched.submit(prompts[i], seeded[i]) for i in range(3))
        while min(len(r.seq.generated) for r in (a, b, c)) < 3:
            sched.step()
        long_req = sched.submit(long_prompt, SamplingParams(max_tokens=8))
        a_before, a_when_read = len(a.seq.generated), None
        early = None
        while not long_req.done:
            sched.step()
            if len(b.seq.generated) >= 6 and not b.cancelled:
                sched.cancel(b)      # b's slot is freed at its next window...
                early = sched.submit(prompts[4], replace(seeded[4], max_tokens=3))  # ...reused
            if a_when_read is None and long_req.seq.generated:
                a_when_read = len(a.seq.generated)
        # a kept decoding while the long prompt was read: the long prompt joins the group with
        # fewer busy slots (b's; c joined a's), and a's group runs its windows between its chunks
        assert a_when_read - a_before >= 5
        sched.run()
        alone_long = Scheduler(run.pipe, SchedulerConfig(slots=4, groups=1, ctx=CTX),
                               tok.stop_ids, tok.decode)
        ref_long = alone_long.submit(long_prompt, SamplingParams(max_tokens=8))
        alone_long.run()
    assert b.seq.finish_reason == "cancelled"
    assert b.seq.generated == alone["seeded"][1][:len(b.seq.generated)]
    assert early.slot is b.slot  # the only slot free when it arrived
    assert early.seq.finish_reason == "length" and len(early.seq.generated) == 3
    assert early.seq.generated == alone["seeded"][4][:3]
    assert a.seq.generated == alone["seeded"][0]
    assert c.seq.generated == alone["seeded"][2]
    assert long_req.seq.generated == ref_long.seq.generated
    assert sched.idle


@pytest.mark.slow
def test_32_requests_through_4_slots(model):
    """32 requests x 128 tokens through 4 slots (pipelined), against each alone: the alone
    side is up to 4096 serial windows, the longest case of the suite (~5 minutes)."""
    file, tok = model
    texts = harness.prompt_set(32)
    prompts = [tok.encode(t) for t in texts]
    params = [harness.request_params(i, i % 2 == 1, 128) for i in range(32)]
    with launched(file, SPLITS[2], 4) as run:
        together = harness.run_together(run, SchedulerConfig(slots=4, groups=2, ctx=CTX), tok,
                                        prompts, params)
        alone = harness.run_alone(run, SchedulerConfig(slots=4, groups=1, ctx=CTX), tok,
                                  prompts, params)
    assert_same([r.seq.generated for r in alone], together, "32 requests through 4 slots")
    assert all(r.seq.finish_reason in ("stop", "length") for r in together)
    assert sum(len(r.seq.generated) for r in together) > 32 * 64  # most ran long


def test_multi_turn_reuses_the_slot_and_equals_a_fresh_read(model, caplog):
    file, tok = model
    turn1 = tok.render_chat([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(max_tokens=12)
    with launched(file, SPLITS[2], 2) as run:
        sched = Scheduler(run.pipe, SchedulerConfig(slots=2, groups=2, ctx=CTX), tok.stop_ids,
                          tok.decode)
        first = sched.submit(tok.encode(turn1), params)
        sched.run()
        history = tok.encode(turn1) + first.seq.generated + tok.encode(
            "<|im_end|>\n<|im_start|>user\nAnd another one?<|im_end|>\n<|im_start|>assistant\n")
        with caplog.at_level(logging.INFO, logger="strata.scheduler"):
            second = sched.submit(history, params)
            sched.run()
        fresh_sched = Scheduler(run.pipe, SchedulerConfig(slots=2, groups=1, ctx=CTX),
                                tok.stop_ids, tok.decode)
        fresh = fresh_sched.submit(history, params)
        fresh_sched.run()
    assert second.slot is first.slot
    assert second.reused == len(tok.encode(turn1))  # the prompt of turn 1, not its answer
    assert f"reuses {second.reused} of {len(history)} prompt tokens" in caplog.text
    assert fresh.reused == 0
    assert second.seq.generated == fresh.seq.generated
    assert len(second.seq.generated) > 0


def test_groups_must_divide_batch():
    with pytest.raises(ValueError, match="does not divide"):
        SchedulerConfig(slots=6, groups=4)
    assert auto_groups(8, 2) == 2 and auto_groups(9, 2) == 1 and auto_groups(6, 4) == 3


@pytest.mark.parametrize("batch,groups,drafts", [(1, 1, 7), (4, 2, 3)])
def test_drafts_give_the_solo_tokens(model, prompts, alone, batch, groups, drafts):
    """Draft tokens (prompt lookup) verified in the windows' spare rows: every request still
    gets its plain solo tokens, greedy and seeded, and some drafts were accepted."""
    file, tok = model
    with launched(file, SPLITS[2], batch) as run:
        cfg = SchedulerConfig(slots=batch, groups=groups, ctx=CTX, draft_tokens=drafts)
        accepted = 0
        for mode in ("greedy", "seeded"):
            got = harness.run_together(run, cfg, tok, prompts, params_for(mode))
            assert_same(alone[mode], got, f"drafts, batch {batch}, groups {groups}, {mode}")
            accepted += sum(r.accepted for r in got)
    assert accepted > 0
