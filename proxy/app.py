"""`create_app(settings)` builds the FastAPI app; routes are thin and call the core.

Wiring happens in the lifespan (the aiohttp session needs the running loop); tests inject an
`Upstream`, a store, a chat format or an admission instead. Nothing is created at import.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from proxy.admission import Admission
from proxy.auth import Guard
from proxy.dashboard_routes import DashboardLogin, dashboard_router
from proxy.errors import NotFound, ProxyError
from proxy.format import ChatFormat, load_format
from proxy.http import error_response, json_response
from proxy.openapi import openapi_document
from proxy.relay import relay
from proxy.routes import turn_router
from proxy.scheduler import Scheduler, open_scheduler
from proxy.services import Services
from proxy.settings import Settings
from proxy.store import SessionStore, make_store
from proxy.turn import TurnService
from proxy.upstream import Upstream

log = logging.getLogger("proxy")


def load_chat_format(settings: Settings) -> ChatFormat | None:
    """The model's conversation format from model_dir; None (chat passes through to vLLM) without one."""
    if settings.model_dir is None:
        log.warning("no model_dir: /v1/chat/completions passes through to vLLM (no transcripts)")
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
    services = Services.build(settings)
    services.upstream, services.store = upstream, store
    owns_upstream, owns_store = upstream is None, store is None
    chat_format = fmt if fmt is not None else load_chat_format(settings)
    metrics = services.metrics

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        up = settings.upstream
        if owns_upstream:
            services.upstream = Upstream.open(up.url, timeout_s=settings.upstream_timeout_s, api_key=up.api_key,
                                              keepalive_s=settings.upstream_keepalive_s)
        if owns_store:
            services.store = make_store(settings.redis_url, max_sessions=settings.max_sessions,
                                        ttl_s=settings.session_ttl_s, per_session=settings.snapshots_per_session,
                                        path=str(settings.store_file) if settings.store_file else None,
                                        outage=settings.redis_outage, timeout_s=settings.redis_timeout_s)
        scheduler: Scheduler | None = None
        source = services.view().engine(up.name, up.url)  # the operator view keeps the engine's /metrics reads
        source.get_text = services.upstream.get_text if services.upstream is not None else None
        if chat_format is not None and services.upstream is not None and services.store is not None:
            if admission is None:  # default: admit by the engine's KV pool geometry (proxy/scheduler)
                scheduler = open_scheduler(source.tap(services.upstream.get_text), metrics.registry,
                                           settings.scheduler, up.geometry)
                source.scheduler = scheduler
                await scheduler.start()
            services.turns = TurnService(fmt=chat_format, upstream=services.upstream, store=services.store,
                                         metrics=metrics, admission=admission or scheduler, warmup=settings.warmup)
            services.turns.observer = services.observer
        try:
            yield
        finally:
            if services.turns is not None:
                await services.turns.close()
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
        metrics.tasks.set(len(asyncio.all_tasks()))
        if services.store is not None:
            metrics.sessions.set(await services.store.count())
        await services.view().refresh()  # engines' vLLM series, re-exported (proxy/metrics.py)
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

    @app.get("/openapi.json")
    async def openapi() -> Response:  # behind the key like every route but /health (proxy/auth.py)
        return json_response(openapi_document())

    app.include_router(turn_router(services))  # chat, messages, files, probes: before the pass-through
    app.include_router(dashboard_router(services))  # /dashboard, /dashboard/state (proxy/dashboard_routes.py)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def passthrough(path: str, request: Request) -> Response:
        return await relay(services, request, "/v1/" + path)

    # Always on: the target/Host checks and the body limit hold without keys too (keys: loopback only).
    app.add_middleware(Guard, keys=settings.keys, max_body_bytes=settings.limits.max_body_bytes)
    if settings.keys:
        app.add_middleware(DashboardLogin, keys=settings.keys)  # outermost: the page's cookie login
    return app


__all__ = ["create_app"]
