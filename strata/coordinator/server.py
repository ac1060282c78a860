"""The OpenAI-compatible HTTP server (aiohttp) in front of the engine thread.

    POST /v1/completions, /v1/chat/completions   (stream: true gives server-sent events)
    GET  /v1/models, /v1/models/{id}, /v1/status
    GET  /health   200 while every stage process and the engine thread are alive and every
                   stage answers (no hang); never gated
    GET  /metrics  Prometheus text

With an API key, every /v1 route wants `Authorization: Bearer KEY`. Every refusal is OpenAI's
error object with a sentence saying what to change; the server stays up after each. Request
bodies are parsed and their prompts tokenized in a worker thread, so no request holds up the
event loop; connections.py bounds connections and the time a request may take to arrive. A client
that goes away (handler_cancellation) has its request cancelled: its slot frees at the next
window and none of its tokens reach anyone.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
from typing import Callable

from aiohttp import web

from strata.coordinator import openai_api as api
from strata.coordinator.connections import ConnectionPool, Limits, ServerConfig
from strata.coordinator.drafts import draft_counts
from strata.coordinator.engine import Engine, EngineDown, Finished, Job
from strata.coordinator.grammar import Grammars
from strata.coordinator.metrics import Metrics
from strata.coordinator.openai_api import ApiError
from strata.coordinator.request_fields import shown

log = logging.getLogger("strata.server")


class Server:
    def __init__(self, engine: Engine, tok, vocab: int, cfg: ServerConfig, metrics: Metrics,
                 check_alive: Callable[[], None]):
        self.engine, self.tok, self.vocab, self.cfg = engine, tok, vocab, cfg
        self.metrics, self.check_alive = metrics, check_alive
        self.ctx = engine.cfg.ctx
        self.created = api.now()
        self.names = {cfg.model, *cfg.aliases}
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
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
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
        if self.cfg.api_key is None or not request.path.startswith("/v1"):
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
                                 f"GET /v1/models, GET /v1/status, GET /health, GET /metrics",
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
        return api.parse(body, chat=chat, encode=self.tok.encode,
                         render_chat=self.tok.render_chat, vocab=self.vocab, ctx=self.ctx,
                         longest_token=self.tok.longest_token, grammars=self.grammars)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await self._body(request)
        # parsing renders and tokenizes the prompt: off the event loop, which keeps serving
        p = await asyncio.to_thread(self._parse, raw, chat)
        job = Job(api.new_id(chat), p.prompt, p.params, asyncio.get_running_loop(),
                  asyncio.Queue(), grammar=p.grammar)
        try:
            self.engine.submit(job)
        except EngineDown as e:
            raise ApiError(503, f"{e}; restart strata-launch", code="unavailable") from None
        done = False
        try:
            if p.stream:
                response = await self._stream(request, job, p)
            else:
                response = await self._complete(job, p)
            done = True
            return response
        finally:
            if not done:  # the client went away, or we failed: free the slot
                self.engine.cancel(job)

    @staticmethod
    def _failure(fin: Finished) -> ApiError:
        if fin.reason == "cancelled" or fin.down:
            why = fin.error or "the server is stopping"
            return ApiError(503, f"{why}; the request was not completed, retry it once the "
                                 f"server is back", code="unavailable")
        return ApiError(500, f"this request's window failed: {fin.error}",
                        code="stage_error")

    async def _complete(self, job: Job, p: api.Parsed) -> web.Response:
        while not isinstance(fin := await job.events.get(), Finished):
            pass
        if fin.reason not in ("stop", "length"):
            raise self._failure(fin)
        return web.json_response(api.response(job.id, self.cfg.model, p, fin.text, fin.reason,
                                              len(fin.generated), api.now()))

    async def _stream(self, request: web.Request, job: Job, p: api.Parsed
                      ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created, model = api.now(), self.cfg.model
        text = api.TextStream(self.tok.decode, p.params.stop)

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        try:
            if p.chat:
                await send(api.chunk(job.id, model, p, created, role=True))
            while True:
                ev = await job.events.get()
                delta = ""
                while not isinstance(ev, Finished):  # every token already here: one chunk
                    delta += text.push(ev)
                    if job.events.empty():
                        break
                    ev = job.events.get_nowait()
                if not isinstance(ev, Finished):
                    if delta:
                        await send(api.chunk(job.id, model, p, created, delta))
                    continue
                fin = ev
                delta += text.finish(fin.text)
                if text.sent != fin.text and fin.reason in ("stop", "length"):
                    log.warning("%s: streamed text differs from the final text", job.id)
                if delta:
                    await send(api.chunk(job.id, model, p, created, delta))
                break
            if fin.reason in ("stop", "length"):
                await send(api.chunk(job.id, model, p, created, finish=fin.reason))
                if p.include_usage:
                    await send(api.chunk(job.id, model, p, created,
                                         usage_of=(len(p.prompt), len(fin.generated))))
            else:
                await send(self._failure(fin).body())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client closed the stream: nobody to tell
            request["client_gone"] = True
            self.engine.cancel(job)
        return resp

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
                            drafts=draft_counts(s.drafted, s.accepted, s.drafted_at,
                                                s.accepted_at, cfg.max_draft_tokens))
            slots.append(view)
        groups = [{"group": g, "slots": [s.slot for s in snap.slots if s.group == g],
                   "window_in_flight": busy,
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
            "drafts": draft_counts(snap.drafted, snap.accepted, snap.drafted_at,
                                   snap.accepted_at, cfg.max_draft_tokens),
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
