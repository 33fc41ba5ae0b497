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
from proxy.front import ProxyApp
from proxy.http import error_response, json_response
from proxy.openapi import openapi_document
from proxy.relay import relay
from proxy.routes import TurnEndpoints, turn_router
from proxy.routing import Engine, Router, make_state
from proxy.scheduler import Scheduler, open_scheduler
from proxy.scheduler.metrics import SchedulerMetrics
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
) -> ProxyApp:
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
        schedulers: list[Scheduler] = []
        engines: list[Engine] = []
        scheduler_metrics = SchedulerMetrics(metrics.registry)  # one set of families, an engine label each
        # One engine per upstream, each with its own connection pool and its own admission by its own pool
        # geometry; the first keeps the app's upstream (and an injected admission). The operator view keeps
        # each engine's /metrics reads (the scheduler's reads go through the view's tap).
        for i, cfg in enumerate(settings.upstreams):
            upstream_i = services.upstream if i == 0 else Upstream.open(
                cfg.url, timeout_s=settings.upstream_timeout_s, api_key=cfg.api_key,
                keepalive_s=settings.upstream_keepalive_s)
            source = services.view().engine(cfg.name, cfg.url)
            source.get_text = upstream_i.get_text if upstream_i is not None else None
            if chat_format is None or upstream_i is None or services.store is None:
                continue
            engine = Engine(cfg, upstream_i)
            if i == 0 and admission is not None:
                engine.admission = admission
            else:  # default: admit by the engine's KV pool geometry (proxy/scheduler)
                engine.scheduler = open_scheduler(source.tap(upstream_i.get_text), scheduler_metrics,
                                                  settings.scheduler, cfg.geometry, name=cfg.name)
                source.scheduler = engine.scheduler
                engine.admission = engine.scheduler
                schedulers.append(engine.scheduler)
                await engine.scheduler.start()
            engines.append(engine)
        if engines and chat_format is not None and services.upstream is not None and services.store is not None:
            services.router = Router(engines, config=settings.routing, registry=metrics.registry,
                                     state=make_state(settings.redis_url if len(engines) > 1 else None,
                                                      ttl_s=settings.routing.state_ttl_s))
            await services.router.start()
            services.turns = TurnService(fmt=chat_format, upstream=services.upstream, store=services.store,
                                         metrics=metrics, admission=engines[0].admission, warmup=settings.warmup,
                                         router=services.router)
            services.turns.observer = services.observer
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

    app = ProxyApp(title="HyperHarness proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
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

    endpoints = TurnEndpoints(services)
    app.include_router(turn_router(endpoints))  # chat, messages, files, probes: before the pass-through
    app.include_router(dashboard_router(services))  # /dashboard, /dashboard/state (proxy/dashboard_routes.py)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def passthrough(path: str, request: Request) -> Response:
        return await relay(services, request, "/v1/" + path)

    # Always on: the target/Host checks and the body limit hold without keys too (keys: loopback only).
    app.add_middleware(Guard, keys=settings.keys, max_body_bytes=settings.limits.max_body_bytes)
    # A turn is answered straight behind the same front door, before FastAPI's stack (proxy/front.py).
    app.serve_turns(endpoints.by_path(), lambda inner: Guard(inner, keys=settings.keys,
                                                              max_body_bytes=settings.limits.max_body_bytes),
                    ready=lambda: services.turns is not None)
    if settings.keys:
        app.add_middleware(DashboardLogin, keys=settings.keys)  # outermost: the page's cookie login
    return app


__all__ = ["create_app"]
