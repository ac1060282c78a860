"""`strata-launch` without --prompt: the OpenAI-compatible HTTP server, driven by the official
`openai` client, as a user runs it (a child process on a free port).

The tiny random model checks shapes, usage, seeds, streaming, stop strings, disconnects, the
status and metrics routes and a short load test; SmolLM2 checks that HTTP answers are exactly
what `strata-launch --prompt` and the scheduler alone give, also with 8 clients streaming at
once through 4 slots in 2 groups. The server (the session's, conftest's smollm2_server) runs
2 stages, the last drafting 3 tokens a slot with SmolLM2's NextN head; "alone" runs in this
process on the session's 3-stage launch of SmolLM2 (conftest's smollm2_stages), and so does
the command of `strata-launch --prompt`, given that launch; the 8 clients' requests alone are
the session's reference (conftest's smollm2_alone, which test_batching compares with too).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import openai
import pytest

from conftest import (SMOLLM2_REQUESTS, SMOLLM2_SPLIT, SMOLLM2_TOKENS, smollm2_params,
                      stage_processes)
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import SchedulerConfig
from strata.bench import harness
from strata.bench.loadtest import ServerProcess
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer

CTX = 512
START_S = 240.0  # a shared 2-core machine: SmolLM2's stages may take a while to load


class Serving:
    """A server for one test module, its stages under a run directory of their own, so the
    teardown can check that SIGTERM left none behind (what no_stage_left checks per test)."""

    def __init__(self, args: list[str], tmp: Path, key: str | None = None):
        self.key = key
        self.own = tempfile.mkdtemp(prefix="st", dir="/tmp")  # short: ipc paths <= 107 bytes
        self.server = ServerProcess([*args, "--port", "0", "--log-dir", str(tmp)] +
                                    (["--api-key", key] if key else []), env={"TMPDIR": self.own})
        self.url = self.server.wait_ready(START_S)
        self.root = self.url.removesuffix("/v1")

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key or self.key or "none", max_retries=0,
                             timeout=120)

    def get(self, path: str) -> tuple[int, str]:
        auth = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.root + path, headers=auth),
                                        timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def status(self) -> dict:
        return json.loads(self.get("/v1/status")[1])

    def wait_idle(self, timeout: float = 20.0) -> dict:
        end = time.monotonic() + timeout
        while True:
            s = self.status()
            if all(x["state"] == "idle" for x in s["slots"]) and not s["queued"]:
                return s
            assert time.monotonic() < end, f"slots still busy: {s['slots']}"
            time.sleep(0.1)

    def close(self) -> None:
        try:
            code = self.server.stop(signal.SIGTERM)
            assert code == 0, self.server.stderr()
            assert "strata: stopped; every stage has exited" in self.server.stderr()
            assert "Traceback" not in self.server.stderr(), self.server.stderr()
        finally:
            deadline = time.monotonic() + 5
            while stage_processes(self.own) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = stage_processes(self.own)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            assert not left, f"stage processes left behind: {left}"


@pytest.fixture(scope="module")
def tiny(tiny_server):
    """The session's tiny server (conftest: 2 stages, 4 slots in 2 groups), which
    test_server_logprobs' cases share: they run in this module's group under xdist."""
    return tiny_server


TINY_GROUP = "test_server"


@pytest.fixture(scope="module")
def tiny_tok(tiny_model):
    return Tokenizer.from_gguf(ModelFile(tiny_model).reader)


# --- shapes, usage, seeds ---------------------------------------------------------------------

def test_completion_shape_usage_and_seed(tiny, tiny_tok):
    c = tiny.client()
    r = c.completions.create(model="tiny", prompt="hello world", max_tokens=7, temperature=0.8,
                             seed=42)
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tiny_tok.encode("hello world"))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.model_extra["seed"] == 42
    again = c.completions.create(model="tiny", prompt="hello world", max_tokens=7,
                                 temperature=0.8, seed=42)
    assert again.choices[0].text == r.choices[0].text


def test_a_chosen_seed_is_reported_and_reproduces(tiny):
    c = tiny.client()
    first = c.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=1.0)
    seed = first.model_extra["seed"]
    assert isinstance(seed, int) and seed >= 0
    again = c.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=1.0,
                                 seed=seed)
    assert again.choices[0].text == first.choices[0].text
    assert again.model_extra["seed"] == seed


def test_chat_shape(tiny, tiny_tok):
    c = tiny.client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, seed=7,
                                  extra_body={"top_k": 20, "min_p": 0.01})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tiny_tok.encode(tiny_tok.render_chat(msgs)))
    assert r.usage.completion_tokens == 5
    assert r.model_extra["seed"] == 7


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_equals_the_whole_answer(tiny, chat):
    c = tiny.client()
    kw = dict(model="tiny", max_tokens=24, temperature=0.9, seed=5)
    if chat:
        kw["messages"] = [{"role": "user", "content": "Tell me a story"}]
        whole = c.chat.completions.create(**kw)
        want = whole.choices[0].message.content
        chunks = list(c.chat.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        got = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        kw["prompt"] = "Tell me a story"
        whole = c.completions.create(**kw)
        want = whole.choices[0].text
        chunks = list(c.completions.create(**kw, stream=True,
                                           stream_options={"include_usage": True}))
        got = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert got == want
    assert all(ch.model_extra["seed"] == 5 for ch in chunks)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    # the seeded answer ends as the whole one did: at its stop token or after 24 tokens
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string_cuts_the_text(tiny, stream):
    c = tiny.client()
    base = c.completions.create(model="tiny", prompt="stop here", max_tokens=40, seed=1,
                                temperature=0.7).choices[0].text
    # the random model's text is mostly stray bytes: stop at its first ASCII pair after 4 chars
    at = next((i for i in range(4, len(base) - 2) if base[i:i + 2].isascii() and
               base[i:i + 2].isalnum()), None)
    assert at is not None, repr(base)
    stop = base[at:at + 2]
    want = base[:base.find(stop)]
    kw = dict(model="tiny", prompt="stop here", max_tokens=40, seed=1, temperature=0.7,
              stop=[stop, "never-there"])
    if stream:
        chunks = list(c.completions.create(**kw, stream=True))
        text = "".join(ch.choices[0].text for ch in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = c.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == want and finish == "stop"


# --- several choices ---------------------------------------------------------------------------

def test_n_choices_of_several_prompts_through_the_client(tiny, tiny_tok):
    """Choice j of prompt k (index k * n + j) is prompt k asked alone with seed + j; usage sums
    the prompts once each and every choice's tokens; token-id prompts give the same."""
    c = tiny.client()
    texts = ["hello world", "abc"]
    kw = dict(model="tiny", n=3, max_tokens=6, temperature=0.9, seed=5)
    r = c.completions.create(prompt=texts, **kw)
    assert [ch.index for ch in r.choices] == list(range(6))
    completion_tokens = 0
    for ch in r.choices:
        k, j = divmod(ch.index, 3)
        one = c.completions.create(**{**kw, "n": 1, "seed": 5 + j}, prompt=texts[k])
        assert (ch.text, ch.finish_reason) == (one.choices[0].text, one.choices[0].finish_reason)
        assert ch.model_extra["seed"] == 5 + j
        completion_tokens += one.usage.completion_tokens
    assert len({ch.text for ch in r.choices[:3]}) == 3   # the seeds differ, so do the texts
    assert r.usage.prompt_tokens == sum(len(tiny_tok.encode(t)) for t in texts)
    assert r.usage.completion_tokens == completion_tokens
    assert r.model_extra["seed"] == 5
    ids = c.completions.create(prompt=[tiny_tok.encode(t) for t in texts], **kw)
    assert [ch.text for ch in ids.choices] == [ch.text for ch in r.choices]


