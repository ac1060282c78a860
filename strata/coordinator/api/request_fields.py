"""The fields of a completion request body, each read into a bounded value or refused.

Every number is checked at parsing (finite, in range, small enough for a window header), and
every field is either honoured, accepted because its value asks for nothing strata lacks (the
defaults the official `openai` client may send), or refused with a 400 that names it: strata
never ignores a parameter silently.
"""
from __future__ import annotations

import math
import reprlib


class ApiError(Exception):
    """A refusal: OpenAI's error object with a sentence saying what to change."""
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": "server_error" if self.status >= 500 else
                                  "invalid_request_error",
                          "param": self.param, "code": self.code}}

STOP_MAX = 4           # stop strings per request (OpenAI's limit)
STOP_MAX_CHARS = 256   # characters of one stop string

# fields a route reads; the rest of a body must be in NO_OP
HONOURED = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k",
            "min_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "stop_token_ids",
            "logprobs",
            "user", "safety_identifier", "prompt_cache_key",  # identifiers, no effect here
            # structured output (grammar_fields.FIELDS)
            "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "structured_outputs"}
COMPLETIONS = HONOURED | {"prompt", "echo"}
CHAT = HONOURED | {"messages", "max_completion_tokens", "top_logprobs"}

_repr = reprlib.Repr()   # a value as a message shows it: short, however long or deep
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 2, 40, 40, 40
_repr.maxlist = _repr.maxdict = 4
shown = _repr.repr


def _off(*values):
    return lambda v: any(v == x and type(v) is type(x) for x in values)


# field: (the values that ask for nothing, what to do instead). Absent and null always pass.
NO_OP = {
    "best_of": (_off(1), "remove 'best_of'"),
    # completions take logprobs: N; chat takes top_logprobs (with logprobs: true)
    "top_logprobs": (lambda v: False, "/v1/completions takes 'logprobs': N (the top N tokens "
                                      "at each position); remove 'top_logprobs'"),
    "echo": (_off(False), "echo is taken by /v1/completions only; remove it"),
    "suffix": (_off(""), "suffix (fill-in-the-middle) is not supported; remove 'suffix'"),
    "tools": (lambda v: v == [], "function calling is not supported; remove 'tools'"),
    "functions": (lambda v: v == [], "function calling is not supported; remove 'functions'"),
    "tool_choice": (_off("none"), "function calling is not supported; remove 'tool_choice'"),
    "function_call": (_off("none"), "function calling is not supported; remove it"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "remove 'parallel_tool_calls'"),
    "modalities": (lambda v: v == ["text"], "strata answers with text only; remove it"),
    "store": (_off(False), "strata stores nothing; remove 'store'"),
    "metadata": (lambda v: isinstance(v, dict), "'metadata' must be an object; remove it"),
    "service_tier": (_off("auto", "default"), "remove 'service_tier'"),
    "audio": (lambda v: False, "strata answers with text only; remove 'audio'"),
    "prediction": (lambda v: False, "remove 'prediction'"),
    "reasoning_effort": (lambda v: False, "remove 'reasoning_effort'"),
    "verbosity": (lambda v: False, "remove 'verbosity'"),
    "web_search_options": (lambda v: False, "remove 'web_search_options'"),
}


def bad(name: str, message: str) -> ApiError:
    return ApiError(400, message, name, "invalid_value")


