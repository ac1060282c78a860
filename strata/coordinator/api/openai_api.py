"""OpenAI's HTTP API as strata speaks it: request bodies checked field by field into choices
(a prompt and SamplingParams each), and the response, stream chunk and error objects.

Every refusal is an ApiError whose message says what to change; `param` names the field.
Beyond OpenAI's fields, each response and each stream chunk carries `"seed": N`, the seed its
draws used (chosen at random when the request gave none), so any answer can be reproduced.
With n > 1, choice j of each prompt draws with seed + j (choice_seed), and each choice of a
whole response carries its own "seed".
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from strata.coordinator.api import request_fields as fields
from strata.coordinator.grammar import Constraint, GrammarError, Grammars
from strata.coordinator.api.grammar_fields import grammar_request, refusal
from strata.coordinator.api.prompts import Prompts
from strata.coordinator.api.request_fields import ApiError
from strata.coordinator.sampling_params import (MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS,
                                         SamplingParams)

COMPLETIONS_MAX_TOKENS = 16   # OpenAI's (and vLLM's) default for /v1/completions
MAX_CHOICES = 128   # n times the prompts, in one request


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice j of n (of each prompt): the request's seed + j, as vLLM derives
    it, so choice j is what the same request with that seed and n=1 gives."""
    return (seed + j) % 2**64


@dataclass(frozen=True)
class Choice:
    index: int                  # prompt k's choice j: k * n + j
    prompt: list[int]
    params: SamplingParams      # with its own seed (choice_seed) and max_tokens
    echo_text: str | None = None   # echo: its prompt's text as given (None: token ids)
    grammar: Constraint | None = None   # structured output: this choice's own matcher


@dataclass(frozen=True)
class Parsed:
    chat: bool
    choices: tuple[Choice, ...]   # by index
    seed: int                     # the request's (choice 0's)
    prompt_tokens: int            # each prompt counted once, however many choices it has
    stream: bool
    include_usage: bool
    echo: bool = False            # completions: each prompt comes before its completions


# --- sampling ---------------------------------------------------------------------------------

TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-6, 100.0   # for a positive temperature (0 is greedy)
REPETITION_MAX = 100.0


def _sampling(body: dict, vocab: int) -> dict:
    """SamplingParams' fields but max_tokens, each bounded."""
    temperature = fields.number(body, "temperature", 0.0, "0.7")
    if temperature < 0:
        raise fields.bad("temperature", f"temperature {temperature:g} is below 0; use 0 for "
                                        f"greedy or a positive value such as 0.7")
    if temperature and not TEMPERATURE_MIN <= temperature <= TEMPERATURE_MAX:
        raise fields.bad("temperature", f"temperature {temperature:g} is outside "
                                        f"[{TEMPERATURE_MIN:g}, {TEMPERATURE_MAX:g}]; use 0 for "
                                        f"greedy or a value such as 0.7")
    top_p = fields.number(body, "top_p", 1.0, "0.9")
    if not 0 < top_p <= 1:
        raise fields.bad("top_p", f"top_p {top_p:g} is outside (0, 1]; use 1 to turn it off, "
                                  f"or a value such as 0.9")
    raw = body.get("top_k")
    top_k = 0 if type(raw) is int and raw == -1 else \
        fields.integer(body, "top_k", 0, "40", 0, None, "use 0 (or -1) to turn it off")
    top_k = min(top_k, vocab)  # -1 is vLLM's "off"; beyond the vocabulary means all of it
    min_p = fields.number(body, "min_p", 0.0, "0.05")
    if not 0 <= min_p <= 1:
        raise fields.bad("min_p", f"min_p {min_p:g} is outside [0, 1]; use 0 to turn it off")
    seed = fields.integer(body, "seed", None, "1234", 0, 2**64 - 1,
                          "use a non-negative integer below 2**64")
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                stop=fields.stop(body), **_penalties(body, vocab))