def test_a_stream_of_n_choices_through_the_client(tiny):
    c = tiny.client()
    kw = dict(model="tiny", n=3, max_tokens=8, temperature=0.9, seed=21,
              messages=[{"role": "user", "content": "Tell me a story"}])
    whole = c.chat.completions.create(**kw)
    texts, finishes, usage = {}, {}, None
    for chunk in c.chat.completions.create(**kw, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == {ch.index: ch.message.content for ch in whole.choices}
    assert finishes == {ch.index: ch.finish_reason for ch in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens   # one prompt, counted once


# --- routes ------------------------------------------------------------------------------------

def test_models_health_status(tiny):
    c = tiny.client()
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert c.models.retrieve("tiny").id == "tiny"
    code, body = tiny.get("/health")
    assert code == 200 and json.loads(body)["status"] == "ok"
    s = tiny.wait_idle()
    assert s["healthy"] and s["batch"] == 4 and s["batch_groups"] == 2
    assert [x["slot"] for x in s["slots"]] == [0, 1, 2, 3]
    assert [g["slots"] for g in s["groups"]] == [[0, 2], [1, 3]]
    assert [(st["stage"], st["layers"], st["device"]) for st in s["stages"]] == \
        [(0, [0, 2], "cpu"), (1, [2, 4], "cpu")]
    assert all(Path(f"/proc/{st['pid']}").exists() for st in s["stages"])
    # what each stage holds: the tiny F32 file's matrices as fp32 on a CPU, its KV cache
    for st in s["stages"]:
        assert st["weights"].startswith("kept quantized: none; loaded as float32: F32 x")
        assert st["memory"]["weights"] > 0 and st["memory"]["kv_cache"] > 0
        assert st["memory"]["scratch"] == 0 and st["memory"]["held"] == 0


def test_status_shows_a_decoding_slot(tiny):
    c = tiny.client()
    stream = c.completions.create(model="tiny", prompt="x", max_tokens=CTX - 10, stream=True)
    seen = None
    try:
        for i, _ in enumerate(stream):
            if i >= 5:
                seen = [s for s in tiny.status()["slots"] if s["state"] != "idle"]
                break
    finally:
        stream.close()
    assert seen and seen[0]["state"] == "decoding" and seen[0]["generated"] >= 1
    assert seen[0]["request"].startswith("cmpl-") and seen[0]["prompt_tokens"] == 1
    tiny.wait_idle()


def test_metrics_count_requests_tokens_and_windows(tiny):
    c = tiny.client()
    c.completions.create(model="tiny", prompt="count me", max_tokens=3)
    code, text = tiny.get("/metrics")
    assert code == 200
    lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
             if line and not line.startswith("#")}
    assert lines['strata_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert lines["strata_generated_tokens_total"] >= 3
    assert lines["strata_prompt_tokens_total"] >= 2
    assert lines["strata_slots"] == 4 and "strata_queue_depth" in lines
    assert "strata_slots_busy" in lines and lines["strata_up"] == 1
    for stage in (0, 1):
        assert lines[f'strata_stage_window_seconds_count{{kind="decode",stage="{stage}"}}'] >= 1
        assert lines[f'strata_stage_window_seconds_count{{kind="prefill",stage="{stage}"}}'] >= 1
    assert lines["strata_time_to_first_token_seconds_count"] >= 1
    assert lines['strata_finished_requests_total{reason="length"}'] >= 1


# --- disconnects --------------------------------------------------------------------------------

def _cancelled(tiny) -> float:
    text = tiny.get("/metrics")[1]
    return sum(float(line.split(" ")[1]) for line in text.splitlines()
               if line.startswith('strata_finished_requests_total{reason="cancelled"}'))


def _read_and_close(client, n_chunks: int = 3) -> int:
    stream = client.completions.create(model="tiny", prompt="I will leave", stream=True,
                                       max_tokens=CTX - 20, temperature=0.8, seed=9)
    got = 0
    for _ in stream:
        got += 1
        if got == n_chunks:
            break
    stream.close()
    return got


def test_disconnect_alone_frees_the_slot(tiny):
    before = _cancelled(tiny)
    assert _read_and_close(tiny.client()) == 3
    tiny.wait_idle()
    deadline = time.monotonic() + 10
    while _cancelled(tiny) < before + 1:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.1)


def test_disconnect_beside_another_request(tiny):
    c = tiny.client()
    kw = dict(model="tiny", prompt="I stay to the end", max_tokens=120, temperature=0.9,
              seed=11)
    alone = c.completions.create(**kw).choices[0]
    solo = alone.text
    result = {}

    def stay():
        chunks = list(c.completions.create(**kw, stream=True))
        result["text"] = "".join(ch.choices[0].text for ch in chunks)
        result["finish"] = chunks[-1].choices[0].finish_reason

    other = threading.Thread(target=stay)
    other.start()
    assert _read_and_close(c) == 3
    other.join(120)
    assert result["text"] == solo and result["finish"] == alone.finish_reason
    tiny.wait_idle()
    # the slot the leaver held serves the next request with exactly its solo tokens
    assert c.completions.create(**kw).choices[0].text == solo


# --- the load test, briefly ---------------------------------------------------------------------

def test_short_load_test(tiny_model, tmp_path, no_stage_left):
    out = subprocess.run(
        [sys.executable, "-m", "strata.bench", "loadtest", "--model", str(tiny_model),
         "--layer-split", "2", "--batch", "4", "--batch-groups", "2", "--ctx-size", str(CTX),
         "--clients", "12", "--duration", "2", "--max-tokens", "6", "--log-dir", str(tmp_path),
         "--json-out", str(tmp_path / "load.json")],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "load.json").read_text())
    assert report["errors"] == 0 and report["requests"] >= 12
    assert report["slots_idle"] == report["slots"] == 4 and report["queued"] == 0
    assert set(report["memory_mib"]) == {"0", "1"}
    assert all(m["start"] and m["end"] for m in report["memory_mib"].values())
    for words in ("requests completed", "errors              0", "tok/s", "p50", "p99",
                  "4 of 4 slots idle", "stage 1", "server stopped with exit code 0"):
        assert words in out.stdout, out.stdout


