"""The messages between the coordinator and the stages: one dataclass each, explicit encoding.

On the wire a message is a msgpack map {"type": NAME, ...fields} in the first frame; tensors
(activations, logits) ride as extra frames described by the header (see transport.py).
Never pickle: a message from another version or another program is checked field by field.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A message that cannot be decoded: unknown type, missing or ill-typed field."""


@dataclass
class Hello:
    """A stage introduces itself once it has loaded its layers and bound its input."""
    version: int
    stage: int
    layer_start: int
    layer_end: int
    device: str
    fingerprint: str
    pid: int
    slots: int
    ctx: int


@dataclass
class Window:
    """One forward pass over a set of rows; travels stage 0 -> 1 -> ... -> last.

    rows: slots/positions/tokens are [W]; a pad row has slot -1. Before computing, each stage
    applies `commits`: (slot, length) keeps positions [0, length) of that slot's KV.
    `sample` names the rows whose output the last stage samples, with each row's parameters
    and the uniform draw u the coordinator made for it. `chunk` marks a prompt chunk: every
    live row belongs to one slot (CUDA stages read such rows with the blocked chunk kernel, so
    a coordinator must mark every prompt row alike to get the same bits each time).
    """
    id: int
    slots: list[int]
    positions: list[int]
    tokens: list[int]
    commits: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    u: list[float] = field(default_factory=list)
    want_logits: bool = False
    chunk: bool = False
    stage_ms: list[float] = field(default_factory=list)  # each stage appends its compute time

    def __post_init__(self):
        n = len(self.slots)
        if len(self.positions) != n or len(self.tokens) != n:
            raise ProtocolError(f"window {self.id}: slots, positions and tokens differ in length")
        m = len(self.sample_rows)
        if any(len(x) != m for x in (self.temperature, self.top_k, self.top_p, self.min_p, self.u)):
            raise ProtocolError(f"window {self.id}: sampling lists differ in length")
        if any(not 0 <= r < n or self.slots[r] < 0 for r in self.sample_rows):
            raise ProtocolError(f"window {self.id}: a sampled row is out of range or a pad row")


@dataclass
class Result:
    """The last stage's answer to a window: one token per sampled row (logits as a frame when
    the window asked for them)."""
    id: int
    tokens: list[int]
    stage_ms: list[float] = field(default_factory=list)


@dataclass
class Error:
    """A stage could not handle a message; it keeps serving. window == -1 when none applies."""
    stage: int
    window: int
    message: str


@dataclass
class Shutdown:
    """Travels the chain; each stage forwards it, then exits."""
    reason: str = ""


MESSAGE_TYPES = {cls.__name__: cls for cls in (Hello, Window, Result, Error, Shutdown)}
_FIELD_TYPES = {"int": int, "str": str, "bool": bool, "float": (int, float),
                "list[int]": list, "list[float]": list, "list[list[int]]": list}


def encode(msg) -> dict:
    out = {"type": type(msg).__name__}
    for f in fields(msg):
        out[f.name] = getattr(msg, f.name)
    return out


def decode(obj) -> object:
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError("message is not a map with a string 'type'")
    cls = MESSAGE_TYPES.get(obj["type"])
    if cls is None:
        raise ProtocolError(f"unknown message type {obj['type']!r}")
    kwargs = {}
    for name, type_name, expected, required, items in _SCHEMAS[cls]:
        if name not in obj:
            if required:
                raise ProtocolError(f"{cls.__name__} lacks field {name!r}")
            continue
        value = obj[name]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ProtocolError(f"{cls.__name__}.{name} should be {type_name}, "
                                f"got {type(value).__name__}")
        if items is not None and not _list_ok(value, items):
            raise ProtocolError(f"{cls.__name__}.{name} should be {type_name}")
        kwargs[name] = value
    return cls(**kwargs)


_INT, _NUMBER = frozenset({int}), frozenset({int, float})  # type(True) is bool: not in these


def _list_ok(value: list, items: str) -> bool:
    """items: "int", "float" or "list[int]" (the declared list[...]'s inner type)."""
    if items == "int":
        return {type(x) for x in value} <= _INT
    if items == "float":
        return {type(x) for x in value} <= _NUMBER
    return all(type(x) is list and {type(y) for y in x} <= _INT for x in value)


# per message class: (field, declared type, accepted Python type, required, list items type
# or None), read once
_SCHEMAS = {cls: [(f.name, f.type, _FIELD_TYPES[f.type],
                   f.default is MISSING and f.default_factory is MISSING,
                   f.type[5:-1] if f.type.startswith("list[") else None) for f in fields(cls)]
            for cls in MESSAGE_TYPES.values()}
