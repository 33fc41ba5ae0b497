"""Bearer-key check as pure ASGI middleware (no BaseHTTPMiddleware: it buffers and costs per chunk).

Every route but `/health` needs the key, given as `Authorization: Bearer KEY` (OpenAI clients) or
`x-api-key: KEY` (Anthropic clients). Without a configured key the middleware is not installed.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from proxy.errors import AuthenticationFailed, error_bytes

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value:
            return value.decode("latin-1").strip()
    return None


class BearerAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        key = presented_key(scope["headers"])
        if key is not None and hmac.compare_digest(key.encode(), self._key):
            await self.app(scope, receive, send)
            return
        exc = AuthenticationFailed("Missing or invalid API key (send Authorization: Bearer KEY or x-api-key).")
        body = error_bytes(exc)
        await send(
            {
                "type": "http.response.start",
                "status": exc.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
