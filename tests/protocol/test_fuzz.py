"""Protocol fuzzing (hypothesis): malformed frames against a stage worker and against the
coordinator's inbox. Random bytes, truncated and mutated headers, a wrong type or length in
each field, missing fields, wrong frame counts and tensor specs, windows a stage must refuse,
messages of the wrong kind. A stage answers each with one Error (naming the window when its id
can be read) and keeps serving; the coordinator drops each with a log line. Neither crashes
nor changes state: the stage's KV cache is bit for bit what it was, and the next valid window
(the next request) gives what it gives without the storm.

The worker runs in this process (inprocess.py), as stage 0 (tokens in) and as a later stage
(activations as frames); the coordinator is a Pipeline and a Scheduler over a worker serving
in a thread. Examples are derandomized, so CI sees the same frames every run; the `long`
variant (python -m pytest -m long) sends ten times as many.
"""
from __future__ import annotations

import logging
import random
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inprocess import in_process_worker

from strata.coordinator.stages.pipeline import Expect, Pipeline
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.protocol import transport
from strata.protocol.messages import (PROTOCOL_VERSION, SCHEMAS, Error, Hello, Result,
                                      Shutdown, Window, encode)
from strata.stage_worker.worker import StageWorker, WorkerConfig

CTX, SLOTS = 64, 2
VOCAB, D = 320, 64            # the tiny model's vocabulary and hidden size
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]   # each slot holds these 8 positions
STORM = 20                    # frames per example
FAST, SLOW = 100, 2000        # examples per stage: 2 x 100 x 20 = 4,000 frames
INBOX_STORM = 40              # frames per example into the coordinator's inbox (each example
INBOX_FAST, INBOX_SLOW = 50, 500     # runs a request): 50 x 40 = 2,000

# --- frames ---------------------------------------------------------------------------------


def _window(id: int, slots, positions, tokens, sample=(), **kw) -> Window:
    n = len(sample)
    return Window(id, list(slots), list(positions), list(tokens), sample_rows=list(sample),
                  temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, min_p=[0.0] * n,
                  u=[0.0] * n, **kw)


def _activations(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, D), dtype=np.float32)


def _frames(header: dict, tail: list) -> list:
    return [msgpack.packb(header, use_bin_type=True), *tail]


def _decodes(frames: list) -> bool:
    try:
        transport.unpack(frames)
    except Exception:   # what the worker makes of such frames is what the storm checks
        return False
    return True


def valid_window(r: random.Random, first: bool) -> tuple[dict, list]:
    """A window the stage could run from the state under test: (header, tensor frames)."""
    n, slot, token = r.randint(1, 8), r.randrange(SLOTS), r.randrange(VOCAB)
    w = _window(r.randint(1, 10**6), [slot] * n, range(len(PROMPT), len(PROMPT) + n),
                [(token + 37 * i) % VOCAB for i in range(n)],
                sample=[i for i in range(n) if r.random() < 0.5],
                commits=[[slot, len(PROMPT)]], chunk=r.random() < 0.5)
    tensors = [] if first else [_activations(n, token)]
    return msgpack.unpackb(transport.pack(w, tensors)[0]), tensors


def _bytes(r: random.Random, most: int) -> bytes:
    return r.randbytes(r.randint(0, most))


WIRE_INTS = st.integers(-2**63, 2**64 - 1)   # what msgpack carries
JUNK = st.one_of(   # a value of any kind msgpack carries
    st.none(), st.booleans(), WIRE_INTS, st.floats(), st.text(max_size=6),
    st.binary(max_size=6), st.dictionaries(st.text(max_size=3), WIRE_INTS, max_size=2),
    st.lists(st.one_of(st.integers(-3, 3), st.floats(), st.text(max_size=2), st.none(),
                       st.booleans(), st.lists(st.integers(-1, 3), max_size=3)), max_size=4))
KINDS = ["bytes", "truncated", "mutated", "type", "missing", "length", "frames", "refused",
         "message"]


