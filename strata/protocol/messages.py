"""The messages between the coordinator and the stages: one dataclass each, explicit encoding.

On the wire a message is a msgpack map {"type": NAME, ...fields} in the first frame; tensors
(activations, logits) ride as extra frames described by the header (see transport.py).
Never pickle: a message from another version or another program is checked field by field.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Callable, Sequence

from strata.protocol.rows import LogprobRow, SamplingRow

PROTOCOL_VERSION = 4   # 2: Heartbeat, and Hello.listen; 3: penalties, biases, logprobs and
                       # token masks; 4: Window.after and follows (decoding ahead)


class ProtocolError(ValueError):
    """A message that cannot be decoded: unknown type, missing or ill-typed field.

    transport.unpack says what it could read of the message that failed (claimed_window):
    `window`, the id of the Window it claims to be (-1 when none can be read), and `rows`, how
    many rows of activations came with it over a stage link (0 for a message of another type,
    None when that cannot be read)."""
    window: int = -1
    rows: int | None = None


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
    listen: str = ""    # the endpoint the stage binds: where the coordinator sends heartbeats
    weights: str = ""   # what the stage made of the file's matrices (kept quantized, widened)
    memory: list[int] = field(default_factory=list)  # bytes on its device: weights, KV
                        # cache, scratch, all the process holds (CUDA: torch's reserve; CPU: 0)


@dataclass
class Window:
    """One forward pass over a set of rows; travels stage 0 -> 1 -> ... -> last.

    rows: slots/positions/tokens are [W]; a pad row has slot -1. Before computing, each stage
    applies `commits`: (slot, length) keeps positions [0, length) of that slot's KV. `chunk`
    marks a prompt chunk: every live row belongs to one slot (CUDA stages read such rows with
    the blocked chunk kernel, so a coordinator must mark every prompt row alike to get the
    same bits each time).

    The rows the last stage samples, and those whose log-probabilities it reports, are
    records (rows.py: SamplingRow, LogprobRow, which say what each field means): the
    coordinator builds a window from them (`from_rows`) and the last stage reads them back
    (`sampled`, `scored`). On the wire they travel as columns, one list per field, which
    __post_init__ checks: msgpack packs and reads them some 3x quicker than a map per row,
    in half the bytes.
    """
    id: int
    slots: list[int]
    positions: list[int]
    tokens: list[int]
    commits: list[list[int]] = field(default_factory=list)
    # the sampled rows (SamplingRow's fields, a column each; sample_rows holds their `row`)
    sample_rows: list[int] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    u: list[float] = field(default_factory=list)
    want_logits: bool = False
    chunk: bool = False
    stage_ms: list[float] = field(default_factory=list)  # each stage appends its compute time
    # [slot, k]: after sampling, the last stage's drafter proposes k tokens for the slot from
    # the rows this window accepts (Result.proposals); a stage without a drafter ignores it
    propose: list[list[int]] = field(default_factory=list)
    # parallel to `propose` (or empty: none for any entry): the uniform draws of the k
    # positions after the one the slot's last row samples, for coupled proposals; an entry []
    # asks for argmax proposals (see strata/stage_worker/drafter.py)
    propose_u: list[list[float]] = field(default_factory=list)
    # the sampled rows' optional fields, each a column parallel to `sample_rows` or empty
    # (SamplingRow's default for every row): penalty and output_start travel together, as do
    # bias_ids and bias ([] in a column: none for that row)
    penalty: list[list[float]] = field(default_factory=list)
    output_start: list[int] = field(default_factory=list)
    bias_ids: list[list[int]] = field(default_factory=list)
    bias: list[list[float]] = field(default_factory=list)
    # the rows whose log-probabilities the last stage reports (LogprobRow's fields)
    logprob_rows: list[int] = field(default_factory=list)
    logprob_tokens: list[int] = field(default_factory=list)
    logprob_top: list[int] = field(default_factory=list)
    # token masks (structured output): `mask`, the sampled rows' optional column of mask
    # indices into `masks`, -1 for none. `masks`: each ceil(V / 32) little-endian int32
    # words (V: the model's vocabulary), bit j of word i set where token 32 i + j may be
    # sampled; the last stage samples a masked row as if the others' logits were -inf, after
    # its penalties and biases (stage_worker/head.py)
    mask: list[int] = field(default_factory=list)
    masks: bytes = b""
    # decoding ahead (a stage that is both first and last): `follows`, a column parallel to
    # the rows or empty, gives a row's token as the index of a sampled row of window `after`
    # (-1: the row's own token), whose pick that stage reads where it keeps it (on CUDA, the
    # device); `after` must be the last window the stage computed. So the coordinator can
    # send a slot's next decode window before the tokens of the one before it are back.
    after: int = -1
    follows: list[int] = field(default_factory=list)

    def __post_init__(self):
        n = len(self.slots)
        if len(self.positions) != n or len(self.tokens) != n:
            raise ProtocolError(f"window {self.id}: slots, positions and tokens differ in length")
        m = len(self.sample_rows)
        if any(len(x) != m for x in (self.temperature, self.top_k, self.top_p, self.min_p, self.u)):
            raise ProtocolError(f"window {self.id}: sampling lists differ in length")
        if any(not 0 <= r < n or self.slots[r] < 0 for r in self.sample_rows):
            raise ProtocolError(f"window {self.id}: a sampled row is out of range or a pad row")
        if any(len(p) != 2 or p[0] not in self.slots or p[1] < 1 for p in self.propose):
            raise ProtocolError(f"window {self.id}: a proposal request is not [slot, k >= 1] "
                                f"for a slot with rows in the window")
        if self.propose_u and len(self.propose_u) != len(self.propose):
            raise ProtocolError(f"window {self.id}: propose_u and propose differ in length; "
                                f"send one propose_u entry per proposal request, or none")
        for name in ("penalty", "output_start", "bias_ids", "bias"):
            if getattr(self, name) and len(getattr(self, name)) != m:
                raise ProtocolError(f"window {self.id}: {name} has an entry per sampled row, "
                                    f"or none")
        if any(p and len(p) != 3 for p in self.penalty):
            raise ProtocolError(f"window {self.id}: a penalty entry is not [] or [repetition, "
                                f"frequency, presence]")
        if len(self.bias) != len(self.bias_ids) or any(
                len(i) != len(b) for i, b in zip(self.bias_ids, self.bias)):
            raise ProtocolError(f"window {self.id}: bias_ids and bias differ in length")
        k = len(self.logprob_rows)
        if len(self.logprob_tokens) != k or len(self.logprob_top) != k:
            raise ProtocolError(f"window {self.id}: logprob_rows, logprob_tokens and "
                                f"logprob_top differ in length")
        if any(not 0 <= r < n or self.slots[r] < 0 for r in self.logprob_rows):
            raise ProtocolError(f"window {self.id}: a logprob row is out of range or a pad row")
        for (slot, k), us in zip(self.propose, self.propose_u):
            if us and (len(us) != k or not all(0.0 <= u < 1.0 for u in us)):
                raise ProtocolError(f"window {self.id}: slot {slot}'s propose_u entry must be "
                                    f"[] (argmax) or one uniform in [0, 1) per proposal")
        if self.mask and len(self.mask) != m:
            raise ProtocolError(f"window {self.id}: mask and sample_rows differ in length; "
                                f"send one mask index per sampled row, or none")
        if self.follows and (len(self.follows) != n or self.after < 0 or any(
                j < -1 or (j >= 0 and s < 0) for j, s in zip(self.follows, self.slots))):
            raise ProtocolError(f"window {self.id}: follows needs an entry per row (-1, or a "
                                f"sampled row of window `after` for a live row) and after >= 0")
        count = max(self.mask, default=-1) + 1   # masks the rows name
        if any(i < -1 for i in self.mask) or bool(count) != bool(self.masks) or (
                count and len(self.masks) % (4 * count)):
            raise ProtocolError(f"window {self.id}: mask names {count} masks but masks holds "
                                f"{len(self.masks)} bytes; send whole int32 words for each")

    @classmethod
    def from_rows(cls, id: int, slots: list[int], positions: list[int], tokens: list[int],
                  sampled: Sequence[SamplingRow] = (), scored: Sequence[LogprobRow] = (),
                  **fields) -> Window:
        """A window whose sampled and scored rows are given as records (the coordinator's
        builder), laid out as the wire's columns: penalty and output_start only where a row
        has a penalty, bias_ids and bias where one has a bias, mask where one has a mask.
        fields: the Window's others (commits, masks, ...)."""
        columns: dict[str, list] = {}
        if sampled:
            (temperature, top_k, top_p, min_p, u, rows, penalty, output_start, bias_ids, bias,
             mask) = map(list, zip(*sampled))
            columns = dict(sample_rows=rows, temperature=temperature, top_k=top_k, top_p=top_p,
                           min_p=min_p, u=u)
            if any(penalty):
                columns.update(penalty=penalty, output_start=output_start)
            if any(bias_ids):
                columns.update(bias_ids=bias_ids, bias=bias)
            if any(i >= 0 for i in mask):
                columns.update(mask=mask)
        if scored:
            rows, token, top = map(list, zip(*scored))
            columns.update(logprob_rows=rows, logprob_tokens=token, logprob_top=top)
        return cls(id, slots, positions, tokens, **columns, **fields)

    @cached_property
    def sampled(self) -> list[SamplingRow]:
        """The sampled rows as records, in sample_rows' order (made once: a window's columns
        do not change after it is built)."""
        m = len(self.sample_rows)
        return list(map(SamplingRow._make, zip(
            self.temperature, self.top_k, self.top_p, self.min_p, self.u, self.sample_rows,
            self.penalty or [()] * m, self.output_start or [0] * m, self.bias_ids or [()] * m,
            self.bias or [()] * m, self.mask or [-1] * m)))

    @cached_property
    def scored(self) -> list[LogprobRow]:
        """The rows whose log-probabilities the last stage reports, as records."""
        return list(map(LogprobRow._make, zip(self.logprob_rows, self.logprob_tokens,
                                              self.logprob_top)))

    def mask_words(self) -> int:
        """The int32 words of each mask in `masks` (0 without masks)."""
        count = max(self.mask, default=-1) + 1
        return len(self.masks) // (4 * count) if count else 0


