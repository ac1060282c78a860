"""The OpenAI-compatible HTTP server (aiohttp) in front of the engine thread.

    POST /v1/completions, /v1/chat/completions   (stream: true gives server-sent events;
                   n choices of each prompt, choices.py)
    GET  /v1/models, /v1/models/{id}, /v1/status
    POST /tokenize, /detokenize   vLLM's shapes (tokenize_routes.py)
    GET  /version  {"version": strata's}; never gated
    GET  /health   200 while every stage process and the engine thread are alive and every
                   stage answers (no hang); never gated
    GET  /metrics  Prometheus text
    GET  /, /page.js   a page: a chat box and the pipeline live (page/); never gated

With an API key, every /v1 route, /tokenize and /detokenize want `Authorization: Bearer KEY`.
Every refusal is OpenAI's error object with a sentence saying what to change; the server stays
up after each. Request bodies are parsed and their prompts tokenized in a worker thread, so no
request holds up the event loop; connections.py bounds connections and the time a request may
take to arrive. A client that goes away (handler_cancellation) has its request cancelled: its
slots free at the next window and none of its tokens reach anyone; one that hangs up while
sending its body is a 499 too, not a failure.
"""
from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import socket
from typing import Callable

from aiohttp import web

from strata.coordinator.api import openai_api as api
from strata.coordinator.api import page, tokenize_routes
from strata.coordinator.api.connections import ConnectionPool, Limits, ServerConfig
from strata.coordinator.api.choices import Choices
from strata.coordinator.engine.engine import Engine
from strata.coordinator.grammar import Grammars
from strata.coordinator.engine.metrics import Metrics
from strata.coordinator.api.openai_api import ApiError
from strata.coordinator.api.openai_logprobs import Spelling
from strata.coordinator.api.prompts import Prompts
from strata.coordinator.api.request_fields import shown

log = logging.getLogger("strata.server")
KEYED = ("/tokenize", "/detokenize")   # beside /v1/*: the routes that want the key
try:
    VERSION = importlib.metadata.version("strata")
except importlib.metadata.PackageNotFoundError:   # run from a checkout, not installed
    VERSION = "unknown"


class ClientGone(Exception):
    """The client hung up before its request was read: a 499 in /metrics and the access log,
    not a failure."""


