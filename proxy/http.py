"""Small HTTP helpers shared by the routes (FastAPI side only): JSON answers, error answers in a wire's
shape, reading a JSON body with an OpenAI-style 4xx for anything else.

`read_json` is the one place a request body becomes data, so its limits live here: a JSON media type
(415 otherwise), valid UTF-8, no NaN/Infinity (vLLM cannot take them back), nesting no deeper than
`Settings.limits.max_json_depth`, no lone UTF-16 surrogates (`"\ud800"` parses, then fails to encode in
the tokenizer or the transcript store). The body's size is bounded before this by proxy/auth.py."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from proxy.errors import InvalidRequest, ProxyError, UnsupportedMediaType
from proxy.wire import Wire

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data, separators=(",", ":")), status_code=status, media_type="application/json",
                    headers=headers)


def error_response(exc: ProxyError, wire: Wire | None = None) -> Response:
    body = wire.error_body(exc) if wire is not None else exc.body()
    return json_response(body, exc.status, exc.headers)


DEFAULT_MAX_DEPTH = 64


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: no engine field takes it, and it would go on as `Infinity`
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def check_media_type(content_type: str | None) -> None:
    """JSON or nothing said (some clients send none); a form or text body is a 415."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise UnsupportedMediaType(f"Content-Type {media!r} is not supported: send application/json")


def check_json(value: Any, max_depth: int) -> None:
    """Depth and string checks, iteratively (the body may be as deep as json's own recursion allows)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node)
            continue
        if not isinstance(node, dict | list):
            continue
        if depth > max_depth:
            raise InvalidRequest(f"request body is nested deeper than {max_depth} levels")
        if isinstance(node, dict):
            for key, item in node.items():
                _check_text(key)
                stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in node)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest("request body holds a lone UTF-16 surrogate escape (not valid Unicode)") from exc


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from exc
    except RecursionError as exc:
        raise InvalidRequest(f"request body is nested deeper than {max_depth} levels") from exc
    except ValueError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    check_json(body, max_depth)
    return body


async def read_json(request: Request, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    check_media_type(request.headers.get("content-type"))
    return parse_json(await request.body(), max_depth)
