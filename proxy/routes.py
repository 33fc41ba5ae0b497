"""The HTTP routes of a turn, for both wires, and the routes that exist for harnesses (refused Files API,
Hermes' server probes). Thin: read the body, ingress, `serve_turn`; the core does the rest.

`create_app` (proxy/app.py) includes this router before its `/v1/{path}` pass-through, so these paths are
answered here and never relayed to vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import Response

from proxy import quirks
from proxy.errors import ProxyError
from proxy.http import SSE_HEADERS, TurnHTTPRequest, error_response, json_response, read_json
from proxy.ingress import TurnRequest
from proxy.relay import relay
from proxy.scheduler import Queued, hold
from proxy.services import Services
from proxy.streaming import StreamedResponse
from proxy.turn import Turn
from proxy.turn_http import EarlyOpen, InboundTurn
from proxy.wire import Wire
from proxy.wire.anthropic import AnthropicWire
from proxy.wire.openai import OpenAIWire

# What /version reports: the engine line we are compatible with (vLLM 0.32.0, patches/vllm.pin).
ENGINE_VERSION = "0.32.0"
# Every turn's response names the engine that serves it, so a user can see where a session lives.
ENGINE_HEADER = "x-hyperharness-engine"


async def serve_turn(services: Services, request: TurnHTTPRequest, turn_request: TurnRequest, wire: Wire) -> Response:
    """The one path a turn takes on either wire: hold the client through admission, then stream or
    collect the turn through the wire's writer."""
    turns = services.require_turns()
    cfg = services.settings.scheduler
    prepared = await turns.prepare(turn_request)  # planned and placed: the engine is known from here
    placement = prepared[1]
    headers = {ENGINE_HEADER: placement.engine.name} if placement is not None else {}
    ticket = turns.admit_now(turn_request, prepared)
    held: Turn | Queued[Turn]
    stream = turn_request.chat.stream
    early: EarlyOpen | None = None
    if ticket is not None:  # a seat at once: opened inline, with no task holding the client through a wait
        on_head = None
        if stream and isinstance(request, InboundTurn):  # the server's own turn path: the answer opens from
            # the engine connection's callback when the engine says 200, its pieces built while it computes
            early = request.early_open({**SSE_HEADERS, **headers},
                                       partial(wire.opening, turn_request.chat, prepared[0].prompt))
            asyncio.get_running_loop().call_soon(early.prepare)
            on_head = early.send
        held = await turns.open(turn_request, prepared, ticket=ticket, on_head=on_head)
    else:
        held = await hold(turns.open(turn_request, prepared), stream=stream,
                          is_disconnected=request.is_disconnected, after_s=cfg.keepalive_after_s,
                          every_s=cfg.keepalive_every_s)
    if isinstance(held, Turn) and held.placement is not None and held.placement is not placement:
        headers = {ENGINE_HEADER: held.placement.engine.name}  # placed again: its engine was unreachable
        early = None  # (never sent: only the first engine's 200 opens it)
    if isinstance(held, Queued):  # still waiting for engine capacity: SSE comments until admitted
        return _sse(held.body(wire.stream, wire.error_event), headers)
    if stream:  # `held.close`: the turn is let go even if its client left before the body started
        if early is not None and early.response is not None:
            early.response.chunks, early.response.on_close = wire.stream(held, early.opening), held.close
            return early.response
        return _sse(wire.stream(held), headers, on_close=held.close)
    return json_response(await wire.complete(held), headers=headers)


def _sse(body: AsyncIterator[bytes], headers: dict[str, str],
         on_close: Callable[[], None] | None = None) -> StreamedResponse:
    return StreamedResponse(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers},
                            on_close=on_close)


class TurnEndpoints:
    """The handlers of a turn on either wire (and of counting one's tokens). The app serves the two turn
    paths straight behind its front door (proxy/front.py) and registers all of them on its router."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.openai_wire = OpenAIWire(services.settings.model_name)
        self.anthropic_wire = AnthropicWire(services.settings.model_name)

    def by_path(self) -> dict[str, Callable[[TurnHTTPRequest], Awaitable[Response]]]:
        """The POST handlers of the two turn paths."""
        return {"/v1/chat/completions": self.chat_completions, "/v1/messages": self.messages}

    async def ingest(self, request: TurnHTTPRequest, read: Callable[..., TurnRequest], route: str) -> TurnRequest:
        services = self.services
        body = await read_json(request, services.settings.limits.max_json_depth)
        info = await services.up().model()
        return read(body, request.headers, max_model_len=info.max_model_len, route=route)

    async def answer(self, request: TurnHTTPRequest, wire: Wire, read: Callable[..., TurnRequest]) -> Response:
        try:
            turn_request = await self.ingest(request, read, wire.route)
            return await serve_turn(self.services, request, turn_request, wire)
        except ProxyError as exc:
            self.services.metrics.requests.labels(wire.route, str(exc.status)).inc()
            return error_response(exc, wire)

    async def chat_completions(self, request: TurnHTTPRequest) -> Response:
        # No chat format: vLLM renders (no transcripts). Only the ASGI entry serves a turn then (the
        # server's own turn path waits for the turn service, proxy/front.py `direct_turn`).
        if self.services.turns is None and isinstance(request, Request):
            return await relay(self.services, request, "/v1/chat/completions")
        return await self.answer(request, self.openai_wire, self.services.ingress.openai)

    async def messages(self, request: TurnHTTPRequest) -> Response:
        return await self.answer(request, self.anthropic_wire, self.services.ingress.anthropic)

    async def count_tokens(self, request: Request) -> Response:
        try:
            turn_request = await self.ingest(request, self.services.ingress.anthropic, "count_tokens")
            plan = await self.services.require_turns().plan(turn_request)
            return json_response({"input_tokens": len(plan.prompt)})
        except ProxyError as exc:
            return error_response(exc, self.anthropic_wire)


def turn_router(endpoints: TurnEndpoints) -> APIRouter:
    router = APIRouter()
    services = endpoints.services
    # Plain Starlette routes: FastAPI's per-request dependency solving buys nothing for a handler that
    # takes the raw Request (the OpenAPI document is proxy/openapi.py's own).
    for path, handler in endpoints.by_path().items():
        router.add_route(path, handler, methods=["POST"])
    router.add_route("/v1/messages/count_tokens", endpoints.count_tokens, methods=["POST"])

    @router.api_route("/v1/files", methods=["GET", "POST"])
    @router.api_route("/v1/files/{rest:path}", methods=["GET", "POST", "DELETE"])
    async def files(request: Request) -> Response:
        exc = quirks.files_refused()
        services.metrics.requests.labels("files", str(exc.status)).inc()
        services.quirk_log.applied.labels("files_refused").inc()
        return json_response(exc.body(), exc.status)

    async def probe(request: Request) -> Response:
        status, body = quirks.probe_answer(request.url.path, ENGINE_VERSION)
        services.quirk_log.applied.labels("server_probe").inc()
        return json_response(body, status)

    for path in quirks.PROBE_PATHS:
        router.add_api_route(path, probe, methods=["GET"])
    return router
