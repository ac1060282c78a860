"""POST /tokenize and /detokenize in vLLM's shapes, checked field by field (request_fields'
rules: a field is read, or refused with a 400 that names it).

    /tokenize    {"prompt": TEXT, "add_special_tokens": true}
                 {"messages": [...], "add_generation_prompt": true, "add_special_tokens": true}
                 (either with "return_token_strs": true)
              -> {"tokens": [...], "count": N, "max_model_len": CTX, "token_strs": [...] | null}
    /detokenize  {"tokens": [...]} -> {"prompt": TEXT}

By default the tokens are those the generation routes feed the model for the same prompt or
messages (BOS where the model file asks for one; vLLM leaves it out of messages by default);
add_special_tokens false leaves out a BOS the template did not write. /detokenize keeps
control tokens in the text, as vLLM's does, so that it inverts /tokenize.
"""
from __future__ import annotations

from strata.coordinator.api import request_fields as fields
from strata.coordinator.api.prompts import Prompts
from strata.coordinator.api.request_fields import ApiError

TOKENIZE = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
            "return_token_strs"}
# vLLM's, for what strata does not do: accepted when they ask for nothing
TOKENIZE_OFF = {"continue_final_message": False, "tools": [], "chat_template_kwargs": {}}


def _known(body, route: str, known: set[str], off: dict) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {fields.kind(body)}; "
                            f"send e.g. {{\"prompt\": \"Hello\"}}")
    for name, v in body.items():
        if name in known or v is None or (name in off and v == off[name]):
            continue
        raise ApiError(400, f"'{fields.shown(name)[1:-1]}' is not a parameter {route} knows or "
                            f"honours; remove it", name[:100], "unknown_parameter")
    return body


def tokenize(body, prompts: Prompts, spell) -> dict:
    """spell(ids): each token's spelling (the model file's), for return_token_strs."""
    body = _known(body, "/tokenize", TOKENIZE, TOKENIZE_OFF)
    add_bos = fields.boolean(body, "add_special_tokens", True)
    strs = fields.boolean(body, "return_token_strs", False)
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise fields.bad("prompt", "give 'prompt' (text) or 'messages' (a conversation "
                                       "through the chat template), not both")
        ids = prompts.chat(body, fields.boolean(body, "add_generation_prompt", True), add_bos)
    else:
        if body.get("add_generation_prompt") is not None:
            raise fields.bad("add_generation_prompt", "add_generation_prompt goes with "
                                                      "'messages'; remove it, or send messages")
        text = body.get("prompt")
        if text is None:
            raise ApiError(400, "'prompt' is missing; give the text to tokenize, e.g. "
                                "\"prompt\": \"Hello\" (or 'messages')", "prompt",
                           "missing_required_parameter")
        if not isinstance(text, str):
            raise fields.wrong_type("prompt", "a string", text, "\"Hello\"")
        ids = prompts.text("prompt", text, add_bos)
    return {"tokens": ids, "count": len(ids), "max_model_len": prompts.ctx,
            "token_strs": spell(ids) if strs else None}


def detokenize(body, vocab: int, decode) -> dict:
    """decode(ids): their text, control tokens kept."""
    body = _known(body, "/detokenize", {"model", "tokens"}, {})
    ids = body.get("tokens")
    if ids is None:
        raise ApiError(400, "'tokens' is missing; give the token ids to turn into text, e.g. "
                            "\"tokens\": [1, 2, 3]", "tokens", "missing_required_parameter")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in ids):
        raise fields.wrong_type("tokens", "an array of token ids", ids, "[1, 2, 3]")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise fields.bad("tokens", f"token id {fields.shown(bad[0])} is outside the "
                                   f"vocabulary [0, {vocab})")
    return {"prompt": decode(ids)}