class Server:
    def __init__(self, engine: Engine, tok, vocab: int, cfg: ServerConfig, metrics: Metrics,
                 check_alive: Callable[[], None]):
        self.engine, self.tok, self.vocab, self.cfg = engine, tok, vocab, cfg
        self.metrics, self.check_alive = metrics, check_alive
        self.ctx = engine.cfg.ctx
        self.created = api.now()
        self.names = {cfg.model, *cfg.aliases}
        self.spelling = Spelling(tok)   # tokens as logprobs objects show them
        self.prompts = Prompts(tok, vocab, self.ctx, cfg.allow_control_tokens_in_messages)
        self.grammars = Grammars(tok, vocab)   # built when asked
        metrics.watch(lambda: engine.queued,
                      lambda: sum(s.state != "idle" for s in engine.snapshot.slots),
                      lambda: 0.0 if self.health_error() else 1.0, engine.cfg.slots)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body, middlewares=[self._middleware])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),
            web.get("/v1/status", self.status),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/version", self.version),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
            *page.routes(),
        ])
        return app

    # --- around every request -----------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        endpoint = await self._endpoint(request)
        status = 500
        try:
            self._authorize(request)
            response = await handler(request)
            status = 499 if request.get("client_gone") else response.status
            return response
        except ApiError as e:
            status = e.status
            response = web.json_response(e.body(), status=e.status)
            if e.status == 408:  # the rest of the body may never come: close, don't wait
                await response.prepare(request)
                await response.write_eof()
                request.protocol.force_close()
            return response
        except web.HTTPException as e:
            status = e.status
            return web.json_response(self._http_error(request, e).body(), status=e.status,
                                     headers={k: v for k, v in e.headers.items()
                                              if k == "Allow"})
        except ClientGone:   # the access log's line says 499; nothing failed here
            status = 499
            return web.Response(status=499)   # nobody reads it: the connection is closed
        except asyncio.CancelledError:  # the client went away (handler_cancellation)
            status = 499
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            e = ApiError(500, "the server failed on this request (a bug: see its log)")
            return web.json_response(e.body(), status=500)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()

    @staticmethod
    async def _endpoint(request: web.Request) -> str:
        """The route's path for /metrics: a known path asked with the wrong method too."""
        resource = request.match_info.route.resource
        if resource is not None:
            return resource.canonical
        for resource in request.app.router.resources():
            match, allowed = await resource.resolve(request)
            if match is None and allowed:
                return resource.canonical
        return "unmatched"

    def _authorize(self, request: web.Request) -> None:
        if self.cfg.api_key is None or not (request.path.startswith("/v1") or
                                            request.path in KEYED):
            return
        given = request.headers.get("Authorization", "")
        if not given:
            raise ApiError(401, "no API key was given; send the header 'Authorization: Bearer "
                                "KEY' with the key strata-launch was started with (--api-key)",
                           code="invalid_api_key")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.cfg.api_key.encode()):
            raise ApiError(401, "the API key is not this server's; send 'Authorization: Bearer "
                                "KEY' with the key strata-launch was started with (--api-key)",
                           code="invalid_api_key")

    def _http_error(self, request: web.Request, e: web.HTTPException) -> ApiError:
        if e.status == 404:
            return ApiError(404, f"there is no route {request.method} {request.path}; this "
                                 f"server has POST /v1/completions, POST /v1/chat/completions, "
                                 f"GET /v1/models, GET /v1/status, POST /tokenize, POST "
                                 f"/detokenize, GET /version, GET /health, GET /metrics "
                                 f"and a page at GET /",
                            code="unknown_url")
        if e.status == 405:
            return ApiError(405, f"{request.path} does not take {request.method}; use "
                                 f"{e.headers.get('Allow', 'another method')}",
                            code="method_not_allowed")
        if e.status == 413:
            return self._too_large(request)
        return ApiError(e.status, e.text or e.reason)

    def _too_large(self, request: web.Request) -> ApiError:
        size = f"{request.content_length} bytes" if request.content_length else "too large"
        return ApiError(413, f"the request body is {size}, over this server's limit of "
                             f"{self.cfg.max_body} bytes; send a shorter prompt",
                        code="request_too_large")

    async def _body(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self.cfg.max_body:
            raise self._too_large(request)
        try:
            return await asyncio.wait_for(request.read(), self.cfg.read_timeout)
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large(request) from None
        except ConnectionError:   # reset, or closed before Content-Length bytes came
            raise ClientGone("the client closed the connection while sending the request "
                             "body") from None
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise ApiError(408, f"the request body did not arrive within "
                                f"{self.cfg.read_timeout:g} s; send all of it (as many bytes "
                                f"as Content-Length says)", code="timeout") from None

    def _json(self, raw: bytes):
        try:
            return json.loads(raw)
        except RecursionError:
            raise ApiError(400, "the request body nests arrays or objects too deeply; send a "
                                "flat JSON object", code="invalid_json") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e}); send one JSON "
                                f"object, e.g. {{\"model\": \"{self.cfg.model}\", \"prompt\": "
                                f"\"Hello\"}}", code="invalid_json") from None

    # --- generation ---------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _check_model(self, body) -> None:
        if not isinstance(body, dict) or body.get("model") is None:
            return  # a missing model means this one (the only one)
        name = body["model"]
        if not isinstance(name, str):
            raise ApiError(400, f"'model' must be a string such as \"{self.cfg.model}\"",
                           "model", "invalid_type")
        if name not in self.names:
            raise ApiError(404, f"the model {shown(name)} does not exist here; this server "
                                f"serves \"{self.cfg.model}\" (GET /v1/models lists it)", "model",
                           "model_not_found")

    def _parse(self, raw: bytes, chat: bool) -> api.Parsed:
        body = self._json(raw)
        self._check_model(body)
        return api.parse(body, chat=chat, prompts=self.prompts, grammars=self.grammars)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await self._body(request)
        # parsing renders and tokenizes the prompts: off the event loop, which keeps serving
        p = await asyncio.to_thread(self._parse, raw, chat)
        choices = Choices(self.engine, api.new_id(chat), p)
        choices.submit()
        try:
            if p.stream:
                return await self._stream(request, choices)
            await choices.whole()
            return web.json_response(api.response(
                choices.id, self.cfg.model, p, choices.answers(self.tok.decode, self.spelling),
                api.now()))
        finally:
            if not choices.done:  # the client went away, or a choice failed: free the slots
                choices.cancel()

    async def _stream(self, request: web.Request, choices: Choices) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        try:
            await choices.stream(send, self.tok.decode, self.spelling, self.cfg.model, log)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client closed the stream: nobody to tell
            request["client_gone"] = True
            choices.cancel()
        return resp

    # --- tokens ---------------------------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        raw = await self._body(request)

        def run() -> dict:
            body = self._json(raw)
            self._check_model(body)
            return tokenize_routes.tokenize(body, self.prompts, self.tok.spellings)
        return web.json_response(await asyncio.to_thread(run))

    async def detokenize(self, request: web.Request) -> web.Response:
        raw = await self._body(request)

        def run() -> dict:
            body = self._json(raw)
            self._check_model(body)
            return tokenize_routes.detokenize(
                body, self.vocab, lambda ids: self.tok.decode(ids, skip_special=False))
        return web.json_response(await asyncio.to_thread(run))

    # --- information --------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [api.model_card(self.cfg.model, self.ctx, self.created)]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.names:
            raise ApiError(404, f"the model {name!r} does not exist here; this server serves "
                                f"\"{self.cfg.model}\"", "model", "model_not_found")
        return web.json_response(api.model_card(self.cfg.model, self.ctx, self.created))

    def health_error(self) -> str | None:
        if self.engine.failure:   # the first cause: what the engine stopped on
            return self.engine.failure
        if self.engine.restarting:   # requests wait meanwhile, and then go on
            return self.engine.restarting
        try:
            self.check_alive()  # polls the stage processes; raises PipelineError
        except Exception as e:
            return str(e)
        if not self.engine.alive:
            return "the engine thread has stopped"
        return None

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def health(self, request: web.Request) -> web.Response:
        error = self.health_error()
        if error:
            return web.json_response({"status": "unavailable", "error": error}, status=503)
        return web.json_response({"status": "ok"})

    async def status(self, request: web.Request) -> web.Response:
        snap, cfg = self.engine.snapshot, self.engine.cfg
        slots = []
        for s in snap.slots:
            view = {"slot": s.slot, "group": s.group, "state": s.state}
            if s.state == "idle":
                view["cached_tokens"] = s.held
            else:
                view.update(request=s.job, prompt_tokens=s.prompt_tokens, read=s.read,
                            reused=s.reused, generated=s.generated,
                            tok_s=None if s.tok_s is None else round(s.tok_s, 2),
                            drafts=s.draft_counts.report(cfg.max_draft_tokens))
            slots.append(view)
        groups = [{"group": g, "slots": [s.slot for s in snap.slots if s.group == g],
                   "window_in_flight": busy > 0, "windows_in_flight": busy,
                   # the last decode window sent: its rows and, of them, rows of requests
                   "decode_window": None if w is None else {"rows": w.rows, "live": w.live},
                   "drafts": draft_choice(c)}
                  for g, (busy, w, c) in enumerate(zip(snap.in_flight, snap.decode_windows,
                                                       snap.draft_choices))]
        error = self.health_error()
        return web.json_response({
            "model": self.cfg.model, "healthy": error is None, "error": error,
            "batch": cfg.slots, "batch_groups": cfg.groups, "window_rows": cfg.window_rows,
            "chunk_rows": cfg.chunk_rows, "ctx": cfg.ctx, "queued": self.engine.queued,
            "draft_tokens": cfg.draft_tokens, "drafter": cfg.drafter if cfg.draft_tokens else None,
            # how mtp proposes for requests with a temperature (greedy ones: argmax)
            "draft_sampling": (cfg.draft_sampling if cfg.draft_tokens and cfg.drafter == "mtp"
                               else None),
            # since the start; each slot's "drafts" counts its request's
            "drafts": snap.draft_counts.report(cfg.max_draft_tokens),
            "windows": snap.windows, "slots": slots, "groups": groups, "stages": self.engine.stages})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": self.metrics.content_type})


