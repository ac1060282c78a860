"""The server's socket and connections: its configuration, the listening socket, how many
connections it holds, how long a request may take to arrive, and OpenAI's error object for
what aiohttp's own HTTP parser refuses.

aiohttp closes a connection that has sent no complete request within its keep-alive timeout
(from the moment it opens, and between requests), so that timeout bounds the time to send a
request's headers; the body's is bounded where the handler reads it.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from strata.config_error import ConfigError
from strata.coordinator.api.request_fields import ApiError

log = logging.getLogger("strata.server")


@dataclass(frozen=True)
class ServerConfig:
    model: str                      # the id clients name in "model"
    aliases: tuple[str, ...] = ()   # other names accepted for it (the --model text, file name)
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body: int = 2 << 20         # bytes of a request body
    stop_grace: float = 10.0        # seconds for the windows in flight when stopping
    read_timeout: float = 30.0      # seconds to send a request's headers, and again its body
    max_connections: int = 512      # open connections in all
    max_client_connections: int = 128   # open connections from one client address
    # read control tokens' text in a message's content as control tokens (prompts.py)
    allow_control_tokens_in_messages: bool = False

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ConfigError("port", f"{{port}} {self.port} is outside 0..65535")
        if not 0 < self.read_timeout < float("inf"):
            raise ConfigError("read_timeout", f"{{read_timeout}} {self.read_timeout:g} is not "
                              f"a positive number of seconds", "give e.g. 30")
        for name, n in (("max_connections", self.max_connections),
                        ("max_client_connections", self.max_client_connections)):
            if n < 1:
                raise ConfigError(name, f"{{{name}}} {n} is below 1", "give at least 1")
        if self.api_key == "":
            raise ConfigError("api_key", "{api_key} is empty",
                              "give a key, or leave it out")
        for name in (self.model, *self.aliases):
            if not name.strip():
                raise ConfigError("served_model_name", "{served_model_name} is empty",
                                  "give a name such as my-model, or leave it out")


@dataclass(frozen=True)
class Limits:
    read_timeout: float      # seconds to send a request's headers, and again its body
    max_connections: int     # open connections in all
    max_client: int          # open connections from one client address


class _Connection(RequestHandler):
    """aiohttp's handler of one connection, counted against the Limits."""

    def __init__(self, pool: "ConnectionPool", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool, self.client, self.refused = pool, None, False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.client = peer[0] if isinstance(peer, tuple) else str(peer)
        why = self.pool.admit(self.client)
        if why is not None:
            self.refused = True
            body = json.dumps(ApiError(503, why, code="too_many_connections").body()).encode()
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                            b"application/json\r\nConnection: close\r\nContent-Length: " +
                            str(len(body)).encode() + b"\r\n\r\n" + body)
            transport.close()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.refused:
            return
        self.pool.release(self.client)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            super().data_received(data)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """What aiohttp's parser refuses (a header too long, a malformed request line), as
        OpenAI's error object, without a traceback in the log."""
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        log.info("refused a malformed request from %s: %s", request.remote, message or exc)
        reason = (message or str(exc) or "malformed request").splitlines()[0]
        fix = ("send headers of at most 8190 bytes each" if "too long" in reason.lower()
               or "too large" in reason.lower() else "send a well-formed HTTP/1.1 request")
        e = ApiError(status, f"the HTTP request is malformed ({reason}); {fix}",
                     code="bad_http_request")
        resp = web.json_response(e.body(), status=status)
        resp.force_close()
        return resp


class ConnectionPool:
    """The protocol factory that asyncio's server calls for each new connection."""

    def __init__(self, server: web.Server, limits: Limits, handler_args: dict):
        self.server, self.limits, self.handler_args = server, limits, handler_args
        self.open: Counter[str] = Counter()

    def __call__(self) -> _Connection:
        return _Connection(self, self.server, loop=asyncio.get_running_loop(),
                           keepalive_timeout=self.limits.read_timeout, **self.handler_args)

    def admit(self, client: str) -> str | None:
        """None if the connection may open (it is then counted), else why not."""
        if sum(self.open.values()) >= self.limits.max_connections:
            return (f"this server holds its limit of {self.limits.max_connections} "
                    f"connections; retry later, or start strata-launch with a larger "
                    f"--max-connections")
        if self.open[client] >= self.limits.max_client:
            return (f"{client} holds this server's limit of {self.limits.max_client} "
                    f"connections per client; close some, or start strata-launch with a "
                    f"larger --max-client-connections")
        self.open[client] += 1
        return None

    def release(self, client: str) -> None:
        self.open[client] -= 1
        if not self.open[client]:
            del self.open[client]