# --- exactness on SmolLM2 -----------------------------------------------------------------------

N_CLIENTS = SMOLLM2_REQUESTS
N_TOKENS = SMOLLM2_TOKENS
SEEDED = SamplingParams(temperature=0.7, top_k=20, seed=1234, max_tokens=N_TOKENS)


@pytest.fixture(scope="module")
def smol(smollm2_server):
    """The session's SmolLM2 server (conftest: 2 stages, 4 slots in 2 groups, MTP drafts)."""
    return smollm2_server


def _cli_text(args: list[str], stages) -> str:
    """`strata-launch --prompt` (its command, in this process) on the session's launch of the
    same stages."""
    from click.testing import CliRunner

    from strata.launch.cli import main
    from strata.launch.options import Prepared

    def launch(self, **kwargs):
        assert self.plan == stages.plan and self.sched.ctx <= stages.ctx, self.plan
        return nullcontext(stages)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Prepared, "launch", launch)
        out = CliRunner().invoke(main, ["--model", "smollm2-135m", "--layer-split",
                                        SMOLLM2_SPLIT, "--devices", "cpu", "--ctx-size",
                                        str(CTX), *args])
    assert out.exit_code == 0, (out.output, out.exception)
    assert out.stdout.endswith("\n")
    return out.stdout[:-1]


