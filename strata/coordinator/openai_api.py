"""OpenAI's HTTP API as strata speaks it: request bodies checked field by field into a prompt
and SamplingParams, and the response, stream chunk and error objects.

Every refusal is an ApiError whose message says what to change; `param` names the field.
Beyond OpenAI's fields, each response and each stream chunk carries `"seed": N`, the seed its
draws used (chosen at random when the request gave none), so any answer can be reproduced.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from strata.coordinator import request_fields as fields
from strata.coordinator.grammar import Constraint, GrammarError, Grammars
from strata.coordinator.grammar_fields import grammar_request, refusal
from strata.coordinator.request_fields import ApiError
from strata.coordinator.sampling import SamplingParams

COMPLETIONS_MAX_TOKENS = 16   # OpenAI's (and vLLM's) default for /v1/completions
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Parsed:
    chat: bool
    prompt: list[int]
    params: SamplingParams      # with a concrete seed
    stream: bool
    include_usage: bool
    grammar: Constraint | None = None   # structured output: the request's own matcher


# --- sampling ---------------------------------------------------------------------------------

TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-6, 100.0   # for a positive temperature (0 is greedy)


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
                stop=fields.stop(body))


# --- prompts ----------------------------------------------------------------------------------

def _checked(encode, ctx: int, longest_token: int, name: str):
    """`encode` for prompt text: refuses what no tokenizer can read, and a text too long for
    the context before the tokenizer spends time on it."""
    def checked(text: str) -> list[int]:
        fields.text(name, text)
        if len(text) >= ctx * longest_token:  # at least len(text) / longest_token tokens
            raise fields.bad(name, f"the prompt has {len(text)} characters, more than this "
                                   f"server's context of {ctx} tokens can hold; shorten it, or "
                                   f"start strata-launch with a larger --ctx-size")
        return encode(text)
    return checked


def completion_prompt(body: dict, encode, vocab: int) -> list[int]:
    """'prompt': a string, or an array of token ids (or one of either, in an array)."""
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError(400, "'prompt' is missing; give the text to continue, e.g. \"prompt\": "
                            "\"Once upon a time\"", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise fields.bad("prompt", "the prompt is empty; give at least one character of "
                                       "text")
        return encode(p)
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not p:
            raise fields.bad("prompt", "the prompt is empty; give at least one token")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise fields.bad("prompt", f"token id {fields.shown(bad[0])} is outside the "
                                       f"vocabulary [0, {vocab})")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise fields.bad("prompt", f"'prompt' holds {len(p)} prompts; strata takes one per "
                                   f"request, so send them as {len(p)} requests")
    raise fields.wrong_type("prompt", "a string or an array of token ids", p,
                            "\"Once upon a time\"")


def _content(i: int, m: dict) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None:
        raise ApiError(400, f"messages[{i}] has no 'content'; give its text", f"messages[{i}]",
                       "invalid_value")
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                kind = fields.shown(part.get("type")) if isinstance(part, dict) else \
                    fields.kind(part)
                raise fields.bad(f"messages[{i}].content",
                                 f"messages[{i}] has a content part of type {kind}; strata "
                                 f"reads text parts only ({{\"type\": \"text\", \"text\": ...}})")
            texts.append(part["text"])
        return "".join(texts)
    raise fields.wrong_type(f"messages[{i}].content", "a string or an array of text parts", c,
                            "\"Hello\"")


def chat_prompt(body: dict, render_chat, encode) -> list[int]:
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "'messages' is missing; give the conversation, e.g. \"messages\": "
                            "[{\"role\": \"user\", \"content\": \"Hello\"}]", "messages",
                       "missing_required_parameter")
    if not isinstance(msgs, list):
        raise fields.wrong_type("messages", "an array of messages", msgs,
                                "[{\"role\": \"user\", \"content\": \"Hello\"}]")
    if not msgs:
        raise fields.bad("messages", "'messages' is empty; give at least one message")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise fields.wrong_type(f"messages[{i}]", "an object", m,
                                    "{\"role\": \"user\", \"content\": \"Hello\"}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise fields.bad(f"messages[{i}].role", f"messages[{i}] has role "
                                                    f"{fields.shown(role)}; use one of "
                                                    f"{', '.join(ROLES)}")
        clean.append({"role": "system" if role == "developer" else role,
                      "content": _content(i, m)})
    if all(not m["content"] for m in clean):
        raise fields.bad("messages", "every message is empty; give some text to answer")
    try:
        text = render_chat(clean)
    except Exception as e:  # the model's template refuses (e.g. roles must alternate)
        raise fields.bad("messages", f"the model's chat template refused these messages: "
                                     f"{e}") from e
    return encode(text)


def parse(body, *, chat: bool, encode, render_chat, vocab: int, ctx: int,
          longest_token: int, grammars: Grammars | None = None) -> Parsed:
    """The request `body` (parsed JSON) checked into a Parsed; every number bounded before the
    prompt is tokenized. `longest_token`: the most characters one token spells. grammars:
    compiles a structured output's grammar (None: such requests are refused)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {fields.kind(body)}; "
                            f"send e.g. {{\"prompt\": \"Hello\"}}")
    fields.refuse_unsupported(body, chat)
    stream = fields.boolean(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise fields.wrong_type("stream_options", "an object", opts, "{\"include_usage\": true}")
    if opts and set(opts) - {"include_usage", "include_obfuscation"}:  # the latter: no-op
        raise fields.bad("stream_options", "stream_options takes only 'include_usage'; remove "
                                           "the rest")
    include_usage = stream and fields.boolean(opts or {}, "include_usage", False)
    knobs = _sampling(body, vocab)
    wanted = grammar_request(body)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = fields.integer(body, name, None, "64", 1, None, "ask for at least one token")
    if max_tokens is not None and max_tokens > ctx:
        raise fields.bad(name, f"{name} is above this server's context of {ctx} tokens; lower "
                               f"{name}, or start strata-launch with a larger --ctx-size")
    where = "messages" if chat else "prompt"
    encode = _checked(encode, ctx, longest_token, where)
    prompt = chat_prompt(body, render_chat, encode) if chat else \
        completion_prompt(body, encode, vocab)
    if len(prompt) >= ctx:
        raise fields.bad(where, f"the prompt has {len(prompt)} tokens, which leaves no room to "
                                f"generate in this server's context of {ctx}; shorten it, or "
                                f"start strata-launch with a larger --ctx-size")
    if max_tokens is None:
        max_tokens = min(COMPLETIONS_MAX_TOKENS, ctx - len(prompt)) if not chat else \
            ctx - len(prompt)
    elif len(prompt) + max_tokens > ctx:
        raise fields.bad(name, f"this server's context is {ctx} tokens, but "
                               f"{len(prompt) + max_tokens} were requested ({len(prompt)} in "
                               f"the prompt, {max_tokens} for the completion); lower {name} to "
                               f"{ctx - len(prompt)} or less, shorten the prompt, or start "
                               f"strata-launch with a larger --ctx-size")
    grammar = None
    if wanted is not None:
        if grammars is None:
            raise fields.bad(wanted.param, f"this server follows no grammars; remove "
                                           f"'{wanted.param.split('.')[0]}'")
        try:
            grammar = grammars.compile(wanted.grammar)
        except GrammarError as e:
            raise refusal(wanted, str(e)) from None
    return Parsed(chat, prompt, SamplingParams(**knobs, max_tokens=max_tokens).with_seed(),
                  stream, include_usage, grammar)


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


def response(job_id: str, model: str, p: Parsed, text: str, finish: str, generated: int,
             created: int) -> dict:
    choice = {"index": 0, "finish_reason": finish, "logprobs": None}
    if p.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": job_id, "object": "chat.completion" if p.chat else "text_completion",
            "created": created, "model": model, "seed": p.params.seed, "choices": [choice],
            "usage": usage(len(p.prompt), generated)}


def chunk(job_id: str, model: str, p: Parsed, created: int, text: str | None = None,
          finish: str | None = None, role: bool = False, usage_of: tuple[int, int] | None = None
          ) -> dict:
    """One stream chunk: a text delta, the finish, or (usage_of) the usage after the finish."""
    out = {"id": job_id, "object": "chat.completion.chunk" if p.chat else "text_completion",
           "created": created, "model": model, "seed": p.params.seed}
    if usage_of is not None:
        out["choices"], out["usage"] = [], usage(*usage_of)
        return out
    if p.chat:
        delta = {"role": "assistant", "content": ""} if role else \
            ({"content": text} if text else {})
        out["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish,
                           "logprobs": None}]
    else:
        out["choices"] = [{"index": 0, "text": text or "", "finish_reason": finish,
                           "logprobs": None}]
    return out


def model_card(model: str, ctx: int, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "strata",
            "max_model_len": ctx}


def now() -> int:
    return int(time.time())
