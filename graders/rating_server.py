"""The rating page's server: Starlette under uvicorn (the `ratings` extra), as the seed's UI ran.

    python -m tools.ratings serve --dir runs/qgen_human/ratings  # then open http://127.0.0.1:8000

The routes are rating_page.py's (the page, its form, /api/pending, /api/rate, /stats, /export,
the seed's /api/export) and rating_queue.py's (the seed's /api/queue/submit,
/api/queue/result/{id}, /api/queue/pending, /api/health).
Each runs in a worker thread under the store's lock; its reply is sent after the lock is let go,
so a slow reader holds only itself. What every request gets, here:

- Host: answered only when addressed to an IP address, localhost, the --host name or an
  --allow-host name, else 403 (no DNS rebinding of another site's name onto the page).
- Bodies: a Content-Length of at most 1 MB and UTF-8, else 400; JSON routes take only
  application/json (another site's page cannot send it without asking), else 415.
- Timeouts (timeout_s, 30 s): a body that does not arrive in time gets 408; a client that stops
  reading a reply, or connects and never sends a request, is dropped after it.
- Headers on every reply: no framing (X-Frame-Options, CSP frame-ancestors), no MIME sniffing,
  CSP default-src 'none' (the page has no script) with form-action 'self'.
- A log line per POST (address, path, status), control characters escaped; never the token.
"""
from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from graders import rating_page, rating_queue
from graders.rating_page import TEXT, host_allowed, json_reply, page_token, printable
from graders.ratings import say, store_for

if TYPE_CHECKING:  # the extra itself is imported where it is used: this module loads without it
    import uvicorn
    from starlette.requests import Request
    from starlette.responses import Response

TIMEOUT_S, MAX_BODY, CHUNK = 30.0, 1 << 20, 1 << 16
SECURITY_HEADERS = [
    (b"x-frame-options", b"DENY"), (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"default-src 'none'; style-src 'unsafe-inline'; "
                                  b"form-action 'self'; frame-ancestors 'none'")]


class Stalled(Exception):
    """A piece of a reply that could not be sent in timeout_s: the client stopped reading."""


def as_response(reply: rating_page.Reply) -> Response:
    """A route's Reply (status, body, type, headers) as Starlette's Response."""
    from starlette.responses import Response
    code, body, ctype, headers = reply
    # a lone surrogate in model output: ?, not a crash
    data = body if isinstance(body, bytes) else body.encode("utf-8", "replace")
    return Response(data, code, headers=headers, media_type=ctype)


async def read_body(request: Request, timeout_s: float, json_only: bool) -> str | tuple:
    """The request's body as text, or the Reply that refuses it."""
    from starlette.requests import ClientDisconnect
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if json_only and ctype != "application/json":
        return json_reply(415, {"error": "send it as Content-Type: application/json"})
    try:
        length = int(request.headers.get("content-length") or "")
        if not 0 <= length <= MAX_BODY:  # a form is a few kilobytes
            raise ValueError
        return (await asyncio.wait_for(request.body(), timeout_s)).decode()
    except (ValueError, ClientDisconnect):  # no or bad Content-Length, a body not UTF-8
        return 400, "a body with a Content-Length under 1 MB, in UTF-8", TEXT, {}
    except asyncio.TimeoutError:  # the rest of it is not waited for
        return 408, f"the body did not arrive within {timeout_s:g} s", TEXT, {"Connection": "close"}


