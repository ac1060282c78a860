"""strata.protocol: one round trip per message type, malformed input, and real ZeroMQ sockets."""
from __future__ import annotations

import re

import msgpack
import numpy as np
import pytest
import zmq

from strata.coordinator.sampling_params import SamplingParams, draw_uniform
from strata.coordinator.windows import Row, build_window
from strata.protocol import transport
from strata.protocol.messages import (PROTOCOL_VERSION, Error, Heartbeat, Hello, JoinAsk,
                                      JoinConfirm, JoinModel, JoinPlan, JoinRefused, JoinWait,
                                      ProtocolError, Result, Shutdown, Window, decode, encode)
from strata.protocol.rows import LogprobRow, SamplingRow
from strata.protocol.transport import pack, unpack

D = 64  # hidden size of the activations in these tests
W = 8   # window rows


def _hello(**kw) -> Hello:
    args = dict(version=PROTOCOL_VERSION, stage=1, layer_start=12, layer_end=24, device="cpu",
                fingerprint="0123456789abcdef", pid=4242, slots=8, ctx=2048,
                listen="unix:///tmp/strata-x/stage1")
    args.update(kw)
    return Hello(**args)


def _window(**kw) -> Window:
    """A decode window: 3 live rows (slots 0, 2, 5) and 5 pad rows; rows 0 and 2 sampled."""
    args = dict(id=17,
                slots=[0, 2, 5] + [-1] * 5,
                positions=[10, 99, 3] + [0] * 5,
                tokens=[1, 250, 7] + [0] * 5,
                commits=[[0, 10], [2, 99]],
                sample_rows=[0, 2],
                temperature=[0.0, 0.7],
                top_k=[0, 40],
                top_p=[1.0, 0.95],
                min_p=[0.0, 0.05],
                u=[0.0, 0.123456789012345],
                want_logits=True,
                stage_ms=[1.5, 2],
                propose=[[0, 3], [5, 1]],
                propose_u=[[0.25, 0.5, 0.999], []])   # slot 5 proposes by argmax
    args.update(kw)
    return Window(**args)


def _header(frames) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def _frames_bytes(frames) -> list[bytes]:
    """What a socket would carry: the header bytes and the raw bytes of each tensor."""
    return [f if isinstance(f, bytes) else f.tobytes() for f in frames]


def _activations(rows=W, d=D, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, d), dtype=np.float32)


# --- round trips ----------------------------------------------------------------------------

MESSAGES = {
    "hello": _hello(),
    "window": _window(),
    "window-defaults": Window(id=0, slots=[3], positions=[0], tokens=[11]),
    "window-penalties-logprobs": _window(
        penalty=[[1.1, 0.5, -0.25], []], output_start=[8, 0], bias_ids=[[3, 17], []],
        bias=[[-100.0, float("-inf")], []], logprob_rows=[1, 2], logprob_tokens=[250, -1],
        logprob_top=[0, 20]),
    "result": Result(id=17, tokens=[42, 7], stage_ms=[0.25, 1.0, 3.5],
                     proposals=[[0, 9, 8, 7], [5, 4]]),
    "result-logprobs": Result(id=17, tokens=[42], logprobs=[-0.5, -3.25],
                              top_ids=[[], [42, 9]], top_logprobs=[[], [-0.125, -2.0]]),
    "error": Error(stage=2, window=17, message="window 17: position 9000 is outside the context"),
    "error-no-window": Error(stage=0, window=-1, message="malformed message: ünïcode ✓"),
    "heartbeat": Heartbeat(seq=12),
    "heartbeat-answer": Heartbeat(seq=12, stage=2),
    "shutdown": Shutdown(reason="user pressed ctrl-c"),
    "shutdown-default": Shutdown(),
    "join-ask": JoinAsk(version=PROTOCOL_VERSION, stage=1),
    "join-model": JoinModel(stage=1, model="/models/llama3-8b.gguf", fingerprint="0123456789abcdef"),
    "join-confirm": JoinConfirm(stage=1, fingerprint="0123456789abcdef",
                                listen="tcp://10.0.0.2:41234"),
    "join-plan": JoinPlan(stage=1, args=["--stage", "1", "--layers", "16:32"]),
    "join-plan-empty": JoinPlan(stage=1, args=[]),
    "join-wait": JoinWait(stage=1, message="stage 2 joins first: stage 1 sends to it"),
    "join-refused": JoinRefused(stage=-1, message="the launch could not read the question"),
}


