"""`create_app(settings)` builds the FastAPI app; routes are thin and call the core.

Wiring happens in the lifespan (the aiohttp session needs the running loop); tests inject an
`Upstream`, a store, a chat format or an admission instead. Nothing is created at import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry

from proxy.admission import Admission
from proxy.auth import BearerAuth
from proxy.errors import NotFound, ProxyError
from proxy.format import ChatFormat, load_format
from proxy.http import error_response, json_response
from proxy.relay import relay
from proxy.routes import turn_router
from proxy.routing import Engine, Router, make_state
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
                                        path=str(settings.store_file) if settings.store_file else None)
        schedulers: list[Scheduler] = []
        engines: list[Engine] = []
        if chat_format is not None and services.upstream is not None and services.store is not None:
            # One engine per upstream, each with its own connection pool and its own admission by its
            # own pool geometry; the first keeps the app's upstream (and an injected admission).
            for i, cfg in enumerate(settings.upstreams):
                upstream_i = services.upstream if i == 0 else Upstream.open(
                    cfg.url, timeout_s=settings.upstream_timeout_s, api_key=cfg.api_key,
                    keepalive_s=settings.upstream_keepalive_s)
                engine = Engine(cfg, upstream_i)
                if i == 0 and admission is not None:
                    engine.admission = admission
                else:  # default: admit by the engine's KV pool geometry (proxy/scheduler)
                    # the first engine's scheduler series go to /metrics; the others' would clash by name
                    registry = metrics.registry if i == 0 else CollectorRegistry()
                    engine.scheduler = open_scheduler(upstream_i.get_text, registry, settings.scheduler,
                                                      cfg.geometry)
                    engine.admission = engine.scheduler
                    schedulers.append(engine.scheduler)
                    await engine.scheduler.start()
                engines.append(engine)
            services.router = Router(engines, config=settings.routing, registry=metrics.registry,
                                     state=make_state(settings.redis_url if len(engines) > 1 else None,
                                                      ttl_s=settings.routing.state_ttl_s))
            await services.router.start()
            services.turns = TurnService(fmt=chat_format, upstream=services.upstream, store=services.store,
                                         metrics=metrics, admission=engines[0].admission, warmup=settings.warmup,
                                         router=services.router)
        try:
            yield
        finally:
            if services.turns is not None:
                await services.turns.close()
            if services.router is not None:
                await services.router.close()
            for scheduler in schedulers:
                await scheduler.close()
            for engine in engines[1:]:
                await engine.upstream.close()
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
        router = services.router
        if router is not None and len(router.engines) > 1:  # several: healthy while one serves
            states = {e.name: e.health.value for e in router.engines}
            status = 200 if any(e.live for e in router.engines) else 503
            return json_response({"status": "ok" if status == 200 else "unavailable", "engines": states}, status)
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

    app.include_router(turn_router(services))  # chat, messages, files, probes: before the pass-through

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def passthrough(path: str, request: Request) -> Response:
        return await relay(services, request, "/v1/" + path)

    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    return app


__all__ = ["create_app"]
