"""Small HTTP helpers shared by the routes (FastAPI side only): JSON answers, error answers in a wire's
shape, reading a JSON body with an OpenAI-style 4xx for anything else.

`read_json` is the one place a request body becomes data, so its limits live here: a JSON media type
(415 otherwise), valid UTF-8, no NaN/Infinity or out-of-range numbers (vLLM cannot take them back), no
lone UTF-16 surrogate escapes (they would fail to encode in the tokenizer or the transcript store),
nesting no deeper than `Settings.limits.max_json_depth`. The body's size is bounded before this by
proxy/auth.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec
from fastapi.responses import Response

from proxy.errors import InvalidRequest, ProxyError, UnsupportedMediaType
from proxy.wire import Wire


class TurnHTTPRequest(Protocol):
    """What a turn's handler reads of its HTTP request: Starlette's `Request` on the ASGI entry, the
    server's `InboundTurn` (proxy/turn_http.py) on its own turn path."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def body(self) -> bytes: ...

    async def is_disconnected(self) -> bool: ...


SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data, separators=(",", ":")), status_code=status, media_type="application/json",
                    headers=headers)


def error_response(exc: ProxyError, wire: Wire | None = None) -> Response:
    body = wire.error_body(exc) if wire is not None else exc.body()
    return json_response(body, exc.status, exc.headers)


DEFAULT_MAX_DEPTH = 64


def check_media_type(content_type: str | None) -> None:
    """JSON or nothing said (some clients send none); a form or text body is a 415."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise UnsupportedMediaType(f"Content-Type {media!r} is not supported: send application/json")


def check_depth(value: Any, max_depth: int) -> None:
    """No container nested deeper than `max_depth`, level by level over containers only (strings and
    numbers, most of an agent's body, are never visited)."""
    level, depth = [value], 1
    while level:
        if depth > max_depth:
            raise InvalidRequest(f"request body is nested deeper than {max_depth} levels")
        below: list[Any] = []
        for node in level:
            for item in node.values() if type(node) is dict else node:
                if type(item) in _CONTAINERS:  # the decoder makes plain dicts and lists only
                    below.append(item)
        level, depth = below, depth + 1


_CONTAINERS = (dict, list)


# msgspec's decoder, not json.loads: 3-5x faster on agent bodies, and it refuses what vLLM cannot take
# back itself (NaN/Infinity, numbers out of range such as 1e400, invalid UTF-8, lone UTF-16 surrogate
# escapes like "\\ud800", which would parse and then fail to encode in the tokenizer or the store).
_DECODER = msgspec.json.Decoder()


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    try:
        body = _DECODER.decode(raw)
    except RecursionError as exc:
        raise InvalidRequest(f"request body is nested deeper than {max_depth} levels") from exc
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"request body holds a value JSON cannot carry here: {exc}") from exc
    except msgspec.DecodeError as exc:
        what = "valid UTF-8" if "UTF-8" in str(exc) else "valid JSON"
        raise InvalidRequest(f"request body is not {what}: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    check_depth(body, max_depth)
    return body


async def read_json(request: TurnHTTPRequest, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    check_media_type(request.headers.get("content-type"))
    return parse_json(await request.body(), max_depth)