@pytest.mark.parametrize("name", list(MESSAGES))
def test_round_trip_without_tensors(name):
    msg = MESSAGES[name]
    frames = pack(msg)
    assert len(frames) == 1 and isinstance(frames[0], bytes)
    assert _header(frames)["type"] == type(msg).__name__
    assert _header(frames)["tensors"] == []
    back, tensors = unpack(_frames_bytes(frames))
    assert type(back) is type(msg)
    assert back == msg
    assert tensors == []


def test_encode_decode_is_identity_for_every_type():
    for msg in MESSAGES.values():
        assert decode(encode(msg)) == msg


def test_window_round_trip_keeps_values_and_types():
    msg = _window()
    back, _ = unpack(_frames_bytes(pack(msg)))
    assert back.u[1] == 0.123456789012345           # float64 on the wire: no rounding
    assert back.propose_u == [[0.25, 0.5, 0.999], []]
    assert back.commits == [[0, 10], [2, 99]]
    assert back.want_logits is True
    assert all(type(x) is int for x in back.slots + back.positions + back.tokens + back.top_k)


def test_a_windows_rows_are_records_laid_out_as_columns_and_read_back():
    """Window.from_rows lays the records out as the wire's columns, an optional one only where
    a row has it; sampled and scored read them back, on either side of the wire."""
    sampled = [SamplingRow(0.0, 0, 1.0, 0.0, 0.0, row=0, penalty=[1.1, 0.5, -0.25],
                           output_start=8, bias_ids=[3, 17], bias=[-100.0, float("-inf")]),
               SamplingRow(0.7, 40, 0.95, 0.05, 0.123456789012345, row=2, penalty=[],
                           output_start=0, bias_ids=[], bias=[])]
    scored = [LogprobRow(1, 250, 0), LogprobRow(2, -1, 20)]
    w = Window.from_rows(17, [0, 2, 5] + [-1] * 5, [10, 99, 3] + [0] * 5, [1, 250, 7] + [0] * 5,
                         sampled=sampled, scored=scored, commits=[[0, 10], [2, 99]],
                         want_logits=True, stage_ms=[1.5, 2], propose=[[0, 3], [5, 1]],
                         propose_u=[[0.25, 0.5, 0.999], []])
    assert w == MESSAGES["window-penalties-logprobs"] and w.sampled == sampled
    back, _ = unpack(_frames_bytes(pack(w)))
    assert back.sampled == sampled and back.scored == scored
    # no row with a penalty, a bias or a mask: those columns stay empty, each row's default
    plain = [SamplingRow(0.7, u=0.5, row=0), SamplingRow(row=2)]
    w = Window.from_rows(3, [0, 2, 5], [10, 99, 3], [1, 250, 7], sampled=plain)
    assert w.penalty == w.output_start == w.bias_ids == w.bias == w.mask == w.logprob_rows == []
    assert unpack(pack(w))[0].sampled == plain and w.scored == []
    masked = [SamplingRow(row=0), SamplingRow(row=2, mask=0)]
    w = Window.from_rows(3, [0, 2, 5], [10, 99, 3], [1, 250, 7], sampled=masked, masks=bytes(8))
    assert w.mask == [-1, 0] and unpack(pack(w))[0].sampled == masked


def test_build_window_lays_the_coordinators_rows_out_as_these_columns():
    hot = SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.2,
                         logit_bias=((9, -100.0),), logprobs=2)
    rows = [Row(0, 5, 11, score=(12, 0)),                        # a prompt row that scores
            Row(0, 6, 12, SamplingParams(), prompt_len=6, held_back=frozenset({4})),
            Row(1, 3, 8, hot, prompt_len=2, mask=0)]
    w = build_window(1, rows, 8, masks=np.zeros((1, 2), dtype=np.int32))
    assert (w.sample_rows, w.temperature, w.top_k, w.top_p, w.min_p, w.u) == (
        [1, 2], [0.0, 0.7], [0, 0], [1.0, 1.0], [0.0, 0.0], [0.0, draw_uniform(3, 4)])
    assert (w.penalty, w.output_start) == ([[], [1.2, 0.0, 0.0]], [6, 2])
    assert (w.bias_ids, w.bias) == ([[4], [9]], [[float("-inf")], [-100.0]])
    assert (w.logprob_rows, w.logprob_tokens, w.logprob_top) == ([0, 2], [12, -1], [0, 2])
    assert (w.mask, w.masks, w.slots[3:]) == ([-1, 0], bytes(8), [-1] * 5)
    assert unpack(pack(w))[0] == w


