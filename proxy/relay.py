"""The pass-through: a request forwarded to vLLM unchanged except for the model id, its answer streamed
back. For every route the proxy does not serve itself (/v1/completions, /v1/embeddings, ...)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from proxy.http import SSE_HEADERS, read_json
from proxy.normalize import check_generation_fields
from proxy.services import Services
from proxy.streaming import StreamedResponse
from proxy.upstream import forward_headers


async def relay(services: Services, request: Request, path: str) -> Response:
    started = time.perf_counter()
    upstream = services.up()
    raw = await request.body()
    if request.method == "POST":  # every POST route vLLM serves takes JSON: an empty body is a 400 here
        body = await read_json(request, services.settings.limits.max_json_depth)
        check_generation_fields(body)
        if "model" in body:
            body["model"] = (await upstream.model()).upstream_id
        raw = json.dumps(body).encode()
    query = ("?" + request.url.query) if request.url.query else ""
    resp = await upstream.relay(request.method, path + query, headers=forward_headers(request.headers),
                                body=raw or None)
    route = "passthrough"

    async def body_iter() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.chunks():
                yield chunk
        finally:
            services.metrics.latency.labels(route).observe(time.perf_counter() - started)

    services.metrics.requests.labels(route, str(resp.status)).inc()
    out_headers = dict(resp.headers)
    media = out_headers.pop("Content-Type", None) or out_headers.pop("content-type", None)
    if media and media.startswith("text/event-stream"):
        out_headers.update(SSE_HEADERS)
    return StreamedResponse(body_iter(), status_code=resp.status, headers=out_headers, media_type=media)
