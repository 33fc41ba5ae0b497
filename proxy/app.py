"""`create_app(settings)` builds the FastAPI app; routes are thin and call the core.

Wiring happens in the lifespan (the aiohttp session needs the running loop); tests inject an
`Upstream` (and later a store / chat format) instead. Nothing is created at import.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from proxy.admission import Admission
from proxy.auth import BearerAuth
from proxy.chat import ChatService
from proxy.errors import InvalidRequest, NotFound, ProxyError, error_body
from proxy.format import ChatFormat, load_format
from proxy.harness_routes import chat_request, harness_router
from proxy.metrics import Metrics
from proxy.scheduler import Queued, Scheduler, hold, open_scheduler
from proxy.settings import Settings
from proxy.store import SessionStore, make_store
from proxy.upstream import Upstream, forward_headers

log = logging.getLogger("proxy")

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass
class Services:
    """What the routes use; built in the lifespan unless injected."""

    settings: Settings
    metrics: Metrics
    upstream: Upstream | None = None
    store: SessionStore | None = None
    chat: ChatService | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def up(self) -> Upstream:
        if self.upstream is None:
            raise ProxyError("proxy is starting")
        return self.upstream


def json_response(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data, separators=(",", ":")), status_code=status, media_type="application/json")


def error_response(exc: ProxyError) -> Response:
    resp = json_response(exc.body(), exc.status)
    resp.headers.update(getattr(exc, "headers", None) or {})  # Retry-After on 429/503 from admission
    return resp


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def load_chat_format(settings: Settings) -> ChatFormat | None:
    """The model's conversation format from --model-dir; None (chat passes through to vLLM) without one."""
    if settings.model_dir is None:
        log.warning("no --model-dir: /v1/chat/completions passes through to vLLM (no transcripts)")
        return None
    return load_format(settings.model_dir)


def create_app(
    settings: Settings,
    *,
    upstream: Upstream | None = None,
    store: SessionStore | None = None,
    fmt: ChatFormat | None = None,
    admission: Admission | None = None,
) -> FastAPI:
    """Build the app. Injected parts (tests, benchmarks) are used as given and not closed here."""
    metrics = Metrics()
    services = Services(settings=settings, metrics=metrics, upstream=upstream, store=store)
    owns_upstream, owns_store = upstream is None, store is None
    chat_format = fmt if fmt is not None else load_chat_format(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if owns_upstream:
            services.upstream = Upstream.open(
                settings.upstream,
                timeout_s=settings.upstream_timeout_s,
                api_key=settings.upstream_api_key,
                keepalive_s=settings.upstream_keepalive_s,
            )
        if owns_store:
            services.store = make_store(
                settings.redis_url,
                max_sessions=settings.max_sessions,
                ttl_s=settings.session_ttl_s,
                per_session=settings.snapshots_per_session,
                path=str(settings.store_file) if settings.store_file else None,
            )
        scheduler: Scheduler | None = None
        if chat_format is not None and services.upstream is not None and services.store is not None:
            if admission is None:  # default: admit by the engine's KV pool geometry (proxy/scheduler)
                scheduler = open_scheduler(services.upstream.get_text, metrics.registry, settings.model_dir)
                await scheduler.start()
            services.chat = ChatService(
                fmt=chat_format,
                upstream=services.upstream,
                store=services.store,
                metrics=metrics,
                model_name=settings.model_name,
                admission=admission or scheduler,
                warmup=settings.warmup,
            )
        try:
            yield
        finally:
            if services.chat is not None:
                await services.chat.close()
            if scheduler is not None:
                await scheduler.close()
            if owns_store and services.store is not None:
                await services.store.close()
            if owns_upstream and services.upstream is not None:
                await services.upstream.close()

    app = FastAPI(title="HyperHarness proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.services = services

    @app.exception_handler(ProxyError)
    async def _proxy_error(_: Request, exc: ProxyError) -> Response:
        metrics.requests.labels("error", str(exc.status)).inc()
        return error_response(exc)

    @app.exception_handler(404)
    async def _not_found(request: Request, _: Exception) -> Response:
        return error_response(NotFound(f"no route {request.method} {request.url.path}"))

    @app.get("/health")
    async def health() -> Response:
        # Healthy only when the engine is: the launcher waits on this before printing the URL.
        try:
            await services.up().get_text("/health")
        except ProxyError as exc:
            return json_response({"status": "unavailable", "detail": exc.message}, 503)
        return json_response({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        if services.store is not None:
            metrics.sessions.set(await services.store.count())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> Response:
        info = await services.up().model()
        entry = {
            "id": settings.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "hyperharness",
            "max_model_len": info.max_model_len,
            "context_length": info.max_model_len,
            "context_window": info.max_model_len,
        }
        return json_response({"object": "list", "data": [entry]})

    app.include_router(harness_router())  # /v1/messages, /v1/files, probes: before the pass-through

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        if services.chat is None:
            return await relay(services, request, "/v1/chat/completions")
        body, headers = await chat_request(services, await read_json(request), request.headers)
        held = await hold(services.chat.prepare(body, headers), stream=body.get("stream") is True,
                          is_disconnected=request.is_disconnected, admission=services.chat.admission)
        if isinstance(held, Queued):  # still waiting for engine capacity: SSE comments until admitted
            body_iter = held.sse(lambda t: t.sse())
            return StreamingResponse(body_iter, media_type="text/event-stream", headers=_SSE_HEADERS)
        turn = held
        if turn.plan.norm.stream:
            return StreamingResponse(turn.sse(), media_type="text/event-stream", headers=_SSE_HEADERS)
        return json_response(await turn.complete())

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def passthrough(path: str, request: Request) -> Response:
        return await relay(services, request, "/v1/" + path)

    return _with_auth(app, settings)


async def relay(services: Services, request: Request, path: str) -> Response:
    """Forward a request to vLLM unchanged except for the model id, streaming the answer back."""
    started = time.perf_counter()
    upstream = services.up()
    raw = await request.body()
    if raw and request.method == "POST":
        body = await read_json(request)
        if "model" in body:
            body["model"] = (await upstream.model()).upstream_id
        raw = json.dumps(body).encode()
    query = ("?" + request.url.query) if request.url.query else ""
    headers = forward_headers(request.headers)
    resp = await upstream.relay(request.method, path + query, headers=headers, body=raw or None)
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
        out_headers.update(_SSE_HEADERS)
    return StreamingResponse(body_iter(), status_code=resp.status, headers=out_headers, media_type=media)


def _with_auth(app: FastAPI, settings: Settings) -> FastAPI:
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    return app


__all__ = ["create_app", "error_body"]