CHAT_PROMPT = "Name three colours."
COMPLETION_PROMPT = harness.PROMPTS[0]  # greedy: the session reference's request 0


@pytest.fixture(scope="module")
def solo(smollm2_stages, smollm2_alone):
    """Each request alone through the scheduler (one slot of the session's launch), in this
    process: the clients' and the greedy completion's from the session's reference, the chat
    here; and the seeded chat through `strata-launch --prompt` on the same launch."""
    assert smollm2_stages.ctx >= CTX
    tok, prompts, clients, clients_alone = smollm2_alone
    assert clients == [smollm2_params(i) for i in range(N_CLIENTS)]
    assert (prompts[0], clients[0]) == (tok.encode(COMPLETION_PROMPT),
                                        SamplingParams(max_tokens=N_TOKENS))
    chat_cli = _cli_text(["--chat", "--prompt", CHAT_PROMPT, "--max-tokens", str(N_TOKENS),
                          "--temperature", "0.7", "--top-k", "20", "--seed", "1234"],
                         smollm2_stages)
    chat = tok.encode(tok.render_chat([{"role": "user", "content": CHAT_PROMPT}]))
    chat_alone, = harness.run_alone(smollm2_stages, SchedulerConfig(slots=1, ctx=CTX), tok,
                                    [chat], [SEEDED])
    return {"clients": clients_alone, "chat": chat_alone, "greedy": clients_alone[0],
            "chat_cli": chat_cli}


