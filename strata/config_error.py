"""ConfigError: a configuration value that cannot work, said in one sentence that names the
config's fields, so each front end can name them its own way (a CLI: its flags).

    raise ConfigError("slots", f"{{slots}} {slots} is below 1")
    str(e)                          # 'slots 0 is below 1'
    e.render({"slots": "--batch"})  # '--batch 0 is below 1'

May import: nothing
"""
from __future__ import annotations

from typing import Mapping


class _Names(dict):
    def __missing__(self, field: str) -> str:   # a field the front end has no name for
        return field


class ConfigError(ValueError):
    """sentence: what is wrong, naming config fields as {field} placeholders; fix: what to use
    instead (same placeholders), after a semicolon. field: the value to change; a front end
    may offer more choices for it than the library knows (`--batch-groups auto`)."""

    def __init__(self, field: str, sentence: str, fix: str = ""):
        self.field, self.sentence, self.fix = field, sentence, fix
        super().__init__(self.render())

    def render(self, names: Mapping[str, str] = {}, choices: Mapping[str, str] = {}) -> str:
        """The sentence with each field called names[field] (default: the field's own name);
        choices[field], when given, is offered beside the fix."""
        names = _Names(names)
        text = self.sentence.format_map(names)
        fix = self.fix.format_map(names)
        if fix and self.field in choices:
            fix += f" or {choices[self.field]}"
        return f"{text}; {fix}" if fix else text
