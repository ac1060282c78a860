"""MTP drafts through real CPU stages: the last stage's NextN head proposes, the next window
verifies, and every request gets exactly the tokens it gets without drafts, greedy and seeded,
alone and batched, 2 and 3 stages, K = 1 and 3, through a conversation's follow-up turn.

The head is a sidecar made for the tiny model whose proposal is the token it reads (eh_proj
passes the embedding through, the block's output projections are zero, the head is the model's
tied embedding), and the tiny model's greedy text repeats its last token: so most proposals are
accepted, seeded ones partly, and a wrong acceptance or commit would show as a different token.
"""
from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import pytest
from gguf import GGUFReader

from strata.bench import harness
from strata.coordinator.speculation.drafts import DraftCounts
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.launch.plan import plan_stages
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelFile
from strata.model.mkmodel import SHAPES, write_nextn_sidecar, write_random_gguf
from strata.model.tokenizer import Tokenizer

CTX, TOKENS, N = 256, 20, 4


def repeating_head(path, model):
    """A sidecar NextN head for `model` (the tiny shape) that proposes the token it reads."""
    shape = SHAPES["tiny"]
    write_nextn_sidecar(path, model, shape, seed=3, weight_type="F32")
    reader = GGUFReader(path, "r+")
    d = shape.d_model
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name.endswith("nextn.eh_proj.weight"):
            w = np.zeros((d, 2 * d), np.float32)
            w[:, :d] = np.eye(d)                      # [enorm(embedding); hnorm(hidden)] -> e
            data[...] = w.reshape(data.shape)
        elif t.name.endswith(("attn_output.weight", "ffn_down.weight")):
            data[...] = 0                             # the block adds nothing to its input
        elif t.name.endswith("norm.weight"):
            data[...] = 1
    reader.data.flush()
    return path


def markov_target(path):
    """The tiny shape, untied, std 0.2, with every layer's output projections zero and its
    final norm's weight 1: the hidden state of a row is its token's embedding, so the next
    token's distribution, output(rms_norm(emb(t))), depends on the current token t only, and
    is spread (no token dominates at temperature 0.7). The repeating head then computes that
    same distribution: a head that matches its target."""
    write_random_gguf(path, SHAPES["tiny"], seed=5, std=0.2, tied=False)
    reader = GGUFReader(path, "r+")
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name.endswith(("attn_output.weight", "ffn_down.weight")):
            data[...] = 0
        elif t.name == "output_norm.weight":
            data[...] = 1
    reader.data.flush()
    return path


@pytest.fixture(scope="module")
def subject(tiny_model, tmp_path_factory):
    head = repeating_head(tmp_path_factory.mktemp("head") / "head.gguf", tiny_model)
    file = ModelFile(tiny_model)
    tok = Tokenizer.from_gguf(file.reader)
    prompts = [tok.encode(p) for p in harness.prompt_set(N)]
    return file, head, tok, prompts


@pytest.fixture(scope="module")
def launch(subject):
    """split -> the tiny model's stages with the repeating head, launched once for the module
    (each case runs its own schedulers: they hold nothing of another's)."""
    file, head, _, _ = subject
    with ExitStack() as stack:
        runs = {}

        def get(split: str):
            if split not in runs:
                plan = plan_stages(split, ["cpu"], file.config.n_layers)
                runs[split] = stack.enter_context(launch_stages(
                    file, plan, slots=N, ctx=CTX, mtp_head=head, say=lambda s: None))
            return runs[split]
        yield get


def params(mode: str):
    return [harness.request_params(i, mode == "seeded", TOKENS) for i in range(N)]


