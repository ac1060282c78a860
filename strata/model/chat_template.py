"""Chat templates as transformers renders them (`apply_chat_template`): a sandboxed jinja2
environment with its options, filters and globals, so the prompt text matches it character for
character."""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to reject a conversation (e.g. roles not alternating).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt; transformers'
    # does not, and templates are written against transformers.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in an environment like transformers' (trim/lstrip blocks, loop controls,
    raise_exception, strftime_now, its tojson). Sandboxed: templates come with downloaded files."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def unused_mark(texts: list) -> str:
    """A private-use character that none of `texts` holds (to mark where a text was hidden)."""
    for code in range(0xE000, 0xF900):
        mark = chr(code)
        if not any(isinstance(t, str) and mark in t for t in texts):
            return mark
    raise ValueError("the messages use every private-use character; send fewer of them")
