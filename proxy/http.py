"""Small HTTP helpers shared by the routes (FastAPI side only): JSON answers, error answers in a wire's
shape, reading a JSON body with an OpenAI-style 400 for anything else."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from proxy.errors import InvalidRequest, ProxyError
from proxy.wire import Wire

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data, separators=(",", ":")), status_code=status, media_type="application/json",
                    headers=headers)


def error_response(exc: ProxyError, wire: Wire | None = None) -> Response:
    body = wire.error_body(exc) if wire is not None else exc.body()
    return json_response(body, exc.status, exc.headers)


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body
