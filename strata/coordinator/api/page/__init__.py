"""The page at `/`: a chat box that streams from /v1/chat/completions, and the pipeline as
/v1/status and /metrics show it (index.html and page.js beside this file, no build step). The
page and its script are never behind the key: the page asks for it and sends it to the /v1
routes, which stay keyed."""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

HERE = Path(__file__).parent
FILES = {"/": ("index.html", "text/html"), "/page.js": ("page.js", "application/javascript")}
# the page's own script and inline style only: text a model or a user wrote cannot run
HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; "
           "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; "
           "form-action 'none'; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


async def _file(request: web.Request) -> web.Response:
    name, kind = FILES[request.path]
    return web.Response(body=(HERE / name).read_bytes(), content_type=kind, charset="utf-8",
                        headers=HEADERS)


def routes() -> list[web.RouteDef]:
    return [web.get(path, _file) for path in FILES]