def draft_choice(c) -> dict | None:
    """A group's drafts per slot and why: its acceptance (a draft kept given the ones before
    it were), the measured ms of its windows of that size, the expected tokens (draft_choice.py)."""
    if c is None:
        return None
    return {"k": c.k, "rows": c.rows, "acceptance": round(c.acceptance, 4),
            "window_ms": None if c.window_ms is None else round(c.window_ms, 3),
            "tokens_per_window": round(c.tokens_per_window, 3),
            "tok_s": None if c.tok_s is None else round(c.tok_s, 1), "explored": c.explored,
            "timed": [{"rows": r, "k": k, "ms": ms} for r, k, ms in c.timed]}


async def serve(server: Server, sock: socket.socket, stop: asyncio.Event,
                ready: Callable[[str], None]) -> str | None:
    """Serve on the bound `sock` until `stop` is set; `ready(url)` once listening. Then stop
    taking requests, cancel the running ones and wait for the windows in flight (the engine's
    stop grace). Returns why the stages stopped serving before `stop` was set, if they did."""
    handler_args = {"access_log": log}
    runner = web.AppRunner(server.app(), handler_cancellation=True, shutdown_timeout=1.0,
                           **handler_args)
    await runner.setup()
    limits = Limits(server.cfg.read_timeout, server.cfg.max_connections,
                    server.cfg.max_client_connections)
    listening = await asyncio.get_running_loop().create_server(
        ConnectionPool(runner.server, limits, handler_args), sock=sock)
    host, port = sock.getsockname()[:2]
    ready(f"http://{_url_host(host)}:{port}/v1")
    try:
        await stop.wait()
        # a stage that dies of the same Ctrl-C (sent to the whole process group) is noticed
        # later than this: only a failure seen before the stop counts
        return server.engine.failure
    finally:
        server.engine.stop(wait=False)
        listening.close()
        await runner.cleanup()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