@pytest.mark.parametrize("extra, words", [
    ({"penalty": [[1.1, 0.0, 0.0]]}, "penalty has an entry per sampled row"),
    ({"penalty": [[1.1, 0.0], []]}, "not [] or [repetition"),
    ({"bias_ids": [[3], []], "bias": [[1.0, 2.0], []]}, "bias_ids and bias differ"),
    ({"logprob_rows": [1], "logprob_tokens": [], "logprob_top": [0]}, "differ in length"),
    ({"logprob_rows": [6], "logprob_tokens": [1], "logprob_top": [0]}, "pad row"),
])
def test_window_extras_of_the_wrong_shape_are_refused(extra, words):
    with pytest.raises(ProtocolError, match=re.escape(words)):
        _window(**extra)


def test_window_with_activations_frame():
    msg = _window()
    acts = _activations()
    frames = pack(msg, [acts])
    assert len(frames) == 2
    assert _header(frames)["tensors"] == [["float32", [W, D]]]
    back, tensors = unpack(_frames_bytes(frames))
    assert back == msg
    assert len(tensors) == 1
    assert tensors[0].dtype == np.float32 and tensors[0].shape == (W, D)
    assert np.array_equal(tensors[0], acts)


def test_result_with_logits_and_several_tensor_dtypes():
    msg = Result(id=3, tokens=[5, 6], stage_ms=[1.0])
    logits = np.random.default_rng(1).standard_normal((2, 320)).astype(np.float32)
    half = logits.astype(np.float16)
    bf16_bits = (logits.view(np.uint32) >> 16).astype(np.uint16)  # bf16 travels as uint16
    ids = np.arange(12, dtype=np.int64).reshape(3, 4)
    ids32 = ids.astype(np.int32)
    sent = [logits, half, bf16_bits, ids, ids32]
    back, tensors = unpack(_frames_bytes(pack(msg, sent)))
    assert back == msg
    assert len(tensors) == len(sent)
    for got, want in zip(tensors, sent):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)


def test_non_contiguous_tensor_is_sent_contiguous():
    acts = _activations(16, D)[::2]  # a strided view
    assert not acts.flags.c_contiguous
    back, tensors = unpack(_frames_bytes(pack(Result(1, [1]), [acts])))
    assert np.array_equal(tensors[0], acts)


def test_empty_tensor_round_trips():
    empty = np.zeros((0, D), dtype=np.float32)
    _, tensors = unpack(_frames_bytes(pack(Result(1, []), [empty])))
    assert tensors[0].shape == (0, D)


# --- malformed input ------------------------------------------------------------------------

def _raw(obj, *tensor_frames) -> list[bytes]:
    return [msgpack.packb(obj, use_bin_type=True), *tensor_frames]


def _expect(frames, *words):
    with pytest.raises(ProtocolError) as info:
        unpack(frames)
    text = str(info.value)
    for w in words:
        assert w in text, f"{w!r} not in error message {text!r}"
    return text


def test_empty_message():
    _expect([], "empty")


@pytest.mark.parametrize("blob", [b"\xc1", b"", b"\x92\x01", b"\x81\xa1a\x01\x02"])
def test_header_not_msgpack(blob):
    _expect([blob], "not msgpack")


@pytest.mark.parametrize("obj", [[1, 2, 3], 5, "Hello", None, {"kind": "Hello"}, {"type": 3}])
def test_header_not_a_typed_map(obj):
    _expect(_raw(obj), "not a map with a string 'type'")


def test_unknown_type():
    _expect(_raw({"type": "Bogus", "id": 1}), "unknown message type", "'Bogus'")


@pytest.mark.parametrize("missing", ["pid", "fingerprint", "version"])
def test_hello_missing_field(missing):
    header = encode(_hello())
    del header[missing]
    _expect(_raw(header), "Hello", f"lacks field {missing!r}")


def test_window_missing_field_and_defaults():
    header = encode(_window())
    del header["tokens"]
    _expect(_raw(header), "Window", "lacks field 'tokens'")
    # optional fields may be left out: they take their defaults
    back, _ = unpack(_raw({"type": "Window", "id": 1, "slots": [0], "positions": [0],
                           "tokens": [5]}))
    assert back == Window(id=1, slots=[0], positions=[0], tokens=[5])


def test_a_field_this_version_does_not_know_is_ignored():
    """Room for later per-row extras: a window carrying a field added by a later version
    decodes as the window without it."""
    header = encode(_window())
    header["logprobs"] = [5, 0]   # one per sampled row
    back, _ = unpack(_raw(header))
    assert back == _window()