@dataclass
class Result:
    """The last stage's answer to a window: one token per sampled row (logits as a frame when
    the window asked for them)."""
    id: int
    tokens: list[int]
    stage_ms: list[float] = field(default_factory=list)
    proposals: list[list[int]] = field(default_factory=list)  # [slot, d1, ..., dk] per propose
    # per Window.logprob_rows entry: the token's log-probability, and the row's most likely
    # tokens with theirs (most likely first, ties by token id)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass
class Error:
    """A stage could not handle a message; it keeps serving. window == -1 when none applies."""
    stage: int
    window: int
    message: str


@dataclass
class Heartbeat:
    """The coordinator asks a stage (stage -1: from the coordinator) whether it still takes
    messages; the stage answers with the same seq and its own index when it takes the
    question from its inbox, after the windows queued before it. A stage that is stopped or
    stuck never answers (coordinator/stages/liveness.py)."""
    seq: int
    stage: int = -1


@dataclass
class Shutdown:
    """Travels the chain; each stage forwards it, then exits."""
    reason: str = ""


# --- joining a launch from another host (strata-worker --join; protocol/join.py) ---
# A stage started by hand asks for its place (JoinAsk) and gets the model to check (JoinModel),
# then confirms with its model's fingerprint and its endpoint (JoinConfirm) and gets the
# arguments it would have been spawned with (JoinPlan). Either question may get JoinWait (ask
# again shortly) or JoinRefused (a sentence; the stage does not start).

