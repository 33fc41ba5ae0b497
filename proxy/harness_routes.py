"""Routes that exist for harnesses: Anthropic Messages, the refused Files API and Hermes' server probes.

Thin: each route reads `request.app.state.services` (built by `create_app`) and calls the translation in
proxy/anthropic.py or a quirk in proxy/quirks.py. `create_app` includes this router before its
`/v1/{path}` pass-through, so these paths are answered here and never relayed to vLLM.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from proxy import anthropic, quirks
from proxy.errors import InvalidRequest, ProxyError

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
# What /version reports: the engine line we are compatible with (vLLM 0.32.0, patches/VLLM_COMMIT).
ENGINE_VERSION = "0.32.0"


def _services(request: Request) -> Any:
    return request.app.state.services


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data, separators=(",", ":")), status_code=status, media_type="application/json")


def quirk_log(services: Any) -> quirks.QuirkLog:
    return quirks.quirk_log_of(services.extras, services.metrics.registry)


async def chat_request(services: Any, body: dict[str, Any], headers: Mapping[str, str],
                       route: str = "chat") -> tuple[dict[str, Any], dict[str, str]]:
    """The quirks applied to a chat request: what `create_app`'s chat route calls before the pipeline."""
    info = await services.up().model()
    return quirks.prepare_chat(body, headers, max_model_len=info.max_model_len, quirk_log=quirk_log(services),
                               route=route)


async def _read_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def harness_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        services = _services(request)
        try:
            return await _messages(services, request)
        except ProxyError as exc:
            services.metrics.requests.labels("messages", str(exc.status)).inc()
            return _json(anthropic.anthropic_error(exc), exc.status)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        services = _services(request)
        try:
            if services.chat is None:
                raise ProxyError("token counting needs the proxy's chat format (--model-dir)")
            chat, headers = await chat_request(services, anthropic.to_chat_request(await _read_body(request)),
                                               request.headers, route="count_tokens")
            plan = await services.chat.plan(chat, headers)
            return _json({"input_tokens": len(plan.prompt)})
        except ProxyError as exc:
            return _json(anthropic.anthropic_error(exc), exc.status)

    @router.api_route("/v1/files", methods=["GET", "POST"])
    @router.api_route("/v1/files/{rest:path}", methods=["GET", "POST", "DELETE"])
    async def files(request: Request) -> Response:
        exc = quirks.files_refused()
        _services(request).metrics.requests.labels("files", str(exc.status)).inc()
        quirk_log(_services(request)).applied.labels("files_refused").inc()
        return _json(exc.body(), exc.status)

    for path in quirks.PROBE_PATHS:
        router.add_api_route(path, _probe, methods=["GET"])
    return router


async def _probe(request: Request) -> Response:
    status, body = quirks.probe_answer(request.url.path, ENGINE_VERSION)
    quirk_log(_services(request)).applied.labels("server_probe").inc()
    return _json(body, status)


async def _messages(services: Any, request: Request) -> Response:
    if services.chat is None:
        raise ProxyError("/v1/messages needs the proxy's chat format (start it with --model-dir)")
    started = time.perf_counter()
    chat = anthropic.to_chat_request(await _read_body(request))
    quirk_log(services).applied.labels("anthropic_messages").inc()
    chat, headers = await chat_request(services, chat, request.headers, route="messages")
    turn = await services.chat.prepare(chat, headers)
    model = services.settings.model_name
    if not turn.plan.norm.stream:
        message = anthropic.to_message(await turn.complete(), model)
        services.metrics.latency.labels("messages").observe(time.perf_counter() - started)
        return _json(message)

    async def body() -> AsyncIterator[bytes]:
        async for out in anthropic.translate_stream(turn.sse(), model, len(turn.plan.prompt)):
            yield out
        services.metrics.latency.labels("messages").observe(time.perf_counter() - started)

    return StreamingResponse(body(), media_type="text/event-stream", headers=_SSE_HEADERS)
