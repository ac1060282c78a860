"""Several choices in one request (n > 1, a list of prompts): each choice, read through the
server's own path (openai_api.parse, choices.Choices on an Engine), has token for token what
the same prompt gets alone with the choice's derived seed (seed + j, wrapping at 2**64), whole
and streamed. On the varied tiny model (conftest), whose sampled texts differ by seed, on two
real CPU stages with 4 slots, so that 6 choices take turns.
"""
from __future__ import annotations

import asyncio

import pytest

from strata.bench import harness
from strata.coordinator.api import openai_api as api
from strata.coordinator.api.choices import Choices
from strata.coordinator.engine.engine import Engine
from strata.coordinator.api.openai_logprobs import Spelling
from strata.coordinator.api.prompts import Prompts
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import SchedulerConfig

CTX = 128
SLOTS = 4


@pytest.fixture(scope="module")
def launch(varied_model):
    from strata.launch.plan import plan_stages
    from strata.launch.session import launch_stages
    from strata.model.gguf_file import ModelFile
    from strata.model.tokenizer import Tokenizer

    file = ModelFile(varied_model)
    tok = Tokenizer.from_gguf(file.reader)
    plan = plan_stages("2", ["cpu"], file.config.n_layers)
    with launch_stages(file, plan, slots=SLOTS, ctx=CTX, say=lambda s: None) as run:
        yield run, tok, Prompts(tok, file.config.vocab, CTX)


def serve_choices(run, tok, p: api.Parsed, stream: bool):
    """The choices' Finished events (whole) or chunks (stream), from an engine of SLOTS slots."""
    async def main():
        engine = Engine(run.pipe, SchedulerConfig(slots=SLOTS, ctx=CTX), tok.stop_ids,
                        tok.decode)
        engine.start()
        try:
            choices = Choices(engine, "cmpl-test", p)
            choices.submit()
            if not stream:
                return await choices.whole()
            chunks = []

            async def send(obj):
                chunks.append(obj)
            await choices.stream(send, tok.decode, Spelling(tok), "varied", log=None)
            return chunks
        finally:
            engine.stop()
    return asyncio.run(main())


def alone(run, tok, prompt: list[int], params: SamplingParams) -> list[int]:
    [req] = harness.run_alone(run, SchedulerConfig(slots=1, ctx=CTX), tok, [prompt], [params])
    return req.seq.generated


SEED = 2**64 - 2   # choice 2 wraps to seed 0


def test_each_choice_is_its_prompt_alone_with_seed_plus_j(launch):
    run, tok, prompts = launch
    body = {"prompt": ["The capital of France is", tok.encode("Once upon a time")], "n": 3,
            "temperature": 1.0, "top_k": 40, "seed": SEED, "max_tokens": 12}
    p = api.parse(body, chat=False, prompts=prompts)
    assert [c.index for c in p.choices] == list(range(6))
    assert [c.params.seed for c in p.choices] == [SEED, SEED + 1, 0] * 2
    assert p.prompt_tokens == sum(len(x) for x in prompts.completion(body))
    ends = serve_choices(run, tok, p, stream=False)
    for c, fin in zip(p.choices, ends):
        want = alone(run, tok, c.prompt, c.params)
        at = harness.first_mismatch(want, fin.generated)
        assert at is None, (f"choice {c.index} differs at token {at}: alone "
                            f"{want[at:at + 4]}, as a choice {fin.generated[at:at + 4]}")
        assert fin.text == tok.decode(want) or fin.reason == "stop"
    # the seeds matter: the three choices of a prompt are three different texts
    assert len({tuple(f.generated) for f in ends[:3]}) == 3
    assert sum(len(f.generated) for f in ends) >= 40   # real, long texts were compared
    body = api.response("cmpl-test", "varied", p, [(f.text, f.reason, len(f.generated), None)
                                                   for f in ends], 0)
    assert [c["seed"] for c in body["choices"]] == [SEED, SEED + 1, 0] * 2
    assert body["usage"]["completion_tokens"] == sum(len(f.generated) for f in ends)
    assert body["usage"]["prompt_tokens"] == p.prompt_tokens


def test_a_stream_of_choices_gives_each_its_text_by_index(launch):
    run, tok, prompts = launch
    body = {"messages": [{"role": "user", "content": "Hi there"}], "n": 3, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.9, "seed": 11,
            "max_tokens": 10}
    p = api.parse(body, chat=True, prompts=prompts)
    chunks = serve_choices(run, tok, p, stream=True)
    texts, finishes, roles = {}, {}, []
    for ch in chunks[:-1]:
        [c] = ch["choices"]
        if c["delta"].get("role"):
            roles.append(c["index"])
        texts[c["index"]] = texts.get(c["index"], "") + c["delta"].get("content", "")
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    assert roles == [0, 1, 2] and set(finishes) == {0, 1, 2}
    generated = 0
    for c in p.choices:
        want = alone(run, tok, c.prompt, c.params)
        generated += len(want)
        assert texts[c.index] == tok.decode(want), c.index
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == api.usage(p.prompt_tokens,
                                                                             generated)


def test_greedy_choices_are_the_same_text(launch):
    """n > 1 without a temperature: the seed draws nothing, so every choice is the greedy one."""
    run, tok, prompts = launch
    p = api.parse({"prompt": "Hello", "n": 2, "max_tokens": 8}, chat=False, prompts=prompts)
    a, b = serve_choices(run, tok, p, stream=False)
    assert a.generated == b.generated == alone(run, tok, p.choices[0].prompt,
                                               SamplingParams(max_tokens=8))