def _penalties(body: dict, vocab: int) -> dict:
    """SamplingParams' penalties, biases and stop tokens (min_tokens: checked in parse)."""
    out = {}
    for name in ("presence_penalty", "frequency_penalty"):
        out[name] = fields.number(body, name, 0.0, "0.5")
        if not -2 <= out[name] <= 2:
            raise fields.bad(name, f"{name} {out[name]:g} is outside [-2, 2]; use 0 to turn it "
                                   f"off")
    out["repetition_penalty"] = fields.number(body, "repetition_penalty", 1.0, "1.1")
    if not 0 < out["repetition_penalty"] <= REPETITION_MAX:
        raise fields.bad("repetition_penalty", f"repetition_penalty "
                                               f"{out['repetition_penalty']:g} is outside (0, "
                                               f"{REPETITION_MAX:g}]; use 1 to turn it off, or "
                                               f"a value such as 1.1")
    out["logit_bias"] = fields.logit_bias(body, vocab, MAX_LOGIT_BIAS)
    out["ignore_eos"] = fields.boolean(body, "ignore_eos", False)
    out["stop_token_ids"] = fields.stop_token_ids(body, vocab, MAX_STOP_TOKEN_IDS)
    return out


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top tokens to report with each token's log-probability (None: none reported):
    chat's logprobs (a boolean) and top_logprobs, completions' logprobs (a number)."""
    if not chat:
        return fields.integer(body, "logprobs", None, "5", 0, MAX_TOP_LOGPROBS,
                              f"give 0 to {MAX_TOP_LOGPROBS} (the most likely tokens reported "
                              f"at each position), or null for none")
    wanted = fields.boolean(body, "logprobs", False)
    top = fields.integer(body, "top_logprobs", None, "5", 0, MAX_TOP_LOGPROBS,
                         f"give 0 to {MAX_TOP_LOGPROBS}")
    if top and not wanted:
        raise fields.bad("top_logprobs", "top_logprobs needs \"logprobs\": true; add it, or "
                                         "remove top_logprobs")
    return (top or 0) if wanted else None


def _room(length: int, which: str, max_tokens: int | None, name: str, chat: bool,
          ctx: int) -> int:
    """The tokens a choice of a prompt of `length` tokens may generate: max_tokens, if the
    context holds them, else the route's default."""
    where = "messages" if chat else "prompt"
    if length >= ctx:
        raise fields.bad(where, f"{which} has {length} tokens, which leaves no room to generate "
                                f"in this server's context of {ctx}; shorten it, or start "
                                f"strata-launch with a larger --ctx-size")
    if max_tokens is None:
        return ctx - length if chat else min(COMPLETIONS_MAX_TOKENS, ctx - length)
    if length + max_tokens > ctx:
        raise fields.bad(name, f"this server's context is {ctx} tokens, but {length + max_tokens} "
                               f"were requested ({length} in {which}, {max_tokens} for the "
                               f"completion); lower {name} to {ctx - length} or less, shorten "
                               f"the prompt, or start strata-launch with a larger --ctx-size")
    return max_tokens


def parse(body, *, chat: bool, prompts: Prompts, grammars: Grammars | None = None) -> Parsed:
    """The request `body` (parsed JSON) checked into a Parsed; every number bounded before the
    prompts are tokenized. grammars: compiles a structured output's grammar (None: such
    requests are refused)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {fields.kind(body)}; "
                            f"send e.g. {{\"prompt\": \"Hello\"}}")
    fields.refuse_unsupported(body, chat)
    stream = fields.boolean(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise fields.wrong_type("stream_options", "an object", opts, "{\"include_usage\": true}")
    if opts is not None and not stream:
        raise fields.bad("stream_options", "stream_options applies to streamed answers only; "
                                           "remove it, or set \"stream\": true")
    if opts and set(opts) - {"include_usage", "include_obfuscation"}:  # the latter: no-op
        raise fields.bad("stream_options", "stream_options takes only 'include_usage'; remove "
                                           "the rest")
    include_usage = stream and fields.boolean(opts or {}, "include_usage", False)
    knobs = _sampling(body, prompts.vocab)
    wanted = grammar_request(body)
    logprobs = _logprobs(body, chat)
    echo = not chat and fields.boolean(body, "echo", False)
    n = fields.integer(body, "n", 1, "2", 1, MAX_CHOICES,
                       f"ask for 1 to {MAX_CHOICES} choices")
    ctx = prompts.ctx
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = fields.integer(body, name, None, "64", 0 if echo else 1, None,
                                "ask for at least one token" + ("" if chat else
                                                                " (0 only with \"echo\": true)"))
    if max_tokens is not None and max_tokens > ctx:
        raise fields.bad(name, f"{name} is above this server's context of {ctx} tokens; lower "
                               f"{name}, or start strata-launch with a larger --ctx-size")
    ids = [prompts.chat(body)] if chat else prompts.completion(body)
    if len(ids) * n > MAX_CHOICES:
        raise fields.bad("n", f"{len(ids)} prompts with n={n} make {len(ids) * n} choices; "
                              f"ask for at most {MAX_CHOICES} in one request")
    rooms = [_room(len(prompt), f"prompt {k}" if len(ids) > 1 else "the prompt", max_tokens,
                   name, chat, ctx) for k, prompt in enumerate(ids)]
    min_tokens = fields.integer(body, "min_tokens", 0, "4", 0, min(rooms),
                                f"give at most max_tokens ({min(rooms)})")
    given = _given(body["prompt"]) if echo else [None] * len(ids)
    grammar = _compile(wanted, grammars) if wanted is not None else None
    params = SamplingParams(**knobs, logprobs=logprobs).with_seed()
    choices = []
    for k, (prompt, room) in enumerate(zip(ids, rooms)):
        # echo with logprobs scores the prompt too; with max_tokens 0 (the prompt only) it is
        # scored, reported or not
        prompt_logprobs = (logprobs or 0) if echo and (logprobs is not None or not room) \
            else None
        for j in range(n):
            # compiled once; each choice advances a matcher of its own
            own = grammar.copy() if grammar is not None and choices else grammar
            choices.append(Choice(k * n + j, prompt, replace(
                params, max_tokens=room, min_tokens=min_tokens, prompt_logprobs=prompt_logprobs,
                seed=choice_seed(params.seed, j)), given[k], own))
    return Parsed(chat, tuple(choices), params.seed, sum(map(len, ids)), stream, include_usage,
                  echo)


def _given(p) -> list[str | None]:
    """Each prompt's text as given (None: given as token ids), as Prompts.completion reads
    'prompt'."""
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        return [x if isinstance(x, str) else None for x in p]
    return [p if isinstance(p, str) else None]


def _compile(wanted, grammars: Grammars | None) -> Constraint:
    """The structured output's matcher (grammar_fields.GrammarRequest `wanted`)."""
    if grammars is None:
        raise fields.bad(wanted.param, f"this server follows no grammars; remove "
                                       f"'{wanted.param.split('.')[0]}'")
    try:
        return grammars.compile(wanted.grammar, wanted.param)
    except GrammarError as e:
        raise refusal(wanted, str(e)) from None


