"""A request's prompts as token ids: the text, token ids or list of prompts of /v1/completions,
the messages of /v1/chat/completions through the model's chat template, and the same read by
/tokenize. Every refusal is an ApiError that names the field and says what to change.

A message's content never yields control tokens ("<|im_end|>" written in it is text), unless
the server was started with --allow-control-tokens-in-messages (Tokenizer.encode_chat).
"""
from __future__ import annotations

from dataclasses import dataclass

from strata.coordinator.api import request_fields as fields
from strata.coordinator.api.request_fields import ApiError

MAX_PROMPTS = 128   # prompts in one completions request
ROLES = ("system", "developer", "user", "assistant", "tool")

# message fields strata does not read: refused unless null (what to do instead)
MESSAGE_REFUSED = {
    "name": "the chat template has no place for a speaker's name; write it into 'content' "
            "(e.g. \"Ana: ...\") instead",
    "tool_call_id": "function calling is not supported; send the tool's result as the text "
                    "of a user message instead",
    "tool_calls": "function calling is not supported; send the assistant's text only",
    "function_call": "function calling is not supported; send the assistant's text only",
}


@dataclass(frozen=True)
class Prompts:
    """Reads prompts for one model: `tok` (strata.model.tokenizer.Tokenizer), its vocabulary
    and the server's context; control_in_content: --allow-control-tokens-in-messages."""
    tok: object
    vocab: int
    ctx: int
    control_in_content: bool = False

    def check(self, name: str, text: str) -> str:
        """Refuses what no tokenizer can read, and a text too long for the context before the
        tokenizer spends time on it."""
        fields.text(name, text)
        if len(text) >= self.ctx * self.tok.longest_token:   # >= len / longest_token tokens
            raise fields.bad(name, f"the prompt has {len(text)} characters, more than this "
                                   f"server's context of {self.ctx} tokens can hold; shorten "
                                   f"it, or start strata-launch with a larger --ctx-size")
        return text

    def text(self, name: str, text: str, add_bos: bool = True) -> list[int]:
        return self.tok.encode(self.check(name, text), add_bos=add_bos)

    def completion(self, body: dict) -> list[list[int]]:
        """'prompt': a string or an array of token ids, or an array of either (several
        prompts; one in an array is that one)."""
        if body.get("prompt") is None:
            raise ApiError(400, "'prompt' is missing; give the text to continue, e.g. "
                                "\"prompt\": \"Once upon a time\"", "prompt",
                           "missing_required_parameter")
        p = body["prompt"]
        several = isinstance(p, list) and bool(p) and all(isinstance(x, (str, list)) for x in p)
        if not several:
            return [self._one(p, "")]
        if len(p) > MAX_PROMPTS:
            raise fields.bad("prompt", f"'prompt' holds {len(p)} prompts; send at most "
                                       f"{MAX_PROMPTS} in one request")
        return [self._one(x, f" prompt[{k}]:" if len(p) > 1 else "") for k, x in enumerate(p)]

    def _one(self, p, which: str) -> list[int]:
        if isinstance(p, str):
            if not p:
                raise fields.bad("prompt", f"{which} the prompt is empty; give at least one "
                                           f"character of text".lstrip())
            return self.text("prompt", p)
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in p):
            if not p:
                raise fields.bad("prompt", f"{which} the prompt is empty; give at least one "
                                           f"token".lstrip())
            bad = [t for t in p if not 0 <= t < self.vocab]
            if bad:
                raise fields.bad("prompt", f"{which} token id {fields.shown(bad[0])} is "
                                           f"outside the vocabulary [0, {self.vocab})".lstrip())
            return list(p)
        raise fields.wrong_type("prompt", "a string, an array of token ids, or an array of "
                                          "those (several prompts)", p, "\"Once upon a time\"")

    def chat(self, body: dict, add_generation_prompt: bool = True,
             add_bos: bool = True) -> list[int]:
        """'messages' through the chat template."""
        msgs = body.get("messages")
        if msgs is None:
            raise ApiError(400, "'messages' is missing; give the conversation, e.g. "
                                "\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]",
                           "messages", "missing_required_parameter")
        if not isinstance(msgs, list):
            raise fields.wrong_type("messages", "an array of messages", msgs,
                                    "[{\"role\": \"user\", \"content\": \"Hello\"}]")
        if not msgs:
            raise fields.bad("messages", "'messages' is empty; give at least one message")
        clean = [_message(i, m) for i, m in enumerate(msgs)]
        if all(not m["content"] for m in clean):
            raise fields.bad("messages", "every message is empty; give some text to answer")
        self.check("messages", "".join(m["content"] for m in clean))
        if not self.tok.has_chat_template:
            raise fields.bad("messages", "this model has no chat template (its GGUF file lacks "
                                         "tokenizer.chat_template), so messages cannot be "
                                         "rendered; send a plain prompt to /v1/completions")
        try:
            return self.tok.encode_chat(clean, add_generation_prompt,
                                        control_in_content=self.control_in_content,
                                        add_bos=add_bos)
        except Exception as e:  # the model's template refuses (e.g. roles must alternate)
            raise fields.bad("messages", f"the model's chat template refused these messages: "
                                         f"{e}") from e


def _message(i: int, m) -> dict:
    """messages[i] as the template reads it: role and content, nothing dropped unsaid."""
    if not isinstance(m, dict):
        raise fields.wrong_type(f"messages[{i}]", "an object", m,
                                "{\"role\": \"user\", \"content\": \"Hello\"}")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise fields.bad(f"messages[{i}].role", f"messages[{i}] has role {fields.shown(role)}; "
                                                f"use one of {', '.join(ROLES)}")
    for key, v in m.items():
        if key in ("role", "content") or v is None or (key == "tool_calls" and v == []):
            continue
        where = f"messages[{i}].{fields.shown(key)[1:-1]}"
        if key in MESSAGE_REFUSED:
            raise fields.bad(where, f"{where} is not supported: {MESSAGE_REFUSED[key]}")
        raise ApiError(400, f"{where} is not a message field strata reads; a message holds "
                            f"'role' and 'content' only, so remove it", where[:100],
                       "unknown_parameter")
    return {"role": "system" if role == "developer" else role, "content": _content(i, m)}


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