@pytest.mark.parametrize("cls_name, field_name, value, words", [
    ("Hello", "slots", "8", ["Hello.slots", "should be int", "got str"]),
    ("Hello", "stage", True, ["Hello.stage", "should be int", "got bool"]),
    ("Hello", "pid", 1.5, ["Hello.pid", "should be int", "got float"]),
    ("Hello", "device", 0, ["Hello.device", "should be str", "got int"]),
    ("Hello", "fingerprint", b"abc", ["Hello.fingerprint", "should be str", "got bytes"]),
    ("Window", "slots", "0,1", ["Window.slots", "should be list[int]", "got str"]),
    ("Window", "slots", [0, True, -1, -1, -1, -1, -1, -1], ["Window.slots", "list[int]"]),
    ("Window", "positions", [1.0, 2, 0, 0, 0, 0, 0, 0], ["Window.positions", "list[int]"]),
    ("Window", "want_logits", 1, ["Window.want_logits", "should be bool", "got int"]),
    ("Window", "temperature", [0.0, "hot"], ["Window.temperature", "list[float]"]),
    ("Window", "u", [0.0, None], ["Window.u", "list[float]"]),
    ("Window", "top_k", [0, 4.0], ["Window.top_k", "list[int]"]),
    ("Window", "commits", [0, 10], ["Window.commits", "list[list[int]]"]),
    ("Window", "commits", [[0, "10"]], ["Window.commits", "list[list[int]]"]),
    ("Window", "propose_u", [0.5, 0.5], ["Window.propose_u", "list[list[float]]"]),
    ("Window", "propose_u", [[0.5, "x", 0.5], []], ["Window.propose_u", "list[list[float]]"]),
    ("Window", "id", None, ["Window.id", "should be int"]),
    ("Result", "tokens", {"0": 1}, ["Result.tokens", "should be list[int]", "got dict"]),
    ("Error", "message", ["x"], ["Error.message", "should be str", "got list"]),
    ("Shutdown", "reason", 3, ["Shutdown.reason", "should be str"]),
    ("JoinPlan", "args", ["--stage", 1], ["JoinPlan.args", "should be list[str]",
                                          "got list[int, str]"]),
    ("JoinPlan", "args", "--stage 1", ["JoinPlan.args", "should be list[str]", "got str"]),
])
def test_wrong_field_type(cls_name, field_name, value, words):
    base = {"Hello": _hello(), "Window": _window(), "Result": Result(1, [2]),
            "Error": Error(0, -1, "x"), "Shutdown": Shutdown(),
            "JoinPlan": JoinPlan(1, ["--stage", "1"])}[cls_name]
    header = encode(base)
    header[field_name] = value
    _expect(_raw(header), *words)


@pytest.mark.parametrize("change, words", [
    (dict(positions=[10, 99, 3]), ["window 17", "slots, positions and tokens differ in length"]),
    (dict(tokens=[1] * 9), ["slots, positions and tokens differ in length"]),
    (dict(u=[0.5]), ["window 17", "sampling lists differ in length"]),
    (dict(top_k=[0, 1, 2]), ["sampling lists differ in length"]),
    (dict(temperature=[]), ["sampling lists differ in length"]),
    (dict(sample_rows=[0, 8]), ["sampled row is out of range or a pad row"]),
    (dict(sample_rows=[0, 4]), ["sampled row is out of range or a pad row"]),  # row 4 is a pad
    (dict(sample_rows=[0, -1]), ["sampled row is out of range or a pad row"]),
    (dict(propose=[[3, 2]]), ["proposal request is not [slot, k >= 1]"]),   # slot 3 has no row
    (dict(propose=[[0, 0]]), ["proposal request is not [slot, k >= 1]"]),
    (dict(propose=[[0]]), ["proposal request is not [slot, k >= 1]"]),
    (dict(propose_u=[[0.5, 0.5, 0.5]]),
     ["propose_u and propose differ in length; send one propose_u entry per proposal "
      "request, or none"]),
    (dict(propose_u=[[0.5, 0.5], []]),   # slot 0 asks for 3
     ["slot 0's propose_u entry must be [] (argmax) or one uniform in [0, 1) per proposal"]),
    (dict(propose_u=[[0.5, 0.5, 1.0], []]), ["slot 0's propose_u entry must be"]),
    (dict(propose_u=[[0.5, 0.5, -0.1], []]), ["slot 0's propose_u entry must be"]),
    (dict(propose_u=[[], [float("nan")]]), ["slot 5's propose_u entry must be"]),
])
def test_window_inconsistent_lists(change, words):
    header = encode(_window())
    header.update(change)
    _expect(_raw(header), *words)
    # the dataclass refuses the same window when built directly
    with pytest.raises(ProtocolError):
        _window(**change)


