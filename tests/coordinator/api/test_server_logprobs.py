"""Log-probabilities, echo, penalties and biases over HTTP with the official `openai` client, on
the tiny random model (a server of 2 stages, 4 slots in 2 groups): OpenAI's shapes, whole and
streamed alike; the same numbers for a request alone and among others; each penalty and bias
doing what it says (a bias forcing a token, min_tokens holding back a stop token, ignore_eos,
stop_token_ids, repetition, frequency and presence changing the greedy text); and the same
knobs on `strata-launch --prompt`."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_server import (CTX, TINY_GROUP, Serving,
                         tiny)  # noqa: F401 (a fixture: the tiny model served, for the session)

pytestmark = pytest.mark.xdist_group(TINY_GROUP)   # where test_server's tiny cases run

A, B, EOS = 65, 66, 256   # the tiny model's "A", "B" and end of text
USER = [{"role": "user", "content": "Hello there"}]


def dump(x):
    return x.model_dump(exclude={"id", "created"})


def test_chat_logprobs_whole_and_streamed(tiny):
    c = tiny.client()
    ask = dict(model="tiny", messages=USER, max_tokens=8, temperature=0.9, seed=5, logprobs=True,
               top_logprobs=3)
    whole = c.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.logprob <= tops[0] and (e.logprob < tops[2] or e.token in
                                         [t.token for t in e.top_logprobs])
    streamed = [e for ch in c.chat.completions.create(**ask, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [dump(e) for e in streamed] == [dump(e) for e in content]
    # without logprobs: none
    assert c.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None}
                                     ).choices[0].logprobs is None


def test_completion_logprobs_and_echo(tiny, tiny_tok):
    c = tiny.client()
    prompt = "Once upon a time"
    n_prompt = len(tiny_tok.encode(prompt))
    ask = dict(model="tiny", prompt=prompt, max_tokens=5, logprobs=2, echo=True, seed=3,
               temperature=0.7)
    whole = c.completions.create(**ask)
    choice = whole.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    # each position's top holds the 2 most likely and the chosen token
    assert all(2 <= len(top) <= 3 and tok in top for tok, top in
               zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == choice.text
    chunks = list(c.completions.create(**ask, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == choice.text
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(p, field) for p in parts), []) == getattr(lp, field), field
    # the prompt alone, scored (what lm-evaluation-harness asks for): the same numbers
    scored = c.completions.create(**{**ask, "max_tokens": 0}).choices[0]
    assert scored.text == prompt and scored.finish_reason == "length"
    assert scored.logprobs.token_logprobs == lp.token_logprobs[:n_prompt]
    assert scored.logprobs.tokens == lp.tokens[:n_prompt]
    # echo without logprobs, streamed, with nothing generated
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == prompt
    assert all(ch.choices[0].logprobs is None for ch in chunks)


@pytest.fixture(scope="module")
def tiny_tok(tiny_model):
    from strata.model.gguf_file import ModelFile
    from strata.model.tokenizer import Tokenizer
    return Tokenizer.from_gguf(ModelFile(tiny_model).reader)


REQUESTS = [
    dict(prompt="The sea", max_tokens=12, logprobs=3, repetition_penalty=1.5),
    dict(prompt="A cat", max_tokens=12, logprobs=1, temperature=0.8, seed=9,
         frequency_penalty=1.0, presence_penalty=0.5),
    dict(prompt="Numbers: 1 2 3", max_tokens=12, logprobs=0, logit_bias={str(B): 4},
         min_tokens=4),
    dict(prompt="Hi", max_tokens=12, logprobs=5, echo=True, temperature=0.6, seed=2,
         top_k=20),
]


def _complete(client, r: dict):
    body = dict(r)
    extra = {k: body.pop(k) for k in ("repetition_penalty", "min_tokens", "top_k") if k in body}
    choice = dump(client.completions.create(model="tiny", extra_body=extra, **body).choices[0])
    if "seed" not in r:   # a seed chosen at random, with nothing to draw
        del choice["seed"]
    return choice


def test_logprobs_and_penalties_are_equal_alone_and_batched(tiny):
    c = tiny.client()
    alone = [_complete(c, r) for r in REQUESTS]
    with ThreadPoolExecutor(len(REQUESTS) * 2) as pool:
        together = list(pool.map(lambda r: _complete(c, r), REQUESTS * 2))
    assert together == alone * 2
    assert all(a["logprobs"]["token_logprobs"] for a in alone)


def test_each_choice_carries_the_knobs(tiny, tiny_tok):
    """n=2 of two prompts (text and token ids) with echo, logprobs and penalties: choice
    k * 2 + j is prompt k asked alone with seed + j, text, echo and logprobs alike, whole and
    streamed."""
    c = tiny.client()
    prompts = ["The sea", tiny_tok.encode("A cat")]
    ask = dict(model="tiny", max_tokens=6, logprobs=2, echo=True, temperature=0.9, seed=40,
               presence_penalty=0.5, logit_bias={str(B): 2},
               extra_body={"repetition_penalty": 1.3, "min_tokens": 2})
    whole = c.completions.create(**ask, prompt=prompts, n=2)
    assert [x.index for x in whole.choices] == [0, 1, 2, 3]
    for x in whole.choices:
        k, j = divmod(x.index, 2)
        alone = c.completions.create(**{**ask, "seed": 40 + j}, prompt=prompts[k]).choices[0]
        assert dump(x) == {**dump(alone), "index": x.index}, x.index
    assert whole.choices[1].text.startswith("The sea")
    assert len({x.text for x in whole.choices}) > 1   # the seeds differ
    streamed: dict[int, list] = {}
    for ch in c.completions.create(**ask, prompt=prompts, n=2, stream=True):
        for x in ch.choices:
            streamed.setdefault(x.index, []).append(x)
    for x in whole.choices:
        parts = streamed[x.index]
        assert "".join(p.text for p in parts) == x.text
        assert sum((p.logprobs.tokens for p in parts if p.logprobs), []) == x.logprobs.tokens
        assert sum((p.logprobs.text_offset for p in parts if p.logprobs), []) == \
            x.logprobs.text_offset


def greedy(c, max_tokens: int = 8, **extra) -> tuple[list[str], str]:
    """The tokens (their text) and the finish of a greedy completion of "He"."""
    r = c.completions.create(model="tiny", prompt=[72, 101], max_tokens=max_tokens, logprobs=0,
                             extra_body=extra).choices[0]
    return r.logprobs.tokens, r.finish_reason


def test_penalties_and_biases_do_what_they_say(tiny, tiny_tok):
    c = tiny.client()
    plain, _ = greedy(c)
    a = tiny_tok.decode([A])
    assert greedy(c, logit_bias={str(A): 100}) == ([a] * 8, "length")
    # A ends the text: at once, or after min_tokens tokens held back from it
    assert greedy(c, logit_bias={str(A): 100}, stop_token_ids=[A]) == ([], "stop")
    held, finish = greedy(c, logit_bias={str(A): 100}, stop_token_ids=[A], min_tokens=3)
    assert len(held) == 3 and a not in held and finish == "stop"
    # the end of text, forced: it ends the text, unless ignore_eos
    assert greedy(c, logit_bias={str(EOS): 100}) == ([], "stop")
    assert greedy(c, logit_bias={str(EOS): 100}, ignore_eos=True)[1] == "length"
    assert greedy(c, logit_bias={str(EOS): 100}, min_tokens=2, max_tokens=2)[1] == "length"
    # the tiny model's greedy text repeats itself: each penalty changes it
    assert len(set(plain)) < len(plain)
    for knob in ({"repetition_penalty": 3.0}, {"frequency_penalty": 2.0},
                 {"presence_penalty": 2.0}):
        assert greedy(c, **knob)[0] != plain, knob


def test_strata_launch_takes_the_same_knobs(tiny_model, tmp_path):
    out = subprocess.run([sys.executable, "-m", "strata.launch.cli", "--model", str(tiny_model),
                          "--ctx-size", str(CTX), "--log-dir", str(tmp_path), "--prompt", "Hi",
                          "--max-tokens", "6", "--logit-bias", f"{A}=100", "--stop-token-id",
                          str(A), "--min-tokens", "2", "--repetition-penalty", "1.2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "A" not in out.stdout and "2 generated" in out.stderr and "finish: stop" in out.stderr
    out = subprocess.run([sys.executable, "-m", "strata.launch.cli", "--model", str(tiny_model),
                          "--prompt", "Hi", "--stop-token-id", "999"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "--stop-token-id names token 999" in out.stderr
