"""The page at `/`: served without the key while the API stays keyed (in this process, on a fake
pipeline), and driven in a real headless browser (Debian's chromium, through the DevTools
protocol over aiohttp's websocket client) against `strata-launch` serving SmolLM2 on 2 CPU
stages with --api-key (the session's server, conftest's smollm2_server, which drafts with
SmolLM2's NextN head): the page asks for the key, shows every stage, and a prompt typed into
the box streams the answer the API gives for the same request, with the user's markup shown as
text."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from aiohttp import ClientSession, WSMsgType
from aiohttp.test_utils import TestClient, TestServer

from strata.coordinator.api.connections import ServerConfig
from strata.coordinator.engine.engine import Engine
from strata.coordinator.engine.metrics import Metrics
from strata.coordinator.engine.scheduler import SchedulerConfig
from strata.coordinator.api.server import Server
from test_scheduler import FakePipeline

KEY = "page-test-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_page_loads_without_the_key_and_the_api_still_wants_it():
    metrics = Metrics()
    engine = Engine(FakePipeline(2, 64), SchedulerConfig(slots=2, groups=2, ctx=64),
                    frozenset(), lambda ids: "", metrics)
    server = Server(engine, None, 64, ServerConfig(model="fake", api_key=KEY), metrics,
                    lambda: None)

    async def main():
        async with TestClient(TestServer(server.app())) as client:
            page = await client.get("/")
            html = await page.text()
            script_src = re.search(r'<script src="([^"]+)">', html).group(1)
            script = await client.get("/" + script_src)
            js = await script.text()
            refused = await client.get("/v1/status")
            keyed = await client.get("/v1/status", headers={"Authorization": f"Bearer {KEY}"})
            return page, html, script, js, refused.status, await keyed.json()

    page, html, script, js, refused, status = asyncio.run(main())
    assert page.status == 200 and page.content_type == "text/html"
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert "<script>" not in html   # no inline script: the policy would block it
    assert script.status == 200 and script.content_type == "application/javascript"
    assert "v1/chat/completions" in js and "Bearer " in js
    assert refused == 401
    assert [g["windows_in_flight"] for g in status["groups"]] == [0, 0]


# --- in a browser -------------------------------------------------------------------------------

class Browser:
    """Headless chromium and one page, driven over the DevTools protocol."""

    def __init__(self, profile: Path):
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", f"--user-data-dir={profile}",
             "--remote-debugging-port=0", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.profile, self.ids = profile, 0

    async def connect(self, session: ClientSession, timeout: float = 20.0) -> None:
        port_file = self.profile / "DevToolsActivePort"   # chromium writes it once listening
        end = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            assert self.proc.poll() is None, f"chromium exited with code {self.proc.returncode}"
            assert time.monotonic() < end, "chromium did not open its DevTools port"
            await asyncio.sleep(0.1)
        port = port_file.read_text().split()[0]
        async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
            target = next(t for t in await r.json() if t["type"] == "page")
        self.ws = await session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)

    async def call(self, method: str, **params):
        self.ids += 1
        await self.ws.send_json({"id": self.ids, "method": method, "params": params})
        async for msg in self.ws:   # events (no "id") are not asked for: skip them
            assert msg.type == WSMsgType.TEXT, msg
            answer = json.loads(msg.data)
            if answer.get("id") == self.ids:
                assert "error" not in answer, answer
                return answer["result"]
        raise AssertionError("the DevTools connection closed")

    async def js(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    async def until(self, expression: str, timeout: float, what: str):
        end = time.monotonic() + timeout
        while not (value := await self.js(expression)):
            assert time.monotonic() < end, f"{what} within {timeout:g} s"
            await asyncio.sleep(0.1)
        return value

    async def type_into(self, element_id: str, text: str) -> None:
        await self.js(f"document.getElementById({json.dumps(element_id)}).focus()")
        await self.call("Input.insertText", text=text)

    async def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            await self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                            windowsVirtualKeyCode=13)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


PROMPT = 'What is the capital of France? <img src=x onerror="document.title=\'run\'"> & <b>'
TOKENS = 16


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs a browser: Debian's chromium package "
                    "(apt-get install -y chromium), which .ci/run installs")
def test_the_page_in_a_browser_streams_a_chat_and_shows_every_stage(tmp_path, smollm2_server):
    """The session's SmolLM2 server (conftest: strata-launch as a child process, keyed)."""
    serving = smollm2_server
    browser = Browser(tmp_path / "profile")
    try:
        page = asyncio.run(_drive(browser, serving.root, serving.key))
        expected = serving.client().chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": PROMPT}],
            max_tokens=TOKENS, temperature=0)
    finally:
        browser.close()
    # the stage table: both stages, their layers and device
    assert page["stages"] == [["0", "[0, 15)", "cpu"], ["1", "[15, 30)", "cpu"]]
    # the user's markup is text, not elements; nothing it held ran
    assert page["user"] == PROMPT and page["markup"] == 0 and page["title"] == "strata"
    # the answer came in several chunks and is the API's own answer to the same request
    assert page["chunks"] > 1, page
    assert page["answer"] == expected.choices[0].message.content != ""
    assert page["decode_timed"], page   # /metrics read: stage 0's decode windows, timed


async def _drive(browser: Browser, root: str, key: str) -> dict:
    async with ClientSession() as session:
        await browser.connect(session)
        await browser.call("Page.navigate", url=root + "/")
        await browser.until("document.readyState === 'complete' && "
                            "!document.getElementById('auth-notice').hidden", 20,
                            "the page asks for the API key")
        await browser.type_into("key", key)
        await browser.js("document.getElementById('prompt').focus()")   # the key's change event
        rows = "[...document.querySelectorAll('#stages tbody tr')]"
        await browser.until(f"{rows}.length === 2", 10, "the stage table shows 2 stages")
        stages = await browser.js(
            f"{rows}.map(r => [...r.cells].slice(0, 3).map(c => c.textContent))")
        await browser.js(f"document.getElementById('max-tokens').value = '{TOKENS}';"
                         "document.getElementById('temperature').value = '0'")
        await browser.type_into("prompt", PROMPT)
        await browser.press_enter()
        answer = "document.querySelector('.message.assistant')"
        state = await browser.until(f"{answer} && ['done', 'failed'].includes("
                                    f"{answer}.dataset.state) && {answer}.dataset.state", 60,
                                    "the answer finishes streaming")
        assert state == "done", await browser.js(f"{answer}.textContent")
        decode_timed = await browser.until(
            f"{rows}[0].cells[7].textContent.includes('ms')", 10,
            "the stage table shows the decode windows' time from /metrics")
        return {"stages": stages, "decode_timed": decode_timed,
                **await browser.js(f"""({{
            user: document.querySelector('.message.user .text').textContent,
            markup: document.querySelectorAll('#messages img, #messages b').length,
            title: document.title,
            answer: {answer}.querySelector('.text').textContent,
            chunks: Number({answer}.dataset.chunks)}})""")}