def test_tensor_count_mismatch():
    frames = _frames_bytes(pack(_window(), [_activations()]))
    _expect(frames[:1], "header lists 1 tensors but 0 frames came")
    _expect(frames + [frames[1]], "header lists 1 tensors but 2 frames came")
    no_spec = _raw(encode(_window()), frames[1])  # no "tensors" entry at all
    _expect(no_spec, "header lists 0 tensors but 1 frames came")
    bad_spec = encode(_window())
    bad_spec["tensors"] = "float32"
    _expect(_raw(bad_spec, frames[1]), "tensors but 1 frames came")


def test_tensor_frame_size_mismatch():
    header = encode(_window())
    header["tensors"] = [["float32", [W, D]]]
    good = _activations().tobytes()
    _expect(_raw(header, good[:-4]), "does not match its spec", "float32")     # one value short
    _expect(_raw(header, good + b"\0" * 4), "does not match its spec")          # one value extra
    _expect(_raw(header, good[:-1]), "does not match its spec")                 # not whole values
    header["tensors"] = [["float32", [W, D + 1]]]
    _expect(_raw(header, good), "does not match its spec")


@pytest.mark.parametrize("spec", [
    "float32", ["float32"], ["float32", [W, D], 0], ["float32", "big"], ["float32", [W, "D"]],
    ["float32", [-1]], ["float32", [W, -1]],
])
def test_malformed_tensor_spec(spec):
    header = encode(Result(1, [2]))
    header["tensors"] = [spec]
    _expect(_raw(header, _activations().tobytes()), "does not match its spec")


@pytest.mark.parametrize("dtype", ["float64", "object", "complex64", "int8", "<f4", "bogus"])
def test_disallowed_dtype(dtype):
    header = encode(Result(1, [2]))
    header["tensors"] = [[dtype, [4]]]
    _expect(_raw(header, b"\0" * 32), "tensor dtype", repr(dtype), "not allowed")


def test_sending_float64_is_refused_by_the_receiver():
    frames = _frames_bytes(pack(Result(1, [2]), [np.zeros((2, 2), dtype=np.float64)]))
    _expect(frames, "'float64' is not allowed")


def test_decode_rejects_non_dict_directly():
    with pytest.raises(ProtocolError, match="not a map"):
        decode([("type", "Hello")])


# --- real sockets ---------------------------------------------------------------------------

@pytest.fixture
def zmq_context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _pair(ctx: zmq.Context, endpoint: str) -> tuple[zmq.Socket, zmq.Socket]:
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 5000)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(endpoint)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 5000)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(endpoint)
    return push, pull


@pytest.mark.parametrize("kind", ["inproc", "ipc"])
def test_window_over_real_sockets(zmq_context, tmp_path, kind):
    endpoint = "inproc://stage0" if kind == "inproc" else f"ipc://{tmp_path}/stage0"
    push, pull = _pair(zmq_context, endpoint)
    acts = _activations(seed=5)
    msg = _window()
    transport.send(push, msg, [acts])
    acts_copy = acts.copy()
    back, tensors = transport.recv(pull)
    assert back == msg
    assert len(tensors) == 1 and tensors[0].shape == (W, D) and tensors[0].dtype == np.float32
    assert np.array_equal(tensors[0], acts_copy)

    # a chain of messages keeps its order; a bad header on the wire is a ProtocolError, and
    # the socket keeps working afterwards
    logits = np.random.default_rng(9).standard_normal((2, 320)).astype(np.float32)
    transport.send(push, Result(17, [4, 2], [1.0]), [logits])
    push.send_multipart([b"\xc1"])
    transport.send(push, Shutdown("done"))
    back, tensors = transport.recv(pull)
    assert back == Result(17, [4, 2], [1.0]) and np.array_equal(tensors[0], logits)
    with pytest.raises(ProtocolError, match="not msgpack"):
        transport.recv(pull)
    assert transport.recv(pull) == (Shutdown("done"), [])


def test_socket_failures_are_transport_errors(zmq_context, tmp_path):
    """A socket that fails raises the protocol's TransportError, whichever kind it is."""
    sockets = transport.Sockets()
    try:
        with pytest.raises(transport.TransportError, match="cannot bind"):
            sockets.pull(f"unix://{tmp_path}/no-such-dir/inbox")
        with pytest.raises(transport.TransportError, match="cannot connect"):
            sockets.push("tcp://no host here")
    finally:
        sockets.close(linger_ms=0)
    push = zmq_context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 0)   # no peer: a send cannot be queued
    push.connect(f"ipc://{tmp_path}/nobody")
    push.close()
    with pytest.raises(transport.TransportError, match="cannot send a Shutdown"):
        transport.send(push, Shutdown("x"))