@st.composite
def malformed(draw, first: bool) -> tuple[list, int | None]:
    """(frames, the window id the stage's Error must name, or None: not checked). Hypothesis
    draws the kind, a seed for the rest, and the ill-typed values: its time goes by the draw,
    and 10,000 frames of fine-grained draws take minutes here."""
    kind = draw(st.sampled_from(KINDS))
    r = random.Random(draw(st.integers(0, 2**32 - 1)))
    header, tail = valid_window(r, first)
    wid = header["id"]
    if kind == "bytes":
        return [_bytes(r, 48), *[_bytes(r, 8) for _ in range(r.randint(0, 2))]], None
    packed = _frames(header, tail)
    if kind == "truncated":
        return [packed[0][:r.randrange(len(packed[0]))], *tail], -1
    if kind == "mutated":
        head = bytearray(packed[0])
        for _ in range(r.randint(1, 4)):
            head[r.randrange(len(head))] = r.randrange(256)
        frames = [bytes(head), *tail]
        if _decodes(frames):   # still a well-formed message: a trailing byte breaks it
            frames[0] += b"\xc1"
        return frames, None
    if kind == "type":   # a field of the Window (or its type) given a value of another kind
        field = draw(st.sampled_from(["type", *SCHEMAS[Window]]))
        header[field] = draw(JUNK.filter(lambda v: v != "Window") if field == "type" else
                             JUNK.filter(lambda v: not SCHEMAS[Window][field].check(v)))
        return _frames(header, tail), (-1 if field in ("id", "type") else wid)
    if kind == "missing":
        field = r.choice(["id", "slots", "positions", "tokens"])
        del header[field]
        return _frames(header, tail), (-1 if field == "id" else wid)
    if kind == "length":   # lists that must agree, or name rows and slots, do not
        field = r.choice(["positions", "tokens", "temperature", "top_k", "top_p", "min_p",
                          "u", "sample_rows", "propose", "propose_u", "mask"])
        if field == "mask":         # a mask index more than sampled rows, or too few bytes
            header["mask"] = [0] * (len(header["sample_rows"]) + r.randint(0, 1))
            header["masks"] = bytes(r.choice([0, 3, 4]) if header["mask"] else 4)
        elif field == "propose":    # a slot with no row in the window
            header["propose"] = [[SLOTS + 5, 1]]
        elif field == "propose_u":  # one entry per proposal request, and there is none
            header["propose_u"] = [[0.5]]
        elif field == "sample_rows":  # past the rows
            header[field] = [len(header["slots"]) + r.randint(0, 3)]
        elif header[field]:
            header[field] = header[field][:-1]
        else:
            header[field] = [1] if field in ("top_k", "positions", "tokens") else [0.5]
        return _frames(header, tail), wid
    if kind == "frames":  # the tensor frames do not match what the header lists
        how = r.choice(["count", "size", "dtype", "shape"])
        if how == "count":
            n = r.choice([c for c in range(4) if c != len(tail)])
            return [packed[0], *[_bytes(r, 16) for _ in range(n)]], wid
        header["tensors"] = [[r.choice(["float32", "float64", "object", "<U2"])
                              if how == "dtype" else "float32",
                              [1, -1] if how == "shape" else [len(header["slots"]), D + 1]]]
        return _frames(header, [r.randbytes(r.randint(1, 32))]), wid
    if kind == "refused":  # decodes, but this stage cannot run it
        return _refused(r, header, tail, first), wid
    other = r.choice([
        Hello(PROTOCOL_VERSION, 0, 0, 4, "cpu", "x", 1, SLOTS, CTX), Result(wid, [1, 2]),
        Error(1, wid, "x"), {"type": "Bogus", "id": wid}, {"type": None}, [1, 2], "Window"])
    if isinstance(other, (Hello, Result, Error)):
        return transport.pack(other), -1
    return [msgpack.packb(other)], -1