def make_app(dir: str | Path, host: str = "127.0.0.1", allow_hosts: tuple[str, ...] = (),
             timeout_s: float = TIMEOUT_S):
    """The rating page as an ASGI app over the ratings folder `dir` (writes its page_token)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.routing import Route
    store, token = store_for(dir), page_token(dir)

    def locked(route, *args) -> rating_page.Reply:
        with store.lock:
            store.refresh()
            return route(store, *args)

    async def reply(route, *args) -> Response:
        return as_response(await run_in_threadpool(locked, route, *args))

    def posted(route, json_only: bool, *args):
        async def endpoint(request: Request) -> Response:
            body = await read_body(request, timeout_s, json_only)
            if isinstance(body, tuple):
                return as_response(body)
            return await reply(route, *args, body)
        return endpoint

    async def page(request: Request) -> Response:
        return await reply(rating_page.page, token, request.query_params.get("taken", "0"))

    async def stats(request: Request) -> Response:
        return await reply(rating_page.stats)

    def export(default: str):  # /export: JSON Lines unless asked; /api/export (the seed's): JSON
        async def endpoint(request: Request) -> Response:
            return await reply(rating_page.export, request.query_params.get("format", default))
        return endpoint

    async def api_pending(request: Request) -> Response:
        return await reply(rating_page.api_pending)

    async def queue_pending(request: Request) -> Response:
        return await reply(rating_queue.pending)

    async def queue_result(request: Request) -> Response:
        return await reply(rating_queue.result, request.path_params["request_id"])

    async def health(request: Request) -> Response:
        return await reply(rating_queue.health)

    app = Starlette(routes=[
        Route("/", page), Route("/stats", stats), Route("/export", export("jsonl")),
        Route("/rate", posted(rating_page.rate_form, False, token), methods=["POST"]),
        Route("/api/pending", api_pending), Route("/api/export", export("json")),
        Route("/api/rate", posted(rating_page.api_rate, True), methods=["POST"]),
        Route("/api/queue/submit", posted(rating_queue.submit, True), methods=["POST"]),
        Route("/api/queue/result/{request_id}", queue_result),
        Route("/api/queue/pending", queue_pending), Route("/api/health", health)])
    return guarded(app, (host, *allow_hosts), timeout_s)


def guarded(app, allow: tuple[str, ...], timeout_s: float):
    """`app` behind the Host check, with the security headers on every reply, replies sent in
    pieces each given timeout_s to leave, and a log line per POST."""
    async def guard(scope, receive, send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        status = 0

        async def timed(message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout_s)
            except asyncio.TimeoutError:
                raise Stalled from None

        async def send_guarded(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  *SECURITY_HEADERS]}
            body = message.get("body", b"")
            if message["type"] != "http.response.body" or len(body) <= CHUNK:
                return await timed(message)
            for i in range(0, len(body), CHUNK):  # a reader that stops is noticed at a piece
                await timed({**message, "body": body[i:i + CHUNK],
                             "more_body": i + CHUNK < len(body) or message.get("more_body", False)})

        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        client = (scope.get("client") or ("?",))[0]
        try:
            if host_allowed(host, allow):
                await app(scope, receive, send_guarded)
            else:
                await as_response((403, "this page answers at an IP address, localhost or a name "
                                   "given with python -m tools.ratings serve --allow-host", TEXT,
                                   {}))(scope, receive, send_guarded)
        except Stalled:  # uvicorn closes the connection: the reply was not completed
            say(f"{client}: dropped, it stopped reading its reply for {timeout_s:g} s")
        if scope["method"] == "POST":  # one line per rating, not one per page view
            say(f"{client} POST {printable(scope['path'])} {status}")
    return guard


def _protocol(timeout_s: float):
    """uvicorn's HTTP/1.1 protocol, also closing a connection that sends no request in timeout_s
    (uvicorn times out only the wait between requests)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            # the keep-alive timer: cancelled by the first bytes of a request
            self.timeout_keep_alive_task = self.loop.call_later(
                timeout_s, self.timeout_keep_alive_handler)
    return Protocol


def listen(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """The page's listening socket; OSError when the address cannot be had (a port taken, a host
    not this machine's), before any file is written."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def uvicorn_server(dir: str | Path, host: str = "127.0.0.1", allow_hosts: tuple[str, ...] = (),
                   timeout_s: float = TIMEOUT_S) -> uvicorn.Server:
    """make_app's page under uvicorn, one timeout_s for both; .run(sockets=[listen(...)]) serves it
    until Ctrl-C."""
    import uvicorn
    return uvicorn.Server(uvicorn.Config(
        make_app(dir, host, allow_hosts, timeout_s), http=_protocol(timeout_s), lifespan="off",
        access_log=False, log_level="warning", timeout_graceful_shutdown=5))
