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

from strata.coordinator.sampling import SamplingParams

COMPLETIONS_MAX_TOKENS = 16   # OpenAI's (and vLLM's) default for /v1/completions
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
             404: "invalid_request_error", 405: "invalid_request_error",
             413: "invalid_request_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Parsed:
    chat: bool
    prompt: list[int]
    params: SamplingParams      # with a concrete seed
    stream: bool
    include_usage: bool


# --- fields -----------------------------------------------------------------------------------

def _kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def _wrong_type(name: str, want: str, v, example: str) -> ApiError:
    shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
    return ApiError(400, f"'{name}' must be {want}, not {_kind(v)} ({shown}); e.g. "
                         f"\"{name}\": {example}", name, "invalid_type")


def _number(body: dict, name: str, default: float, example: str) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _wrong_type(name, "a number", v, example)
    return float(v)


def _integer(body: dict, name: str, default: int | None, example: str) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _wrong_type(name, "an integer", v, example)
    return v


def _boolean(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _wrong_type(name, "a boolean", v, "true")
    return v


def _bad(name: str, message: str) -> ApiError:
    return ApiError(400, message, name, "invalid_value")


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Fields strata cannot honour yet: refused, never silently ignored."""
    n = _integer(body, "n", 1, "1")
    if n != 1:
        raise _bad("n", f"n={n} is not supported: strata returns one choice per request; send "
                        f"{n} requests instead (give each its own seed for different samples)")
    best_of = _integer(body, "best_of", 1, "1")
    if best_of != 1:
        raise _bad("best_of", f"best_of={best_of} is not supported; remove 'best_of'")
    lp = body.get("logprobs")
    if lp not in (None, False) or body.get("top_logprobs") not in (None, 0):
        name = "logprobs" if lp not in (None, False) else "top_logprobs"
        raise _bad(name, "logprobs are not supported yet (the last stage returns token ids "
                         "only); remove 'logprobs' and 'top_logprobs' from the request")
    if not chat and _boolean(body, "echo", False):
        raise _bad("echo", "echo is not supported; remove 'echo' (the prompt is yours already)")
    if not chat and body.get("suffix") not in (None, ""):
        raise _bad("suffix", "suffix (fill-in-the-middle) is not supported; remove 'suffix'")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, "0") != 0:
            raise _bad(name, f"{name} is not supported; remove it or set it to 0")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "logit_bias is not supported; remove 'logit_bias'")
    if chat and (body.get("tools") or body.get("functions")):
        name = "tools" if body.get("tools") else "functions"
        raise _bad(name, f"'{name}' (function calling) is not supported; remove it")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format", "only response_format {\"type\": \"text\"} is supported; "
                                      "remove 'response_format'")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _wrong_type("stop", "a string or an array of strings", v, "[\"\\n\\n\"]")
    if any(s == "" for s in stops):
        raise _bad("stop", "a stop string is empty (it would end every answer at once); remove "
                           "it")
    return tuple(stops)


def _sampling(body: dict, max_tokens: int) -> SamplingParams:
    temperature = _number(body, "temperature", 0.0, "0.7")
    if temperature < 0:
        raise _bad("temperature", f"temperature {temperature:g} is below 0; use 0 for greedy "
                                  f"or a positive value such as 0.7")
    top_p = _number(body, "top_p", 1.0, "0.9")
    if not 0 < top_p <= 1:
        raise _bad("top_p", f"top_p {top_p:g} is outside (0, 1]; use 1 to turn it off, or a "
                            f"value such as 0.9")
    top_k = _integer(body, "top_k", 0, "40")
    if top_k < 0:
        if top_k != -1:
            raise _bad("top_k", f"top_k {top_k} is below 0; use 0 (or -1) to turn it off")
        top_k = 0  # vLLM's spelling of "off"
    min_p = _number(body, "min_p", 0.0, "0.05")
    if not 0 <= min_p <= 1:
        raise _bad("min_p", f"min_p {min_p:g} is outside [0, 1]; use 0 to turn it off")
    seed = _integer(body, "seed", None, "1234")
    if seed is not None and not 0 <= seed < 2**64:
        raise _bad("seed", f"seed {seed} is outside [0, 2**64); use a non-negative integer")
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          seed=seed, max_tokens=max_tokens, stop=_stop(body)).with_seed()


# --- prompts ----------------------------------------------------------------------------------

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
            raise _bad("prompt", "the prompt is empty; give at least one character of text")
        return encode(p)
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not p:
            raise _bad("prompt", "the prompt is empty; give at least one token")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise _bad("prompt", f"'prompt' holds {len(p)} prompts; strata takes one per request, "
                             f"so send them as {len(p)} requests")
    raise _wrong_type("prompt", "a string or an array of token ids", p, "\"Once upon a time\"")


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
                kind = part.get("type") if isinstance(part, dict) else _kind(part)
                raise _bad(f"messages[{i}].content", f"messages[{i}] has a content part of type "
                                                     f"{kind!r}; strata reads text parts only "
                                                     f"({{\"type\": \"text\", \"text\": ...}})")
            texts.append(part["text"])
        return "".join(texts)
    raise _wrong_type(f"messages[{i}].content", "a string or an array of text parts", c,
                      "\"Hello\"")


def chat_prompt(body: dict, render_chat, encode) -> list[int]:
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "'messages' is missing; give the conversation, e.g. \"messages\": "
                            "[{\"role\": \"user\", \"content\": \"Hello\"}]", "messages",
                       "missing_required_parameter")
    if not isinstance(msgs, list):
        raise _wrong_type("messages", "an array of messages", msgs,
                          "[{\"role\": \"user\", \"content\": \"Hello\"}]")
    if not msgs:
        raise _bad("messages", "'messages' is empty; give at least one message")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _wrong_type(f"messages[{i}]", "an object", m,
                              "{\"role\": \"user\", \"content\": \"Hello\"}")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}] has role {role!r}; use one of "
                                              f"{', '.join(ROLES)}")
        clean.append({"role": "system" if role == "developer" else role,
                      "content": _content(i, m)})
    if all(not m["content"] for m in clean):
        raise _bad("messages", "every message is empty; give some text to answer")
    try:
        text = render_chat(clean)
    except Exception as e:  # the model's template refuses (e.g. roles must alternate)
        raise _bad("messages", f"the model's chat template refused these messages: {e}") from e
    return encode(text)


def parse(body, *, chat: bool, encode, render_chat, vocab: int, ctx: int) -> Parsed:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {_kind(body)}")
    _refuse_unsupported(body, chat)
    stream = _boolean(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _wrong_type("stream_options", "an object", opts, "{\"include_usage\": true}")
    include_usage = stream and _boolean(opts or {}, "include_usage", False)
    prompt = chat_prompt(body, render_chat, encode) if chat else \
        completion_prompt(body, encode, vocab)
    if len(prompt) >= ctx:
        raise _bad("messages" if chat else "prompt",
                   f"the prompt has {len(prompt)} tokens, which leaves no room to generate in "
                   f"this server's context of {ctx}; shorten it, or start strata-launch with a "
                   f"larger --ctx-size")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _integer(body, name, None, "64")
    if max_tokens is None:
        max_tokens = min(COMPLETIONS_MAX_TOKENS, ctx - len(prompt)) if not chat else \
            ctx - len(prompt)
    elif max_tokens < 1:
        raise _bad(name, f"{name} {max_tokens} is below 1; ask for at least one token")
    elif len(prompt) + max_tokens > ctx:
        raise _bad(name, f"this server's context is {ctx} tokens, but {len(prompt) + max_tokens} "
                         f"were requested ({len(prompt)} in the prompt, {max_tokens} for the "
                         f"completion); lower {name} to {ctx - len(prompt)} or less, shorten the "
                         f"prompt, or start strata-launch with a larger --ctx-size")
    return Parsed(chat, prompt, _sampling(body, max_tokens), stream, include_usage)


# --- streamed text ---------------------------------------------------------------------------

class TextStream:
    """Text deltas of a stream, each safe to send: the concatenation of every delta and the
    final one equals the final (stop-cut) text. Held back until the next token: bytes of an
    unfinished UTF-8 character (U+FFFD), and an end of the text that may begin a stop string."""

    def __init__(self, decode, stop: tuple[str, ...]):
        self.decode, self.stop = decode, stop
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
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])),
                   default=0)
        return self._advance(text[:len(text) - hold])

    def finish(self, final: str) -> str:
        return self._advance(final)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):  # decoding is not prefix-stable here: wait
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


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