def _refused(r: random.Random, header: dict, tail: list, first: bool) -> list:
    """The frames of a window that decodes but that check_window must refuse."""
    n, slot = len(header["slots"]), header["slots"][0]
    unsampled = dict(sample_rows=[], temperature=[], top_k=[], top_p=[], min_p=[], u=[])

    def rows(m: int, **fields) -> None:   # m rows of other fields (activations to match)
        header.update(**fields, **unsampled)
        if not first:
            tail[:] = [_activations(m, 0)]
            header["tensors"] = [["float32", [m, D]]]

    how = r.choice(["slot", "position", "gap", "commit", "pair", "empty", "rows", "chunk",
                    "masks", "token" if first else "activations"])
    if how == "slot":
        header["slots"][r.randrange(n)] = r.choice([SLOTS, SLOTS + 1, 2**63 - 1])
    elif how == "position":
        header["positions"][-1] = r.choice([CTX, CTX + 1, 2**63 - 1, -1, -2**63])
    elif how == "gap":  # past what the slot holds (the window's commit trims it to PROMPT)
        header["positions"] = [p + r.randint(1, 9) for p in header["positions"]]
    elif how == "commit":
        header["commits"].append(r.choice([[SLOTS, 0], [slot, CTX + 1], [-1, 0], [slot, -5]]))
    elif how == "pair":
        header["commits"] = [r.choice([[], [slot], [slot, 0, 0]])]
    elif how == "empty":
        rows(0, slots=[], positions=[], tokens=[])
    elif how == "rows":   # a decode window past the largest
        rows(65, slots=[-1] * 65, positions=[0] * 65, tokens=[0] * 65, chunk=False)
    elif how == "chunk":  # a prompt chunk holding rows of two slots
        rows(2, slots=[0, 1], positions=[len(PROMPT)] * 2, tokens=[1, 2], chunk=True,
             commits=[])
    elif how == "masks":  # token masks over a vocabulary of another size
        if not header["sample_rows"]:
            header.update(sample_rows=[0], temperature=[0.0], top_k=[0], top_p=[1.0],
                          min_p=[0.0], u=[0.0])
        header["mask"] = [0] * len(header["sample_rows"])
        header["masks"] = bytes(4 * (-(-VOCAB // 32) + r.choice([-1, 1, 2])))
    elif how == "token":
        header["tokens"][-1] = r.choice([VOCAB, VOCAB + 1, 2**63 - 1, -1, -2**63])
    else:   # activations of another row count, or of a dtype a stage does not take
        bad = r.choice([_activations(r.choice([m for m in range(10) if m != n]), 1),
                        np.zeros((n, D), dtype=np.int32), np.zeros((n, D), dtype=np.int64)])
        tail[:] = [bad]
        header["tensors"] = [[str(bad.dtype), list(bad.shape)]]
    return _frames(header, tail)


# --- a stage under the storm ----------------------------------------------------------------

def _state(worker: StageWorker) -> tuple:
    c = worker.cache
    return list(c.filled), [t[:SLOTS].clone() for t in c.k + c.v]


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _fill(stage, slot: int, first: bool) -> None:
    w = _window(900 + slot, [slot] * len(PROMPT), range(len(PROMPT)), PROMPT,
                commits=[[slot, 0]], chunk=True)
    tensors = [] if first else [_activations(len(PROMPT), 7)]
    stage.out.send_multipart(transport.pack(w, tensors))
    stage.step()
    assert isinstance(stage.answers(1)[0], Result)


def _next_row(stage, slot: int, first: bool):
    """The row after the prompt in `slot`, sampled greedily: (Result, logits)."""
    w = _window(950 + slot, [slot] + [-1] * 7, [len(PROMPT)] + [0] * 7, [101] + [0] * 7,
                sample=[0], want_logits=True)
    stage.out.send_multipart(transport.pack(w, [] if first else [_activations(8, 8)]))
    stage.step()
    stage.worker._await_pending()
    assert stage.inbox.poll(5000)
    return transport.recv(stage.inbox)


def _storm_stage(tiny_model, first: bool, examples: int) -> None:
    config = {} if first else {"stage": 1, "layer_start": 2}
    with in_process_worker(tiny_model, layer_end=4, ctx=CTX, slots=SLOTS, **config) as stage:
        for slot in range(SLOTS):
            _fill(stage, slot, first)
        ref, ref_logits = _next_row(stage, 1, first)   # slot 1: the run without the storm
        assert isinstance(ref, Result)
        before = _state(stage.worker)

        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                         HealthCheck.data_too_large])
        @given(st.lists(malformed(first), min_size=STORM, max_size=STORM))
        def storm(frames_list):
            for frames, wid in frames_list:
                stage.out.send_multipart(frames)
                stage.step()
                (reply,) = stage.answers(1)
                assert isinstance(reply, Error), (frames, reply)
                assert reply.message and "\n" not in reply.message, reply
                assert wid is None or reply.window == wid, (frames, reply)
            assert _same(_state(stage.worker), before), "the storm changed the KV cache"

        storm()
        assert not stage.inbox.poll(0), "a frame got more than one answer"
        after, after_logits = _next_row(stage, 0, first)
        assert after.tokens == ref.tokens
        assert np.array_equal(after_logits[0], ref_logits[0])


@pytest.mark.parametrize("first", [True, False], ids=["stage0", "stage1"])
def test_a_storm_of_malformed_frames_leaves_a_stage_as_it_was(tiny_model, first):
    _storm_stage(tiny_model, first, FAST)


@pytest.mark.long
@pytest.mark.parametrize("first", [True, False], ids=["stage0", "stage1"])
def test_a_long_storm_of_malformed_frames_leaves_a_stage_as_it_was(tiny_model, first):
    _storm_stage(tiny_model, first, SLOW)


# --- the coordinator's inbox under the storm ------------------------------------------------

FAR_IDS = st.one_of(st.integers(-2**63, -1), st.integers(10**6, 2**63 - 1))  # never in flight
INBOX_KINDS = ["bytes", "truncated", "mutated", "type", "missing", "frames", "unknown id",
               "message"]


@st.composite
def inbox_malformed(draw) -> list:
    """The frames of a message no stage sends: malformed, of a kind the inbox does not take
    after the hellos, or a Result or Error about a window that is not in flight."""
    kind = draw(st.sampled_from(INBOX_KINDS))
    r = random.Random(draw(st.integers(0, 2**32 - 1)))
    wid = draw(FAR_IDS)
    msg = r.choice([Result(wid, [r.randrange(VOCAB) for _ in range(r.randint(0, 3))], [0.5]),
                    Error(r.randint(0, 3), wid, "refused")])
    header = encode(msg)
    header["tensors"] = []
    packed = _frames(header, [])
    if kind == "bytes":
        return [_bytes(r, 48), *[_bytes(r, 8) for _ in range(r.randint(0, 2))]]
    if kind == "truncated":
        return [packed[0][:r.randrange(len(packed[0]))]]
    if kind == "mutated":
        head = bytearray(packed[0])
        for _ in range(r.randint(1, 4)):
            head[r.randrange(len(head))] = r.randrange(256)
        return [bytes(head) + (b"\xc1" if _decodes([bytes(head)]) else b"")]
    schema = SCHEMAS[type(msg)]
    if kind == "type":
        field = draw(st.sampled_from(["type", *schema]))
        header[field] = draw(JUNK.filter(lambda v: v != type(msg).__name__) if field == "type"
                             else JUNK.filter(lambda v: not schema[field].check(v)))
        return _frames(header, [])
    if kind == "missing":
        del header[r.choice([f for f in schema if f not in ("stage_ms", "proposals")])]
        return _frames(header, [])
    if kind == "frames":
        header["tensors"] = r.choice([[], [["float32", [2, 3]]], [["complex64", [1]]]])
        return _frames(header, [r.randbytes(r.randint(0, 20)) for _ in range(r.randint(0, 2))]
                       if header["tensors"] else [b"x"])
    if kind == "unknown id":   # well-formed, about a window not in flight
        return packed
    other = r.choice([Hello(PROTOCOL_VERSION, 0, 0, 4, "cpu", "x", 1, SLOTS, CTX),
                      _window(wid, [0], [0], [1]), Shutdown("x")])
    return transport.pack(other)


class _Dropped(logging.Handler):
    """Counts the coordinator's log lines about messages it dropped."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("dropped")


@contextmanager
def _coordinator(tiny_model):
    """A Pipeline over one stage (layers 0-4) that serves in a thread of this process, and a
    socket of the test's own into the Pipeline's inbox."""
    run = Path(tempfile.mkdtemp(prefix="strata-f-"))
    inbox, first = f"unix://{run}/inbox", f"unix://{run}/s0"
    pipe = Pipeline(inbox, first)
    worker = StageWorker(WorkerConfig(model=str(tiny_model), stage=0, layer_start=0,
                                      layer_end=4, listen=first, coordinator=inbox, next=None,
                                      slots=SLOTS, ctx=CTX))
    thread = threading.Thread(target=worker.serve, name="fuzz-stage", daemon=True)
    thread.start()
    sockets = transport.Sockets()
    try:
        pipe.wait_for_hellos([Expect(0, 0, 4, worker.fingerprint, SLOTS, CTX)], timeout=60)
        yield pipe, sockets.push(inbox)
    finally:
        pipe.shutdown("test over")
        thread.join(30)
        sockets.close(linger_ms=0)
        pipe.close()
        shutil.rmtree(run, ignore_errors=True)
    assert not thread.is_alive(), "the stage did not stop on the Shutdown"


def _request(pipe: Pipeline) -> tuple[str, list[int]]:
    """One sampled request through a fresh scheduler: (finish reason, tokens)."""
    sched = Scheduler(pipe, SchedulerConfig(slots=SLOTS, groups=1, ctx=CTX, chunk_rows=8,
                                            window_rows=8), frozenset())
    req = sched.submit(PROMPT, SamplingParams(temperature=0.8, seed=5, max_tokens=2))
    while sched.step(timeout=20):
        pass
    assert sched.idle and not any(g.flights for g in sched.groups)
    return req.seq.finish_reason, req.seq.generated


def _drain(pipe: Pipeline, until=lambda: True, seconds: float = 10.0) -> None:
    """Read and drop what is in the inbox (as the pipeline does between windows), and what
    comes until `until()` holds, within `seconds`: the storm's messages the request did not
    read. Left unread, they would fill the intruder's queue and block its sends."""
    deadline = time.monotonic() + seconds
    pipe.check()
    while not until() and time.monotonic() < deadline:
        if pipe.inbox.poll(20):
            pipe.check()


def _storm_inbox(tiny_model, examples: int) -> None:
    dropped = _Dropped()
    loggers = [logging.getLogger(n) for n in ("strata.pipeline", "strata.scheduler")]
    with _coordinator(tiny_model) as (pipe, intruder):
        alone = _request(pipe)
        assert alone[0] == "length" and len(alone[1]) == 2
        for lg in loggers:
            lg.addHandler(dropped)

        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                         HealthCheck.data_too_large])
        @given(st.lists(inbox_malformed(), min_size=INBOX_STORM, max_size=INBOX_STORM))
        def storm(frames_list):
            _drain(pipe)   # what an earlier example left (one that failed, while shrinking)
            before = dropped.count
            for frames in frames_list:
                intruder.send_multipart(frames)
            # the storm comes in before and between the request's results (frames the kernel
            # did not take at once follow from the socket's sender thread)
            assert pipe.inbox.poll(5000)
            assert _request(pipe) == alone
            _drain(pipe, until=lambda: dropped.count - before >= len(frames_list))
            assert dropped.count - before == len(frames_list)

        try:
            storm()
        finally:
            for lg in loggers:
                lg.removeHandler(dropped)


def test_a_storm_in_the_coordinators_inbox_is_dropped_with_a_log_line(tiny_model):
    _storm_inbox(tiny_model, INBOX_FAST)


@pytest.mark.long
def test_a_long_storm_in_the_coordinators_inbox_is_dropped_with_a_log_line(tiny_model):
    _storm_inbox(tiny_model, INBOX_SLOW)