# --- streamed text ---------------------------------------------------------------------------

class TextStream:
    """Text deltas of a stream, each safe to send: the concatenation of every delta and the
    final one equals the final (stop-cut) text. Held back until the next token: bytes of an
    unfinished UTF-8 character (U+FFFD), and an end of the text that may begin a stop string."""

    def __init__(self, decode, stop: tuple[str, ...]):
        self.decode, self.stop = decode, stop
        self.fail = [_failure_links(s) for s in stop]
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        text = text.rstrip("\ufffd")
        hold = max((_stop_prefix_at_end(text, s, f) for s, f in zip(self.stop, self.fail)),
                   default=0)
        return self._advance(text[:len(text) - hold])

    def finish(self, final: str) -> str:
        return self._advance(final)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):  # decoding is not prefix-stable here: wait
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def _failure_links(s: str) -> list[int]:
    """KMP: fail[i] = length of the longest proper prefix of s[:i + 1] that is also its
    suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


def _stop_prefix_at_end(text: str, stop: str, fail: list[int]) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with, in time linear in
    len(stop): only the last len(stop) - 1 characters of the text can hold it."""
    k = 0
    for c in text[max(0, len(text) - len(stop) + 1):] if len(stop) > 1 else "":
        while k and stop[k] != c:   # k < len(stop) - 1: at most that many characters seen
            k = fail[k - 1]
        if stop[k] == c:
            k += 1
    return k


# --- responses --------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def response(job_id: str, model: str, p: Parsed, ends: list[tuple[str, str, int, dict | None]],
             created: int) -> dict:
    """The whole answer; ends[i]: choice i's (text, finish reason, generated tokens, logprobs
    object). Each choice carries its seed."""
    choices = []
    for c, (text, finish, _, logprobs) in zip(p.choices, ends):
        choice = {"index": c.index, "finish_reason": finish, "logprobs": logprobs,
                  "seed": c.params.seed}
        if p.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choices.append(choice)
    return {"id": job_id, "object": "chat.completion" if p.chat else "text_completion",
            "created": created, "model": model, "seed": p.seed, "choices": choices,
            "usage": usage(p.prompt_tokens, sum(end[2] for end in ends))}


def chunk(job_id: str, model: str, p: Parsed, created: int, index: int = 0,
          text: str | None = None, finish: str | None = None, role: bool = False,
          completion_tokens: int | None = None, logprobs: dict | None = None) -> dict:
    """One stream chunk of choice `index`: a text delta (with its tokens' logprobs object), its
    finish; or (completion_tokens) the usage after every choice's finish."""
    out = {"id": job_id, "object": "chat.completion.chunk" if p.chat else "text_completion",
           "created": created, "model": model, "seed": p.seed}
    if completion_tokens is not None:
        out["choices"], out["usage"] = [], usage(p.prompt_tokens, completion_tokens)
        return out
    if p.chat:
        delta = {"role": "assistant", "content": ""} if role else \
            ({"content": text} if text else {})
        out["choices"] = [{"index": index, "delta": delta, "finish_reason": finish,
                           "logprobs": logprobs}]
    else:
        out["choices"] = [{"index": index, "text": text or "", "finish_reason": finish,
                           "logprobs": logprobs}]
    return out


def model_card(model: str, ctx: int, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "strata",
            "max_model_len": ctx}


def now() -> int:
    return int(time.time())