@pytest.mark.slow
def test_http_equals_strata_launch_and_the_scheduler_alone(smol, solo):
    """The seeded chat (the chat template, sampling) over HTTP, from `strata-launch --prompt
    --chat` and from the scheduler alone; a greedy completion over HTTP and alone."""
    c = smol.client()
    chat = c.chat.completions.create(model="smollm2-135m", max_tokens=N_TOKENS,
                                     temperature=0.7, seed=1234, extra_body={"top_k": 20},
                                     messages=[{"role": "user", "content": CHAT_PROMPT}])
    greedy = c.completions.create(model="smollm2-135m", prompt=COMPLETION_PROMPT,
                                  max_tokens=N_TOKENS)
    chat_alone, greedy_alone = solo["chat"], solo["greedy"]
    assert chat.choices[0].message.content == solo["chat_cli"] == chat_alone.seq.final_text()
    assert chat.usage.completion_tokens == len(chat_alone.seq.generated)
    assert chat.model_extra["seed"] == 1234
    assert greedy.choices[0].text == greedy_alone.seq.final_text()
    assert greedy.usage.completion_tokens == len(greedy_alone.seq.generated)
    assert len(chat_alone.seq.generated) > 3 and len(greedy_alone.seq.generated) > 3


@pytest.mark.slow
def test_8_concurrent_streams_each_get_their_solo_tokens(smol, solo):
    c = smol.client()
    texts = harness.prompt_set(N_CLIENTS)
    start = threading.Barrier(N_CLIENTS)

    def one(i: int) -> str:
        p = smollm2_params(i)
        extra = {"top_k": p.top_k} if p.temperature else {}
        start.wait()
        chunks = c.completions.create(model="smollm2-135m", prompt=texts[i], stream=True,
                                      max_tokens=N_TOKENS, temperature=p.temperature,
                                      seed=p.seed, extra_body=extra)
        return "".join(ch.choices[0].text for ch in chunks)

    with ThreadPoolExecutor(N_CLIENTS) as pool:
        got = list(pool.map(one, range(N_CLIENTS)))
    for i, (text, alone) in enumerate(zip(got, solo["clients"])):
        assert text == alone.seq.final_text(), f"client {i}"
    smol.wait_idle()


# --- streamed text, without a server ------------------------------------------------------------

def test_text_stream_holds_back_what_may_still_change():
    from strata.coordinator.api.openai_api import TextStream
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    s = TextStream(decode, ("END",))
    deltas = [s.push(ord(c)) for c in "abENX"]
    assert deltas == ["a", "b", "", "", "ENX"]        # "E", "EN" may begin the stop string
    s = TextStream(decode, ("END",))
    assert [s.push(ord(c)) for c in "aEND"] == ["a", "", "", ""]
    assert s.finish("a") == "" and s.sent == "a"
    s = TextStream(decode, ())
    assert [s.push(i) for i in (ord("x"), 0xFFFD, ord("y"))] == ["x", "", "\ufffdy"]
    assert s.finish("x\ufffdyz") == "z"
