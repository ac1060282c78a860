"""Every request a user can get wrong gets OpenAI's error object, the right status code and a
sentence saying what to change, and the server stays up; --api-key guards /v1 but not /health;
a stage that dies turns /health and new requests into 503; Ctrl-C stops everything."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import openai
import pytest

from conftest import stage_processes
from strata.bench.loadtest import ServerProcess
from test_server import CTX, START_S, Serving

KEY = "sekret-key"


@pytest.fixture(scope="module")
def guarded(tiny_model, tmp_path_factory):
    s = Serving(["--model", str(tiny_model), "--layer-split", "2", "--batch", "2",
                 "--ctx-size", str(CTX)], tmp_path_factory.mktemp("logs"), key=KEY)
    yield s
    s.close()


def raw(url: str, body: bytes | None = None, method: str = "POST", key: str | None = KEY,
        headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method, headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
        **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_error(status: int, body: dict, want_status: int, *words: str, param=None,
                 code=None) -> None:
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == ("server_error" if want_status >= 500 else "invalid_request_error")
    for w in words:
        assert w.lower() in err["message"].lower(), (w, err["message"])
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


C, P = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
LONG = [65] * (CTX + 10)   # token ids: a prompt longer than the context

# id: (route, body, status, param, words the message must hold)
BAD = {
    "wrong-type-max-tokens": (C, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens",
                              ["must be an integer", "string"]),
    "wrong-type-temperature": (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature",
                               ["must be a number"]),
    "wrong-type-bool-as-number": (C, {"prompt": "x", "top_p": True}, 400, "top_p",
                                  ["must be a number", "boolean"]),
    "wrong-type-stream": (P, {"messages": USER, "stream": "yes"}, 400, "stream",
                          ["must be a boolean"]),
    "wrong-type-messages": (P, {"messages": "hi"}, 400, "messages", ["array of messages"]),
    "wrong-type-prompt": (C, {"prompt": 5}, 400, "prompt", ["a string, an array of token ids"]),
    "wrong-type-stop": (C, {"prompt": "x", "stop": 3}, 400, "stop", ["string or an array"]),
    "missing-prompt": (C, {"max_tokens": 3}, 400, "prompt", ["'prompt' is missing"]),
    "missing-messages": (P, {}, 400, "messages", ["'messages' is missing"]),
    "empty-prompt": (C, {"prompt": ""}, 400, "prompt", ["prompt is empty"]),
    "empty-token-prompt": (C, {"prompt": []}, 400, "prompt", ["prompt is empty"]),
    "empty-messages": (P, {"messages": []}, 400, "messages", ["empty"]),
    "empty-message-text": (P, {"messages": [{"role": "user", "content": ""}]}, 400, "messages",
                           ["every message is empty"]),
    "bad-role": (P, {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
                 "messages[0].role", ["'wizard'", "user"]),
    "image-part": (P, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content",
                   ["image_url", "text parts only"]),
    "token-out-of-vocab": (C, {"prompt": [1, 99999]}, 400, "prompt", ["99999", "vocabulary"]),
    "one-of-several-prompts": (C, {"prompt": ["a", [1, 99999]]}, 400, "prompt",
                               ["prompt[1]", "99999", "vocabulary"]),
    "too-many-prompts": (C, {"prompt": ["a"] * 129}, 400, "prompt", ["129 prompts",
                                                                      "at most 128"]),
    "too-many-choices": (C, {"prompt": ["a", "b", "c"], "n": 50}, 400, "n",
                         ["3 prompts with n=50", "150 choices", "at most 128"]),
    "prompt-over-ctx": (C, {"prompt": LONG, "max_tokens": 1}, 400, "prompt",
                        [f"context of {CTX}", "--ctx-size"]),
    "prompt-plus-max-tokens-over-ctx": (C, {"prompt": "hello", "max_tokens": CTX}, 400,
                                        "max_tokens", [f"context is {CTX}", "lower max_tokens"]),
    "chat-over-ctx": (P, {"messages": USER, "max_completion_tokens": CTX + 5}, 400,
                      "max_completion_tokens", ["lower max_completion_tokens"]),
    "max-tokens-zero": (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens",
                        ["below 1"]),
    "temperature-below-0": (C, {"prompt": "x", "temperature": -0.5}, 400, "temperature",
                            ["below 0", "0 for greedy"]),
    "top-p-zero": (C, {"prompt": "x", "top_p": 0}, 400, "top_p", ["outside (0, 1]"]),
    "top-p-above-1": (P, {"messages": USER, "top_p": 1.5}, 400, "top_p", ["outside (0, 1]"]),
    "top-k-negative": (C, {"prompt": "x", "top_k": -3}, 400, "top_k", ["below 0"]),
    "min-p-above-1": (C, {"prompt": "x", "min_p": 2}, 400, "min_p", ["outside [0, 1]"]),
    "seed-negative": (C, {"prompt": "x", "seed": -1}, 400, "seed", ["non-negative"]),
    "n-above-128": (P, {"messages": USER, "n": 129}, 400, "n", ["n 129 is above 128"]),
    "n-zero": (C, {"prompt": "x", "n": 0}, 400, "n", ["n 0 is below 1"]),
    "message-name": (P, {"messages": [{"role": "user", "content": "hi", "name": "ana"}]}, 400,
                     "messages[0].name", ["messages[0].name is not supported",
                                          "write it into 'content'"]),
    "message-tool-call-id": (P, {"messages": [*USER, {"role": "tool", "content": "42",
                                                      "tool_call_id": "c1"}]}, 400,
                             "messages[1].tool_call_id", ["function calling is not supported"]),
    "message-unknown-field": (P, {"messages": [{"role": "user", "content": "hi", "mood": 1}]},
                              400, "messages[0].mood", ["not a message field", "remove it"]),
    "stream-options-without-stream": (C, {"prompt": "x", "stream_options": {
        "include_usage": True}}, 400, "stream_options", ["streamed answers only",
                                                         "\"stream\": true"]),
    "top-logprobs-above-20": (P, {"messages": USER, "logprobs": True, "top_logprobs": 21},
                              400, "top_logprobs", ["above 20"]),
    "top-logprobs-alone": (P, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs",
                           ["needs \"logprobs\": true"]),
    "chat-logprobs-number": (P, {"messages": USER, "logprobs": 3}, 400, "logprobs",
                             ["must be a boolean"]),
    "completion-logprobs-above-20": (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs",
                                     ["above 20"]),
    "completion-top-logprobs": (C, {"prompt": "x", "top_logprobs": 2}, 400, "top_logprobs",
                                ["'logprobs': N"]),
    "chat-echo": (P, {"messages": USER, "echo": True}, 400, "echo", ["/v1/completions only"]),
    "penalty": (C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty",
                ["outside [-2, 2]"]),
    "repetition-zero": (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty",
                        ["outside (0, 100]", "1 to turn it off"]),
    "logit-bias-not-a-token": (C, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias",
                               ["token ids"]),
    "logit-bias-long-key": (C, {"prompt": "x", "logit_bias": {"9" * 5000: 1}}, 400,
                            "logit_bias", ["token ids"]),
    "logit-bias-out-of-vocab": (P, {"messages": USER, "logit_bias": {"99999": 1}}, 400,
                                "logit_bias", ["99999", "vocabulary"]),
    "logit-bias-too-large": (C, {"prompt": "x", "logit_bias": {"3": 101}}, 400, "logit_bias",
                             ["outside [-100, 100]"]),
    "min-tokens-above-max": (C, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400,
                             "min_tokens", ["at most max_tokens (2)"]),
    "stop-token-ids-out-of-vocab": (P, {"messages": USER, "stop_token_ids": [99999]}, 400,
                                    "stop_token_ids", ["99999", "vocabulary"]),
    "tools": (P, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
              400, "tools", ["not supported"]),
    "empty-stop": (C, {"prompt": "x", "stop": [""]}, 400, "stop", ["empty"]),
    "body-not-object": (C, [1, 2], 400, None, ["must be a JSON object", "array"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_request_gets_a_sentence(case, guarded):
    route, body, status, param, words = BAD[case]
    got = raw(guarded.url.removesuffix("/v1") + route, json.dumps(body).encode())
    assert_error(*got, status, *words, param=param)


def test_malformed_json(guarded):
    got = raw(guarded.url + "/completions", b'{"prompt": "x", "max_tokens": ')
    assert_error(*got, 400, "not valid JSON", code="invalid_json")


def test_unknown_model_through_the_client(guarded):
    with pytest.raises(openai.NotFoundError) as e:
        guarded.client().chat.completions.create(model="gpt-4o", messages=USER,
                                                    max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert "'gpt-4o' does not exist" in e.value.message and "tiny" in e.value.message
    with pytest.raises(openai.NotFoundError):
        guarded.client().models.retrieve("gpt-4o")


def test_bad_request_through_the_client(guarded):
    with pytest.raises(openai.BadRequestError) as e:
        guarded.client().completions.create(model="tiny", prompt="x", temperature=-1)
    assert e.value.param == "temperature" and "below 0" in e.value.message


def test_oversize_body(guarded):
    body = json.dumps({"prompt": "x" * (3 << 20)}).encode()
    got = raw(guarded.url + "/completions", body)
    assert_error(*got, 413, "over this server's limit", "shorter prompt",
                 code="request_too_large")


def test_unknown_route_and_method(guarded):
    got = raw(guarded.url + "/embeddings", b"{}")
    assert_error(*got, 404, "no route POST /v1/embeddings", "/v1/chat/completions")
    got = raw(guarded.url + "/completions", method="GET")
    assert_error(*got, 405, "does not take GET", "POST")


def test_api_key(guarded):
    root = guarded.url.removesuffix("/v1")
    assert_error(*raw(guarded.url + "/models", method="GET", key=None), 401,
                 "no API key was given", "Authorization: Bearer", code="invalid_api_key")
    assert_error(*raw(guarded.url + "/models", method="GET", key="wrong"), 401,
                 "not this server's", code="invalid_api_key")
    assert_error(*raw(guarded.url + "/status", method="GET", key=None), 401)
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
    assert raw(root + "/health", method="GET", key=None)[0] == 200
    assert raw(guarded.url + "/models", method="GET")[0] == 200


def test_server_is_still_up_after_every_mistake(guarded):
    r = guarded.client().completions.create(model="tiny", prompt="still here", max_tokens=4)
    assert r.usage.completion_tokens == 4
    assert raw(guarded.url.removesuffix("/v1") + "/health", method="GET")[0] == 200
    metrics = urllib.request.urlopen(guarded.url.removesuffix("/v1") + "/metrics").read()
    assert b'strata_requests_total{endpoint="/v1/completions",status="400"}' in metrics
    assert b'status="401"' in metrics and b'status="413"' in metrics
    guarded.wait_idle()


# --- failures and stopping ----------------------------------------------------------------------

def _start(tiny_model, tmp_path) -> ServerProcess:
    server = ServerProcess(["--model", str(tiny_model), "--layer-split", "2", "--ctx-size",
                            str(CTX), "--port", "0", "--log-dir", str(tmp_path)])
    server.wait_ready(START_S)
    return server


def test_a_dead_stage_gives_503_and_a_failing_health(tiny_model, tmp_path, no_stage_left):
    server = _start(tiny_model, tmp_path)
    try:
        url = server.url
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        status = json.loads(urllib.request.urlopen(url + "/status").read())
        stage1 = status["stages"][1]["pid"]
        stream = c.completions.create(model="tiny", prompt="x", max_tokens=CTX - 10,
                                      stream=True)
        next(iter(stream))
        import os
        os.kill(stage1, signal.SIGKILL)
        with pytest.raises(openai.APIError) as e:  # the stream ends with the error event
            for _ in stream:
                pass
        assert "stage 1 exited" in str(e.value)
        code, body = raw(url.removesuffix("/v1") + "/health", method="GET", key=None)
        assert code == 503 and "stage 1 exited" in body["error"]
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and "restart strata-launch" in e.value.message
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 1, server.stderr()
    assert "strata-launch: the stages stopped serving: stage 1 exited" in server.stderr()


def test_ctrl_c_while_streaming_stops_everything(tiny_model, tmp_path, no_stage_left):
    server = _start(tiny_model, tmp_path)
    c = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    stream = c.completions.create(model="tiny", prompt="x", max_tokens=CTX - 10, stream=True)
    next(iter(stream))
    t0 = time.monotonic()
    code = server.stop(signal.SIGINT)
    assert time.monotonic() - t0 < 15
    assert code == 0, server.stderr()
    err = server.stderr()
    assert "strata: stopping" in err and "strata: stopped; every stage has exited" in err
    assert "Traceback" not in err
    stream.close()


def test_ctrl_c_to_the_process_group_removes_the_run_directory(tiny_model, no_stage_left):
    """Ctrl-C in a terminal signals the launcher and every stage: the stages leave it to the
    launcher, which stops them and removes its run directory (the stage logs are in it), and
    exits 0 as after SIGTERM."""
    server = ServerProcess(["--model", str(tiny_model), "--layer-split", "2", "--ctx-size",
                            str(CTX), "--port", "0"], own_group=True)
    server.wait_ready(START_S)
    (run_dir,) = os.listdir(no_stage_left)
    assert run_dir.startswith("strata-") and stage_processes(run_dir), run_dir
    c = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    stream = c.completions.create(model="tiny", prompt="x", max_tokens=CTX - 10, stream=True)
    next(iter(stream))
    code = server.stop(signal.SIGINT, group=True)
    err = server.stderr()
    assert code == 0, err
    assert ("strata: stopped; every stage has exited" in err
            and "the stage logs are kept" not in err), err
    assert os.listdir(no_stage_left) == [], err
    assert stage_processes(run_dir) == []
    stream.close()
