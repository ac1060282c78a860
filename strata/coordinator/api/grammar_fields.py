"""The request fields that ask for structured output, read into one llguidance grammar.

OpenAI's shape, on chat and completions alike:
    "response_format": {"type": "text" | "json_object" | "json_schema",
                        "json_schema": {"name": ..., "schema": {...}, "strict": ...,
                                        "description": ...}}
vLLM's shapes, older and newer:
    "guided_json": SCHEMA, "guided_regex": RE, "guided_choice": [STR, ...], "guided_grammar": G
    "structured_outputs": {"json": SCHEMA | "regex": RE | "choice": [...] | "grammar": G
                           | "json_object": true, "disable_any_whitespace": bool,
                           "whitespace_pattern": RE}
A schema is an object or its JSON text; a grammar is Lark (llguidance's syntax) or GBNF
(llama.cpp's); a regex is Rust's `regex` syntax and must match the whole output. A request
gives at most one of them. Each is only read here (bounded, typed); grammar.py compiles it, and
a grammar the library refuses is a 400 with its sentence (openai_api.parse).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from strata.coordinator.api.request_fields import ApiError, bad, shown, wrong_type

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "structured_outputs")
CHOICES_MAX = 1024        # strings of one choice
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object"}
WHITESPACE_KEYS = {"disable_any_whitespace", "whitespace_pattern"}


@dataclass(frozen=True)
class GrammarRequest:
    param: str      # the field it came from, as a refusal names it
    kind: str       # json | regex | choice | grammar
    grammar: str    # llguidance's grammar text (LLMatcher.grammar_from_*)


def grammar_request(body: dict) -> GrammarRequest | None:
    """The request's structured output, or None (none asked, or response_format text)."""
    asked = [(name, body[name]) for name in FIELDS if body.get(name) is not None]
    asked = [(name, v) for name, v in asked if not _plain_text(name, v)]
    if len(asked) > 1:
        names = " and ".join(f"'{name}'" for name, _ in asked)
        raise bad(asked[1][0], f"{names} each ask for structured output; give one of them")
    if not asked:
        return None
    name, v = asked[0]
    if name == "response_format":
        return _response_format(v)
    if name == "structured_outputs":
        return _structured_outputs(v)
    kind = name.removeprefix("guided_")
    return _grammar(name, kind, v, {})


def _plain_text(name: str, v) -> bool:
    """response_format {"type": "text"}: asks for nothing."""
    if name != "response_format" or not isinstance(v, dict) or v.get("type") != "text":
        return False
    _only(name, v, {"type"})
    return True


def _response_format(v) -> GrammarRequest:
    name = "response_format"
    if not isinstance(v, dict):
        raise wrong_type(name, "an object", v, "{\"type\": \"json_object\"}")
    kind = v.get("type")
    if kind == "json_object":
        _only(name, v, {"type"})
        return _grammar(name, "json", {"type": "object"}, {})
    if kind == "json_schema":
        _only(name, v, {"type", "json_schema"})
        spec = v.get("json_schema")
        where = f"{name}.json_schema"
        if not isinstance(spec, dict):
            raise wrong_type(where, "an object", spec,
                             "{\"name\": \"person\", \"schema\": {\"type\": \"object\"}}")
        _only(where, spec, JSON_SCHEMA_KEYS)
        if spec.get("schema") is None:
            raise bad(where, f"{where} has no 'schema'; give the JSON schema the answer must "
                             f"follow, e.g. \"schema\": {{\"type\": \"object\"}}")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise wrong_type(f"{where}.strict", "a boolean", spec["strict"], "true")
        return _grammar(f"{where}.schema", "json", spec["schema"], {})
    raise bad(name, f"response_format type {shown(kind)} is not one strata knows; use "
                    f"\"text\", \"json_object\" or \"json_schema\"")


