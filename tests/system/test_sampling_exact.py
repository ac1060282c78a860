"""Penalties, biases and log-probabilities on the real SmolLM2, through 2 CPU stages whose
last one drafts with the shipped NextN head (the session's launch, conftest's
smollm2_drafting_stages): each request gets the same tokens and the same
log-probability numbers (bit for bit) alone, 4 together in serial windows, in 2 pipelined
groups, and in pipelined groups with 2 MTP drafts a slot (a draft row penalised as if the
drafts before it were kept); the penalties change the text; the log-probabilities agree with
transformers' log_softmax on the same GGUF (fp32) within 1e-3 with the same top 5, and a
multiple-choice set scored from echoed prompts (max_tokens 0) picks transformers' choice on
every item."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from strata.bench import harness
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import SchedulerConfig
from strata.model.tokenizer import Tokenizer

CTX, SLOTS, TOKENS = 512, 4, 12
PARAMS = [
    SamplingParams(max_tokens=TOKENS, repetition_penalty=1.3, logprobs=5),
    SamplingParams(temperature=0.8, top_k=40, seed=11, max_tokens=TOKENS, frequency_penalty=2.0,
                   presence_penalty=1.0, logprobs=5),
    SamplingParams(max_tokens=TOKENS, logit_bias=((28, 5.0), (30, -100.0)), min_tokens=8,
                   frequency_penalty=1.0, logprobs=0),
    SamplingParams(temperature=0.7, top_p=0.9, seed=12, max_tokens=TOKENS,
                   repetition_penalty=1.1, presence_penalty=-0.5, logprobs=3),
]
PLAIN = [SamplingParams(**{k: getattr(p, k) for k in ("temperature", "top_k", "top_p", "seed",
                                                       "max_tokens")}) for p in PARAMS]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def smol(smollm2_drafting_stages):
    run = smollm2_drafting_stages
    assert (run.slots, run.ctx) == (SLOTS, CTX) and run.procs.mtp_head is not None
    tok = Tokenizer.from_gguf(run.file.reader)
    return run, tok, [tok.encode(t) for t in harness.prompt_set(len(PARAMS))]


def answers(reqs) -> list[tuple[list[int], list]]:
    return [(r.seq.generated, r.seq.logprobs) for r in reqs]


@pytest.fixture(scope="module")
def alone(smol):
    run, tok, prompts = smol
    reqs = harness.run_alone(run, SchedulerConfig(slots=1, ctx=CTX), tok, prompts, PARAMS)
    assert all(len(r.seq.logprobs) == len(r.seq.generated) == TOKENS for r in reqs)
    return answers(reqs)


def test_tokens_and_logprobs_are_exact_together_pipelined_and_drafted(smol, alone):
    run, tok, prompts = smol
    configs = {"together": SchedulerConfig(slots=SLOTS, ctx=CTX),
               "pipelined": SchedulerConfig(slots=SLOTS, groups=2, ctx=CTX),
               "pipelined, 2 mtp drafts": SchedulerConfig(slots=SLOTS, groups=2, ctx=CTX,
                                                          draft_tokens=2, drafter="mtp")}
    for label, cfg in configs.items():
        reqs = harness.run_together(run, cfg, tok, prompts, PARAMS)
        for i, (want, got) in enumerate(zip(alone, answers(reqs))):
            assert got == want, (label, i)
        if cfg.draft_tokens:
            assert sum(r.drafts.counts.accepted for r in reqs) > 0, [r.drafts.counts for r in reqs]
    # the penalties and biases change the text (so the comparisons above could fail)
    plain = harness.run_together(run, configs["together"], tok, prompts, PLAIN)
    assert all(p.seq.generated != want[0] for p, want in zip(plain, alone))
    assert 30 not in alone[2][0]   # its bias of -100


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is the distribution of the token at p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)


def test_logprobs_agree_with_transformers(smol, alone, hf_model):
    _, _, prompts = smol
    for prompt, (generated, logprobs), p in zip(prompts, alone, PARAMS):
        ref = hf_logprobs(hf_model, prompt + generated)[len(prompt) - 1:-1]
        for j, (token, got) in enumerate(zip(generated, logprobs)):
            assert got.token == token
            assert abs(got.logprob - ref[j, token].item()) < 1e-3, (j, got.logprob)
            assert len(got.top) == p.logprobs
            if p.logprobs == 5:
                assert {t for t, _ in got.top} == set(ref[j].topk(5).indices.tolist()), j
            for t, lp in got.top:
                assert abs(lp - ref[j, t].item()) < 1e-3


CHOICES = [
    ("The capital of France is", [" Paris", " Berlin", " a banana", " Tokyo"]),
    ("Water freezes at a temperature of zero degrees", [" Celsius", " Kelvin", " elephants",
                                                         " volts"]),
    ("The opposite of hot is", [" cold", " green", " seven", " loud"]),
    ("def add(a, b):\n    return a", [" + b", " - elephant", " ** ** 2", "!!"]),
    ("Monday, Tuesday, Wednesday,", [" Thursday", " March", " purple", " 1999"]),
]


def test_echo_scores_multiple_choice_as_transformers(smol, hf_model):
    """lm-evaluation-harness's loglikelihood: each context + continuation as a prompt of
    token ids, echoed with max_tokens 0; a choice's score is the sum of its continuation
    tokens' log-probabilities."""
    run, tok, _ = smol
    prompts, spans = [], []
    for context, choices in CHOICES:
        ctx = tok.encode(context)
        for choice in choices:
            prompts.append(ctx + tok.encode(choice))
            spans.append(len(ctx))
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=1)
    reqs = harness.run_together(run, SchedulerConfig(slots=SLOTS, groups=2, ctx=CTX), tok,
                                prompts, [scoring] * len(prompts))
    ours, theirs = [], []
    for r, prompt, start in zip(reqs, prompts, spans):
        assert r.seq.finish_reason == "length" and not r.seq.generated
        got = r.seq.prompt_logprobs
        assert got[0] is None and [e.token for e in got[1:]] == prompt[1:]
        ref = hf_logprobs(hf_model, prompt)
        for p in range(1, len(prompt)):
            assert abs(got[p].logprob - ref[p - 1, prompt[p]].item()) < 1e-3, p
        ours.append(sum(e.logprob for e in got[start:]))
        theirs.append(sum(ref[p - 1, prompt[p]].item() for p in range(start, len(prompt))))
    n = len(CHOICES[0][1])
    for i, (context, _) in enumerate(CHOICES):
        pick = lambda scores: max(range(n), key=lambda c: scores[i * n + c])  # noqa: E731
        assert pick(ours) == pick(theirs), context
    # alone, a request scores its prompt with the same numbers as among others
    again = harness.run_alone(run, SchedulerConfig(slots=1, ctx=CTX), tok, prompts[:2],
                              [replace(scoring, prompt_logprobs=3)] * 2)
    for r, first in zip(again, reqs):
        assert [e.logprob for e in r.seq.prompt_logprobs[1:]] == \
            [e.logprob for e in first.seq.prompt_logprobs[1:]]
