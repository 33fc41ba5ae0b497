"""The app the server runs: FastAPI for every route, except that a turn (`POST /v1/chat/completions`,
`POST /v1/messages`) is handed to its handler straight behind the front door (proxy/auth.py's Guard).

Why: a turn is the proxy's hot path, and FastAPI's stack around a route (its error middleware, the
exception middleware, the exit-stack middleware, the router's match over every route, Starlette's
per-route exception wrapper) costs before the first byte and, worse, wraps `send` twice, so every
streamed token passed through two more coroutines before reaching the server
(`bench_costs --hot-path`). The routes stay registered on the router as well, so another method on
these paths is the router's 405 and never the pass-through's relay.

On the server the proxy runs (proxy/server.py) a turn does not even come through ASGI: the protocol
asks `direct_turn` for the handler of the request target and serves it itself (proxy/turn_http.py).
The ASGI entry below serves the same handlers behind the same front door when it does not (a target
with a query string, any other ASGI server, the tests' in-process transports).

What the skipped layers did is done here: the Guard's checks (target, Host, key, body size) are the
same instance's, and an exception no handler caught is a 500 in the OpenAI error shape (or, once the
answer has started, a dropped connection, as the server does for any app).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from proxy.auth import ASGIApp, Guard, Receive, Scope, Send, refuse
from proxy.errors import ProxyError
from proxy.http import TurnHTTPRequest

log = logging.getLogger("proxy")

Endpoint = Callable[[TurnHTTPRequest], Awaitable[Response]]


class ProxyApp(FastAPI):
    """FastAPI, with `turn_endpoints` (path -> handler of a POST) answered before its stack."""

    _turns: Mapping[str, ASGIApp] = {}
    _direct: Mapping[bytes, tuple[Endpoint, Guard]] = {}
    _ready: Callable[[], bool] | None = None

    def serve_turns(self, endpoints: Mapping[str, Endpoint], guard: Callable[[ASGIApp], Guard],
                    ready: Callable[[], bool] | None = None) -> None:
        """`ready`: whether the handlers can take a turn without ASGI now (the app's turn service is
        up); until then the server hands these paths to the ASGI entry like any other."""
        guards = {path: guard(_asgi(handler)) for path, handler in endpoints.items()}
        self._turns = guards
        self._direct = {path.encode(): (handler, guards[path]) for path, handler in endpoints.items()}
        self._ready = ready

    def direct_turn(self, target: bytes) -> tuple[Endpoint, Guard] | None:
        """The handler and front door of a POST whose request target is `target` byte for byte (so a
        plain path, without query), for the server's own turn path; None: served through ASGI."""
        found = self._direct.get(target)
        if found is None or (self._ready is not None and not self._ready()):
            return None
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            turn = self._turns.get(scope["path"])
            if turn is not None:
                await turn(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _asgi(handler: Endpoint) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await handler(Request(scope, receive))  # a TurnHTTPRequest
            await response(scope, receive, send)
        except Exception as exc:
            log.exception("%s %s failed", scope["method"], scope["path"])
            try:  # the server refuses a second start once the answer began: then it drops the connection
                await refuse(scope, send, ProxyError(f"internal error: {type(exc).__name__}"))
            except RuntimeError:
                raise exc from None
    return app