def kind(v) -> str:
    return {type(None): "null", bool: "a boolean", int: "an integer", float: "a number",
            str: "a string", list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def wrong_type(name: str, want: str, v, example: str) -> ApiError:
    return ApiError(400, f"'{name}' must be {want}, not {kind(v)} ({shown(v)}); e.g. "
                         f"\"{name}\": {example}", name, "invalid_type")


def refuse_unsupported(body: dict, chat: bool) -> None:
    """Fields strata does not honour: refused unless their value asks for nothing."""
    known = CHAT if chat else COMPLETIONS
    for name, v in body.items():
        if name in known or v is None:
            continue
        if name not in NO_OP:
            raise ApiError(400, f"'{shown(name)[1:-1]}' is not a parameter strata knows or "
                                f"honours; remove it", name[:100], "unknown_parameter")
        asks_nothing, instead = NO_OP[name]
        if not asks_nothing(v):
            raise bad(name, f"{name}={shown(v)} is not supported; {instead}")


def number(body: dict, name: str, default: float, example: str) -> float:
    """A finite number (JSON's NaN and Infinity refused, an integer past float's range too)."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise wrong_type(name, "a number", v, example)
    try:
        v = float(v)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v):
        raise bad(name, f"{name} must be a finite number, not {shown(body[name])}; e.g. "
                        f"\"{name}\": {example}")
    return v


def integer(body: dict, name: str, default: int | None, example: str, low: int,
            high: int | None, why: str) -> int | None:
    """An integer in [low, high] (high None: no bound above); a value outside gets `why`
    (what to send instead)."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise wrong_type(name, "an integer", v, example)
    if v < low:
        raise bad(name, f"{name} {shown(v)} is below {low}; {why}")
    if high is not None and v > high:
        raise bad(name, f"{name} {shown(v)} is above {high}; {why}")
    return v


def boolean(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise wrong_type(name, "a boolean", v, "true")
    return v


def text(name: str, s: str) -> str:
    """A string that can be encoded: JSON can carry a lone surrogate, no tokenizer can."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(name, f"'{name}' holds a lone UTF-16 surrogate ({s[e.start]!r} at character "
                        f"{e.start}), which is not text; send valid Unicode") from None
    return s


def stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise wrong_type("stop", "a string or an array of strings", v, "[\"\\n\\n\"]")
    if len(stops) > STOP_MAX:
        raise bad("stop", f"'stop' holds {len(stops)} strings; give at most {STOP_MAX}")
    for s in stops:
        if s == "":
            raise bad("stop", "a stop string is empty (it would end every answer at once); "
                              "remove it")
        if len(s) > STOP_MAX_CHARS:
            raise bad("stop", f"a stop string has {len(s)} characters; give at most "
                              f"{STOP_MAX_CHARS}")
        text("stop", s)
    return tuple(stops)


def token_id(name: str, v, vocab: int) -> int:
    """A token id of the vocabulary (an integer, or for a JSON object's key its decimal text)."""
    if isinstance(v, str) and len(v) < 20 and v.strip().lstrip("-").isdigit():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise wrong_type(name, "token ids", v, "[2]" if name != "logit_bias" else "{\"2\": -100}")
    if not 0 <= v < vocab:
        raise bad(name, f"token id {shown(v)} in '{name}' is outside the vocabulary [0, {vocab})")
    return v


def logit_bias(body: dict, vocab: int, most: int) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]}, at most `most` entries, in token order."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise wrong_type("logit_bias", "an object of token ids to biases", v, "{\"2\": -100}")
    if len(v) > most:
        raise bad("logit_bias", f"'logit_bias' has {len(v)} entries; give at most {most}")
    out = {}
    for key, b in v.items():
        t = token_id("logit_bias", key, vocab)
        b = number({"logit_bias": b}, "logit_bias", 0.0, "{\"2\": -100}")
        if not -100 <= b <= 100:
            raise bad("logit_bias", f"the bias {b:g} of token {t} is outside [-100, 100]")
        if t in out:
            raise bad("logit_bias", f"token {t} is given twice in 'logit_bias'; give it once")
        out[t] = b
    return tuple(sorted(out.items()))


def stop_token_ids(body: dict, vocab: int, most: int) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list):
        raise wrong_type("stop_token_ids", "an array of token ids", v, "[2]")
    if len(v) > most:
        raise bad("stop_token_ids", f"'stop_token_ids' holds {len(v)} ids; give at most {most}")
    return tuple(sorted({token_id("stop_token_ids", t, vocab) for t in v}))