@dataclass
class JoinAsk:
    version: int
    stage: int


@dataclass
class JoinModel:
    stage: int
    model: str          # the launch's model file, a path on the launcher's host
    fingerprint: str    # ModelFile.fingerprint() of that file


@dataclass
class JoinConfirm:
    stage: int
    fingerprint: str    # of the model file the stage will load
    listen: str         # the tcp:// endpoint it will bind for its input


@dataclass
class JoinPlan:
    stage: int
    args: list[str]     # strata-worker's arguments, as for a stage the launcher spawns


@dataclass
class JoinWait:
    stage: int
    message: str        # what the launch waits for before it can place this stage


@dataclass
class JoinRefused:
    stage: int
    message: str        # what to change, in one sentence


@dataclass(frozen=True)
class Kind:
    """A field's type on the wire: its name (for error messages) and a check of a decoded
    value. msgpack gives exact Python types, so the checks compare types (bool is not int)."""
    name: str
    check: Callable[[object], bool]


_INT, _NUMBER = frozenset({int}), frozenset({int, float})

INT = Kind("int", lambda v: type(v) is int)
FLOAT = Kind("float", lambda v: type(v) in _NUMBER)     # msgpack may carry 1.0 as 1
BOOL = Kind("bool", lambda v: type(v) is bool)
STR = Kind("str", lambda v: type(v) is str)
STRS = Kind("list[str]", lambda v: type(v) is list and {type(x) for x in v} <= {str})
INTS = Kind("list[int]", lambda v: type(v) is list and {type(x) for x in v} <= _INT)
FLOATS = Kind("list[float]", lambda v: type(v) is list and {type(x) for x in v} <= _NUMBER)
PAIRS = Kind("list[list[int]]", lambda v: type(v) is list and all(
    type(x) is list and {type(y) for y in x} <= _INT for x in v))
BYTES = Kind("bytes", lambda v: type(v) is bytes)
FLOAT_LISTS = Kind("list[list[float]]", lambda v: type(v) is list and all(
    type(x) is list and {type(y) for y in x} <= _NUMBER for x in v))