def _structured_outputs(v) -> GrammarRequest:
    name = "structured_outputs"
    if not isinstance(v, dict):
        raise wrong_type(name, "an object", v, "{\"regex\": \"[0-9]+\"}")
    _only(name, v, STRUCTURED_KEYS | WHITESPACE_KEYS)
    asked = [k for k in ("json", "regex", "choice", "grammar") if v.get(k) is not None]
    if v.get("json_object") is not None:
        if not isinstance(v["json_object"], bool):
            raise wrong_type(f"{name}.json_object", "a boolean", v["json_object"], "true")
        if v["json_object"]:
            asked.append("json_object")
    if len(asked) != 1:
        raise bad(name, f"structured_outputs asks for {len(asked)} kinds of output "
                        f"({', '.join(asked) or 'none'}); give exactly one of json, regex, "
                        f"choice, grammar and json_object")
    kind = asked[0]
    options = _whitespace(name, v, kind)
    if kind == "json_object":
        return _grammar(name, "json", {"type": "object"}, options)
    return _grammar(f"{name}.{kind}", kind, v[kind], options)


def _whitespace(name: str, v: dict, kind: str) -> dict:
    """llguidance's JSON options from vLLM's whitespace fields (JSON only)."""
    given = [k for k in WHITESPACE_KEYS if v.get(k) is not None]
    if given and kind not in ("json", "json_object"):
        raise bad(f"{name}.{given[0]}", f"{given[0]} applies to JSON output only; remove it "
                                        f"or ask for json")
    options = {}
    flag = v.get("disable_any_whitespace")
    if flag is not None:
        if not isinstance(flag, bool):
            raise wrong_type(f"{name}.disable_any_whitespace", "a boolean", flag, "true")
        options["whitespace_flexible"] = not flag
    pattern = v.get("whitespace_pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise wrong_type(f"{name}.whitespace_pattern", "a string", pattern, "\"[ ]?\"")
        options["whitespace_pattern"] = pattern
    return options


def _grammar(param: str, kind: str, v, json_options: dict) -> GrammarRequest:
    """llguidance's grammar text for one constraint; wrong shapes are refused here, wrong
    contents when it is compiled."""
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise bad(param, f"{param} is a string but not JSON ({e}); give the schema as "
                                 f"an object") from None
        if not isinstance(v, (dict, bool)):
            raise wrong_type(param, "a JSON schema (an object)", v,
                             "{\"type\": \"object\", \"properties\": {\"name\": "
                             "{\"type\": \"string\"}}}")
        return GrammarRequest(param, kind, llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(v), overrides=json_options or None))
    if kind == "regex":
        if not isinstance(v, str) or not v:
            raise wrong_type(param, "a non-empty string", v, "\"[0-9]{3}-[0-9]{4}\"")
        return GrammarRequest(param, kind, llguidance.LLMatcher.grammar_from_regex(v))
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
            raise wrong_type(param, "a non-empty array of strings", v, "[\"yes\", \"no\"]")
        if len(v) > CHOICES_MAX:
            raise bad(param, f"{param} has {len(v)} strings; give at most {CHOICES_MAX}")
        return GrammarRequest(param, kind, llguidance.grammar_from("choice", v))
    assert kind == "grammar", kind
    if not isinstance(v, str) or not v.strip():
        raise wrong_type(param, "a grammar (Lark or GBNF text)", v,
                         "\"start: \\\"yes\\\" | \\\"no\\\"\"")
    try:
        return GrammarRequest(param, kind, llguidance.grammar_from("grammar", v))
    except ValueError as e:   # GBNF that does not convert to Lark
        raise bad(param, f"{param} cannot be read: {_first_lines(str(e))}") from None


def _only(name: str, v: dict, keys: set[str]) -> None:
    extra = sorted(set(v) - keys)
    if extra:
        raise ApiError(400, f"{name} has {shown(extra[0])}, which strata does not know; it takes "
                            f"{', '.join(sorted(keys))}", f"{name}.{extra[0]}"[:100],
                       "unknown_parameter")


def refusal(g: GrammarRequest, message: str) -> ApiError:
    """The 400 for a grammar that cannot be served (grammar.GrammarError's sentence)."""
    what = {"json": "JSON schema", "regex": "regular expression", "choice": "choice",
            "grammar": "grammar"}[g.kind]
    return bad(g.param, f"the {what} in {g.param} cannot be used: {_first_lines(message)}; "
                        f"fix or simplify it and send the request again")


def _first_lines(message: str, limit: int = 400) -> str:
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + " ..."
