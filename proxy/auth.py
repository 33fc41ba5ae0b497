"""The front door as pure ASGI middleware (no BaseHTTPMiddleware: it buffers and costs per chunk).

In this order, before any route runs:
1. the request target: only a plain origin-form path is served. `//v1/...`, `/v1/../metrics`, any
   percent-escape (`/v1/%2e%2e/metrics`, `%2F`), backslashes, control characters and absolute-form
   targets that the HTTP parser hands through (`GET http://evil/v1/...`) are a 400, so no router, relay
   or engine behind us can read the path differently from the key check. (uvicorn's httptools parser
   reduces an absolute-form target to its path itself; that path then passes the same checks.)
2. the Host header: a host[:port] or nothing; `Host: evil/?` (LiteLLM's bypass: a URL rebuilt from
   Host and path moves the path into the query) and repeated Host headers are a 400.
3. the key: every route but `/health` needs one of the configured keys, as `Authorization: Bearer KEY`
   (OpenAI clients) or `x-api-key: KEY` (Anthropic clients). Keys are compared as SHA-256 digests with
   `hmac.compare_digest`, against every key without an early exit, so neither timing nor the key's
   length tells which byte or which key was close. Without keys (loopback only) this step is skipped.
4. the body size: a Content-Length over `Settings.limits.max_body_bytes` is a 413 before anything is
   read; a chunked body is counted as it streams and the read fails with the same 413 once over.

Errors are OpenAI-shaped, Anthropic-shaped on `/v1/messages...`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.errors import AuthenticationFailed, InvalidRequest, PayloadTooLarge, ProxyError
from proxy.wire.anthropic import anthropic_error

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
# host, IPv4 or [IPv6], with an optional port: nothing that could carry a path, query or user info
_HOST = re.compile(r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})?|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?")
_BAD_PATH_CHARS = re.compile(r"[%\\\x00-\x20\x7f-\xff]")


def presented_keys(headers: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys as the client's bytes (a key file's non-ASCII key arrives as its UTF-8 bytes), from every
    Authorization: Bearer and x-api-key header: a client may send both (SDK defaults plus its own)."""
    found = []
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                found.append(token.strip())
        elif name == b"x-api-key" and value.strip():
            found.append(value.strip())
    return found


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class KeyRing:
    """The accepted keys, kept as digests; `accepts` looks at all of them whatever it finds."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = tuple(_digest(k.encode("utf-8", "surrogateescape")) for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, *presented: bytes) -> bool:
        found = False
        for key in presented:
            given = _digest(key)
            for digest in self._digests:
                found |= hmac.compare_digest(given, digest)
        return found


def target_problem(path: str, raw_path: bytes | None = None) -> str | None:
    """Why this request target is refused, or None for a plain path."""
    target = raw_path.decode("latin-1") if raw_path is not None else path
    for p in (target, path):
        if not p.startswith("/") or p.startswith("//"):
            return "only origin-form request targets (a path starting with a single /) are served"
        if _BAD_PATH_CHARS.search(p):
            return "percent-escapes, backslashes and control characters are not allowed in the path"
        segments = p[1:].split("/")
        if any(s in (".", "..") for s in segments) or "" in segments[:-1]:
            return "dot segments and empty segments are not allowed in the path"
    return None


def host_problem(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    hosts = [value for name, value in headers if name == b"host"]
    if len(hosts) > 1:
        return "more than one Host header"
    if hosts and not _HOST.fullmatch(hosts[0].decode("latin-1")):
        return "the Host header must be host[:port]"
    return None


def _content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    values = [value for name, value in headers if name == b"content-length"]
    if not values:
        return None
    if len(set(values)) != 1 or not values[0].isdigit():
        raise InvalidRequest("invalid Content-Length header")
    return int(values[0])


def too_large(limit: int) -> PayloadTooLarge:
    """A body over the limit, found while it arrived (its declared length said nothing or less)."""
    return PayloadTooLarge(f"request body over the limit of {limit} bytes", param="body")


def _counting(receive: Receive, limit: int) -> Receive:
    """`receive` that fails with a 413 once the body read so far is over `limit` bytes."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large(limit)
        return message

    return counted


@dataclass(frozen=True, slots=True)
class Refusal:
    """What the front door answers instead of the route: the error, extra headers, and whether the
    connection ends after it (a body the client may still be sending is not read)."""
    exc: ProxyError
    extra: tuple[tuple[bytes, bytes], ...] = ()
    close: bool = False


class Guard:
    def __init__(self, app: ASGIApp, keys: Sequence[str] = (), max_body_bytes: int = 32 * 1024 * 1024) -> None:
        self.app = app
        self.keys = KeyRing(keys)
        self.max_body_bytes = max_body_bytes

    def refusal(self, path: str, raw_path: bytes | None, headers: Sequence[tuple[bytes, bytes]],
                *, target_checked: bool = False) -> Refusal | None:
        """Steps 1-4 above, on what arrived before the body; None lets the request through.
        `target_checked`: the caller matched the target byte for byte against a known plain path."""
        problem = (None if target_checked else target_problem(path, raw_path)) or host_problem(headers)
        if problem is not None:
            return Refusal(InvalidRequest(f"bad request target: {problem}"), close=True)
        if self.keys and path not in OPEN_PATHS and not self.keys.accepts(*presented_keys(headers)):
            exc = AuthenticationFailed("Missing or invalid API key (send Authorization: Bearer KEY or x-api-key).")
            return Refusal(exc, ((b"www-authenticate", b"Bearer"),))
        try:
            length = _content_length(headers)
        except InvalidRequest as exc:
            return Refusal(exc, close=True)
        if length is not None and length > self.max_body_bytes:
            return Refusal(PayloadTooLarge(f"request body of {length} bytes is over the limit of"
                                           f" {self.max_body_bytes} bytes", param="body"), close=True)
        return None

    def body_too_large(self) -> Refusal:
        """A body that turned out larger than the limit while it streamed (chunked or lying length)."""
        return Refusal(too_large(self.max_body_bytes), close=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.refusal(scope["path"], scope.get("raw_path"), scope["headers"])
        if refused is not None:
            await refuse(scope, send, refused.exc, list(refused.extra), close=refused.close)
            return
        await self.app(scope, _counting(receive, self.max_body_bytes), send)


def error_answer(path: str, refused: Refusal) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and JSON body of a refusal, in the shape of the wire the path belongs to
    (Anthropic-shaped on /v1/messages...); `close` ends the connection (a body the client may still be
    sending is not read, and a confused target gets no second request)."""
    exc = refused.exc
    anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    body = json.dumps(anthropic_error(exc) if anthropic else exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
               *([(b"connection", b"close")] if refused.close else []), *refused.extra]
    return headers, body


async def refuse(scope: Scope, send: Send, exc: ProxyError, extra: list[tuple[bytes, bytes]] | None = None,
                 *, close: bool = False) -> None:
    """Answer `exc` through ASGI (`error_answer`)."""
    headers, body = error_answer(scope["path"], Refusal(exc, tuple(extra or ()), close))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