# Each message's fields on the wire, in the dataclass's order (the order encode writes them).
# A field with a default in the dataclass may be absent from a message: it takes the default.
# Decoders ignore keys they do not know, so a later version adds a field without breaking an
# older reader. Per-row extras of a Window (logprobs wanted, penalties, a grammar state, a
# draft's origin) go that way: each is a new optional list, parallel to `sample_rows` (extras
# of sampled rows: a field of rows.SamplingRow with its default, laid out by Window.from_rows
# and read back by Window.sampled) or to `slots` (extras of every row), whose empty default
# means "none for any row", so a window without them encodes as today. An extra a stage must
# not ignore comes with a PROTOCOL_VERSION bump, which the hello handshake checks.
SCHEMAS: dict[type, dict[str, Kind]] = {
    Hello: {"version": INT, "stage": INT, "layer_start": INT, "layer_end": INT, "device": STR,
            "fingerprint": STR, "pid": INT, "slots": INT, "ctx": INT, "listen": STR,
            "weights": STR, "memory": INTS},
    Window: {"id": INT, "slots": INTS, "positions": INTS, "tokens": INTS, "commits": PAIRS,
             "sample_rows": INTS, "temperature": FLOATS, "top_k": INTS, "top_p": FLOATS,
             "min_p": FLOATS, "u": FLOATS, "want_logits": BOOL, "chunk": BOOL,
             "stage_ms": FLOATS, "propose": PAIRS, "propose_u": FLOAT_LISTS,
             "penalty": FLOAT_LISTS, "output_start": INTS, "bias_ids": PAIRS,
             "bias": FLOAT_LISTS, "logprob_rows": INTS, "logprob_tokens": INTS,
             "logprob_top": INTS, "mask": INTS, "masks": BYTES, "after": INT,
             "follows": INTS},
    Result: {"id": INT, "tokens": INTS, "stage_ms": FLOATS, "proposals": PAIRS,
             "logprobs": FLOATS, "top_ids": PAIRS, "top_logprobs": FLOAT_LISTS},
    Error: {"stage": INT, "window": INT, "message": STR},
    Heartbeat: {"seq": INT, "stage": INT},
    Shutdown: {"reason": STR},
    JoinAsk: {"version": INT, "stage": INT},
    JoinModel: {"stage": INT, "model": STR, "fingerprint": STR},
    JoinConfirm: {"stage": INT, "fingerprint": STR, "listen": STR},
    JoinPlan: {"stage": INT, "args": STRS},
    JoinWait: {"stage": INT, "message": STR},
    JoinRefused: {"stage": INT, "message": STR},
}
MESSAGE_TYPES = {cls.__name__: cls for cls in SCHEMAS}
# per message class: (field, kind, required), in the dataclass's order
_FIELDS = {cls: [(f.name, SCHEMAS[cls][f.name],
                  f.default is MISSING and f.default_factory is MISSING) for f in fields(cls)]
           for cls in SCHEMAS}
assert all([f.name for f in fields(cls)] == list(schema) for cls, schema in SCHEMAS.items()), \
    "a message's schema must list its dataclass fields, in order"


def encode(msg) -> dict:
    out = {"type": type(msg).__name__}
    for name, _, _ in _FIELDS[type(msg)]:
        out[name] = getattr(msg, name)
    return out


def decode(obj) -> object:
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError("message is not a map with a string 'type'")
    cls = MESSAGE_TYPES.get(obj["type"])
    if cls is None:
        raise ProtocolError(f"unknown message type {obj['type']!r}")
    kwargs = {}
    for name, kind, required in _FIELDS[cls]:
        if name not in obj:
            if required:
                raise ProtocolError(f"{cls.__name__} lacks field {name!r}")
            continue
        value = obj[name]
        if not kind.check(value):
            raise ProtocolError(f"{cls.__name__}.{name} should be {kind.name}, "
                                f"got {_type_of(value)}")
        kwargs[name] = value
    return cls(**kwargs)


def claimed_window(obj) -> tuple[int, int | None]:
    """(id, rows) of a header that failed to decode, as far as they can be read: a Window's
    id (-1 when not an int) and row count (its slots' length; None when not a list); (-1, 0)
    for a map of another known type, (-1, None) for anything else."""
    kind = obj.get("type") if isinstance(obj, dict) else None
    if kind != Window.__name__:
        return -1, (0 if type(kind) is str and kind in MESSAGE_TYPES else None)
    window, slots = obj.get("id"), obj.get("slots")
    return (window if type(window) is int else -1), (len(slots) if type(slots) is list else None)


def _type_of(value) -> str:
    """int, or for a list the types it holds: list[bool, int]."""
    if type(value) is not list:
        return type(value).__name__
    return f"list[{', '.join(sorted({_type_of(x) for x in value}))}]"
