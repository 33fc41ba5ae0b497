"""The app the server runs: FastAPI for every route, except that a turn (`POST /v1/chat/completions`,
`POST /v1/messages`) is handed to its handler straight behind the front door (proxy/auth.py's Guard).

Why: a turn is the proxy's hot path, and FastAPI's stack around a route (its error middleware, the
exception middleware, the exit-stack middleware, the router's match over every route, Starlette's
per-route exception wrapper) costs before the first byte and, worse, wraps `send` twice, so every
streamed token passed through two more coroutines before reaching the server
(`bench_costs --hot-path`). The routes stay registered on the router as well, so another method on
these paths is the router's 405 and never the pass-through's relay.

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

log = logging.getLogger("proxy")

Endpoint = Callable[[Request], Awaitable[Response]]


class ProxyApp(FastAPI):
    """FastAPI, with `turn_endpoints` (path -> handler of a POST) answered before its stack."""

    _turns: Mapping[str, ASGIApp] = {}

    def serve_turns(self, endpoints: Mapping[str, Endpoint], guard: Callable[[ASGIApp], Guard]) -> None:
        self._turns = {path: guard(_asgi(handler)) for path, handler in endpoints.items()}

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
            response = await handler(Request(scope, receive))
            await response(scope, receive, send)
        except Exception as exc:
            log.exception("%s %s failed", scope["method"], scope["path"])
            try:  # the server refuses a second start once the answer began: then it drops the connection
                await refuse(scope, send, ProxyError(f"internal error: {type(exc).__name__}"))
            except RuntimeError:
                raise exc from None
    return app
