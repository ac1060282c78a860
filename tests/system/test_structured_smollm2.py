"""Structured output on the real SmolLM2: JSON schemas, a JSON object, regular expressions and
a choice, greedy and seeded, on chat and completions. Each request alone (one slot of the
session's launch) is the reference; together, in pipelined groups and with lookup drafts on
the same launch, and over HTTP with the official `openai` client on a server whose last stage
drafts with the shipped MTP head (the session's, conftest's smollm2_server), every request gets
exactly its tokens, and every answer that ends parses and validates (json + jsonschema,
re.fullmatch, the choice list)."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from conftest import SMOLLM2_CTX
from strata.coordinator.grammar import Grammars
from strata.coordinator.api.grammar_fields import grammar_request
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.model.tokenizer import Tokenizer

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"}}}
SHORT = {**PERSON, "properties": {**PERSON["properties"],   # the seeded answer: ~35 tokens
                                  "name": {"type": "string", "maxLength": 8},
                                  "city": {"type": "string", "maxLength": 8}}}
MAX_TOKENS = 48

# (chat, prompt, structured output, temperature): the requests, each with seed 100 + index
CASES = [
    (True, "Describe Alice, 30, from Paris, as JSON with name, age and city.",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "person",
                                                                 "schema": PERSON}}}, 0.0),
    (True, "Invent a person and describe them as JSON with name, age and city.",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "person",
                                                                 "schema": SHORT}}}, 0.7),
    (True, "Answer in JSON: what is the capital of France?",
     {"response_format": {"type": "json_object"}}, 0.0),
    (True, "Make up an email address for John at example.com.",
     {"guided_regex": r"[a-z]{1,10}@example\.com"}, 0.0),
    (True, "Which is a fruit: apple, chair or cloud?",
     {"structured_outputs": {"choice": ["apple", "chair", "cloud"]}}, 0.7),
    (False, "My phone number is ", {"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, 0.0),
]


def valid(body: dict, text: str) -> bool:
    if "response_format" in body:
        spec = body["response_format"].get("json_schema", {"schema": {"type": "object"}})
        jsonschema.validate(json.loads(text), spec["schema"])
        return True
    so = body.get("structured_outputs", {})
    if "guided_regex" in body or "regex" in so:
        return re.fullmatch(body.get("guided_regex") or so["regex"], text) is not None
    return text in so["choice"]


@pytest.fixture(scope="module")
def structured_alone(smollm2_stages):
    """(tokenizer, prompts, each request alone on the session's launch)."""
    tok = Tokenizer.from_gguf(smollm2_stages.file.reader)
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": text}]) if chat else text)
               for chat, text, _, _ in CASES]
    alone = [run(smollm2_stages, tok, [i], prompts, SchedulerConfig(slots=1, ctx=SMOLLM2_CTX))[0]
             for i in range(len(CASES))]
    return tok, prompts, alone


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=CASES[i][3], seed=100 + i, max_tokens=MAX_TOKENS)


def run(launch, tok, which: list[int], prompts, cfg: SchedulerConfig) -> list:
    grammars = Grammars(tok, launch.file.config.vocab)
    sched = Scheduler(launch.pipe, cfg, tok.stop_ids, tok.decode)
    reqs = [sched.submit(prompts[i], params(i),
                         grammar=grammars.compile(grammar_request(CASES[i][2]).grammar))
            for i in which]
    sched.run()
    return reqs


@pytest.mark.slow
def test_each_answer_follows_its_grammar_alone_together_and_pipelined(
        smollm2_stages, structured_alone):
    tok, prompts, alone = structured_alone
    assert all(r.seq.finish_reason == "stop" and r.error is None for r in alone), \
        [(r.seq.finish_reason, tok.decode(r.seq.generated)) for r in alone]
    for r, (_, _, body, _) in zip(alone, CASES):
        assert valid(body, r.seq.final_text()), r.seq.final_text()
    every = list(range(len(CASES)))
    # together in one group with lookup drafts; in two pipelined groups (MTP drafts: below)
    for cfg in (SchedulerConfig(slots=4, ctx=SMOLLM2_CTX, draft_tokens=3, drafter="lookup"),
                SchedulerConfig(slots=4, groups=2, ctx=SMOLLM2_CTX)):
        reqs = run(smollm2_stages, tok, every, prompts, cfg)
        assert [r.seq.generated for r in reqs] == [r.seq.generated for r in alone], cfg
        if cfg.draft_tokens:
            assert sum(r.drafts.counts.accepted for r in reqs) > 0


@pytest.fixture(scope="module")
def served(smollm2_server):
    """The session's SmolLM2 server (conftest: 2 stages, 4 slots in 2 groups, MTP drafts)."""
    return smollm2_server


def ask(client: openai.OpenAI, i: int) -> str:
    chat, text, body, temperature = CASES[i]
    common = dict(model="smollm2-135m", max_tokens=MAX_TOKENS, temperature=temperature,
                  seed=100 + i)
    if "response_format" in body:   # the client's own parameter
        common["response_format"] = body["response_format"]
    else:
        common["extra_body"] = body
    if chat:
        out = client.chat.completions.create(messages=[{"role": "user", "content": text}],
                                             **common)
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].message.content
    out = client.completions.create(prompt=text, **common)
    assert out.choices[0].finish_reason == "stop"
    return out.choices[0].text


@pytest.mark.slow
def test_http_with_mtp_drafts_gives_each_request_its_tokens_alone(served, structured_alone):
    tok, _, alone = structured_alone
    client = served.client()
    before = served.wait_idle()["drafts"]   # the server's counts since it started
    with ThreadPoolExecutor(len(CASES)) as pool:
        texts = list(pool.map(lambda i: ask(client, i), range(len(CASES))))
    assert texts == [r.seq.final_text() for r in alone]
    drafts = served.wait_idle()["drafts"]
    assert drafts["proposed"] > before["proposed"] and drafts["accepted"] > before["accepted"], \
        (before, drafts)
    # a schema or a regex that cannot be used, one too large for llguidance to follow, one
    # that accepts no text: a 400 naming the field, no library internals, while a canary
    # request decodes beside them and keeps its text alone
    with ThreadPoolExecutor(1) as pool:
        canary = pool.submit(ask, client, 3)
        for kwargs, param in (
                (dict(response_format={"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "objekt"}}}),
                 "response_format.json_schema.schema"),
                (dict(extra_body={"guided_regex": "a(b"}), "guided_regex"),
                (dict(extra_body={"guided_regex": "(a{1000}){1000}"}), "guided_regex"),
                (dict(extra_body={"guided_grammar": 'root ::= root "x"'}), "guided_grammar")):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="smollm2-135m", max_tokens=4,
                                               messages=[{"role": "user", "content": "Hi"}],
                                               **kwargs)
            message = e.value.body["message"]
            assert e.value.body["param"] == param and "cannot be used" in message
            assert "<state>" not in message and "\n" not in message
        assert canary.result() == alone[3].seq.final_text()