@pytest.mark.parametrize("split", ["2", "1,3"], ids=["2stages", "3stages"])
def test_mtp_drafts_give_the_tokens_of_plain_decoding(subject, launch, split):
    _, _, tok, prompts = subject
    run = launch(split)
    for mode in ("greedy", "seeded"):
        plain = [r.seq.generated for r in harness.run_alone(
            run, SchedulerConfig(slots=1, ctx=CTX), tok, prompts, params(mode))]
        assert len({tuple(t) for t in plain}) > 1, plain   # the texts differ
        runs = {
            "solo K=1": harness.run_alone(run, SchedulerConfig(
                slots=1, ctx=CTX, draft_tokens=1, drafter="mtp"), tok, prompts, params(mode)),
            "solo K=3": harness.run_alone(run, SchedulerConfig(
                slots=1, ctx=CTX, draft_tokens=3, drafter="mtp"), tok, prompts, params(mode)),
            "batch 4 K=3": harness.run_together(run, SchedulerConfig(
                slots=N, ctx=CTX, draft_tokens=3, drafter="mtp"), tok, prompts,
                params(mode)),
        }
        for label, reqs in runs.items():
            for i, (want, r) in enumerate(zip(plain, reqs)):
                assert r.seq.generated == want, (split, mode, label, i)
            if mode == "greedy":
                counts = sum((r.drafts.counts for r in reqs), DraftCounts())
                assert counts.accepted >= counts.drafted // 2, \
                    (label, [r.drafts.counts for r in reqs])
            assert sum(r.drafts.counts.drafted for r in reqs) > 0, label


def test_follow_up_turn_with_mtp_drafts_equals_a_fresh_read(subject, launch):
    """The conversation cache with drafts on: a follow-up whose prompt begins with the held
    tokens reads only the rest, and gets the tokens of a fresh read without drafts."""
    _, _, tok, prompts = subject
    sp = harness.request_params(0, True, TOKENS)
    run = launch("2")
    mtp = Scheduler(run.pipe, SchedulerConfig(slots=1, ctx=CTX, draft_tokens=3,
                                              drafter="mtp"), tok.stop_ids, tok.decode)
    first = mtp.submit(prompts[0], sp)
    mtp.run()
    follow_up = prompts[0] + first.seq.generated + prompts[1]
    again = mtp.submit(follow_up, sp)
    mtp.run()
    assert again.reused > 0
    plain = Scheduler(run.pipe, SchedulerConfig(slots=1, ctx=CTX), tok.stop_ids, tok.decode)
    fresh = plain.submit(follow_up, sp)   # a new scheduler holds nothing: reads it all
    plain.run()
    assert fresh.reused == 0 and again.seq.generated == fresh.seq.generated


@pytest.fixture(scope="module")
def markov(tmp_path_factory):
    d = tmp_path_factory.mktemp("markov")
    target = markov_target(d / "markov.gguf")
    head = repeating_head(d / "head.gguf", target)
    file = ModelFile(target)
    tok = Tokenizer.from_gguf(file.reader)
    return file, head, tok, [tok.encode(p) for p in harness.prompt_set(N)]


def test_coupled_proposals_are_kept_far_more_often_than_argmax_ones(markov):
    """Temperature 0.7, 2 stages, batch 4, K = 1 and 3: MTP with coupled proposals and with
    argmax ones gives every request the tokens of plain decoding. On a head whose
    distribution is its target's, the coupled first proposal is the target's own draw (kept
    nearly always), while an argmax proposal is kept only when the draw happens to pick the
    most likely token."""
    file, head, tok, prompts = markov
    plan = plan_stages("2", ["cpu"], file.config.n_layers)
    ps = params("seeded")
    with launch_stages(file, plan, slots=N, ctx=CTX, mtp_head=head, say=lambda s: None) as run:
        plain = [r.seq.generated for r in harness.run_alone(
            run, SchedulerConfig(slots=1, ctx=CTX), tok, prompts, ps)]
        first: dict[tuple[int, str], float] = {}
        for k in (1, 3):
            for sampling in ("coupled", "argmax"):
                reqs = harness.run_together(run, SchedulerConfig(
                    slots=N, ctx=CTX, draft_tokens=k, drafter="mtp", draft_sampling=sampling),
                    tok, prompts, ps)
                assert [r.seq.generated for r in reqs] == plain, (k, sampling)
                counts = sum((r.drafts.counts for r in reqs), DraftCounts())
                drafted = counts.drafted_at[0]
                assert drafted >= N * 3, (k, sampling, drafted)
                first[k, sampling] = (counts.accepted_at or [0])[0] / drafted
    for k in (1, 3):
        assert first[k, "coupled"] >= 0.9 and first[k, "argmax"] <= 0.6, first
