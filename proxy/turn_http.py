"""A turn's HTTP exchange served by the server's protocol itself (proxy/server.py), without ASGI.

Why: a turn (`POST /v1/chat/completions`, `POST /v1/messages`) is the proxy's hot path, and the ASGI
layers between the wire and its handler cost before the first byte on every turn: the scope and its
messages, the run_asgi task's wrappers, Starlette's Request and Headers, a second task per stream that
waits for the client to leave, and a header check per response head (`bench_costs --hot-path`).
Here the protocol hands the parsed request to the handler as an `InboundTurn` and writes the handler's
answer itself: one task per turn, the client's leaving seen from the protocol's `connection_lost`.

What the skipped layers did is done here, the same way: the front door's checks (proxy/auth.py's
`Guard.refusal`, then the body limit while it arrives), `Expect: 100-continue`, keep-alive and
`connection: close`, pipelined requests (the protocol queues an exchange like any request), flow
control on slow clients, an OpenAI-shaped 500 for a handler that failed before answering and a dropped
connection for one that failed after. `TurnExchange` keeps its state under the names uvicorn's protocol
reads from its request cycle (`body`, `more_body`, `message_event`, `disconnected`, `keep_alive`,
`response_complete`), so the protocol's body intake, pipelining, keep-alive timer and graceful shutdown
treat a turn as any other request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from starlette.responses import Response
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HEADER_VALUE_RE, STATUS_LINE

from proxy.auth import Guard, Refusal, error_answer
from proxy.errors import ProxyError
from proxy.streaming import StreamedResponse
from proxy.wire import LastChunk, Opening

log = logging.getLogger("proxy")

Headers = Sequence[tuple[bytes, bytes]]
TurnHandler = Callable[["InboundTurn"], Awaitable[Response]]


class InboundTurn:
    """What a turn's handler reads of its request (proxy/http.py `TurnHTTPRequest`): the headers by
    lower-case name (a repeated header: its last value), the whole body, whether the client left."""

    __slots__ = ("_body", "_exchange", "headers")

    def __init__(self, headers: dict[str, str], body: bytes, exchange: TurnExchange) -> None:
        self.headers = headers
        self._body = body
        self._exchange = exchange

    async def body(self) -> bytes:
        return self._body

    async def is_disconnected(self) -> bool:
        return self._exchange.disconnected

    def early_open(self, headers: Mapping[str, str], first: Callable[[], Opening[Any]]) -> EarlyOpen:
        return EarlyOpen(self._exchange, headers, first)


class EarlyOpen:
    """A turn's streamed answer that opens from the engine connection's data callback the moment the
    engine answers 200 (`send`, its `on_head`), not once the turn's task has woken and unwound through
    the route: 30-45 us sooner to the first byte (docs/hot-path.md). Its pieces (the response, the
    wire's first chunk, the head's bytes) are built by `prepare`, which the route schedules for the
    loop's next turn: that comes when the turn's task waits for the engine, so they are built while
    the engine computes. The exchange's `_stream` then writes neither the head nor that chunk again;
    nothing is sent to a client that left."""

    __slots__ = ("_exchange", "_first", "_headers", "_out", "opening", "response")

    def __init__(self, exchange: TurnExchange, headers: Mapping[str, str], first: Callable[[], Opening[Any]]) -> None:
        self._exchange = exchange
        self._headers = headers
        self._first = first
        self.response: StreamedResponse | None = None  # built by `prepare`; the route sets its body
        self.opening: Opening[Any] | None = None
        self._out: tuple[bytes, bytes] = (b"", b"")

    def prepare(self) -> None:
        if self.response is not None:
            return
        response = StreamedResponse(None, media_type="text/event-stream", headers=self._headers)
        opening = self._first()
        chunk = opening.chunk
        head = self._exchange._head(200, response.raw_headers, chunked=True)
        self._out = (head, b"%x\r\n%b\r\n" % (len(chunk), chunk))
        self.response, self.opening = response, opening

    def send(self) -> None:
        exchange = self._exchange
        if exchange.response_started or exchange.disconnected:
            return
        self.prepare()  # (done already, unless the engine answered before the loop turned)
        exchange.response_started = exchange._opened = True
        if self.opening is not None:
            self.opening.sent = True
        exchange.transport.writelines(self._out)


class TurnExchange:
    """One turn request on one connection, from its head to the end of its answer."""

    def __init__(self, *, path: str, headers: Headers, handler: TurnHandler, guard: Guard,
                 transport: asyncio.Transport, flow: FlowControl, default_headers: Headers,
                 expect_100_continue: bool, keep_alive: bool, on_response: Callable[[], None]) -> None:
        self.path = path
        self.headers = headers
        self.handler = handler
        self.guard = guard
        self.transport = transport
        self.flow = flow
        self.default_headers = default_headers
        self.waiting_for_100_continue = expect_100_continue
        self.keep_alive = keep_alive
        self.on_response = on_response
        # the request cycle's names, read and written by uvicorn's protocol
        self.body = bytearray()
        self.more_body = True
        self.message_event = asyncio.Event()
        self.disconnected = False
        self.response_complete = False
        self.response_started = False
        self._streaming: asyncio.Task[None] | None = None  # the task writing a streamed body
        self._gone = False
        self._opened = False  # the streamed answer's head and first chunk are out (`EarlyOpen`)

    def client_left(self) -> None:
        """The connection was lost: a body being streamed stops at once (its generator's `finally`
        aborts the engine request); before the answer, the handler sees `is_disconnected()`."""
        self.disconnected = True
        if self._streaming is not None and not self.response_complete:
            self._gone = True
            self._streaming.cancel()

    async def run(self) -> None:
        try:
            refused = self.guard.refusal(self.path, None, self.headers, target_checked=True)
            if refused is not None:
                self._answer_error(refused)
                return
            body = await self._read_body()
            if body is None:  # the client left before sending all of it
                return
            if isinstance(body, Refusal):
                self._answer_error(body)
                return
            request = InboundTurn({n.decode("latin-1"): v.decode("latin-1") for n, v in self.headers}, body, self)
            response = await self.handler(request)
            if type(response) is StreamedResponse:
                await self._stream(response)
            elif self._opened:  # a stream opened, then a whole answer (a failure the handler caught):
                self.transport.close()  # as for a crash after the answer began, the connection ends it
            else:
                self._answer(response.status_code, response.raw_headers, response.body)
        except Exception as exc:
            log.exception("POST %s failed", self.path)
            if self.response_started:
                self.transport.close()  # the answer began: the connection is all there is to end
            else:
                self._answer_error(Refusal(ProxyError(f"internal error: {type(exc).__name__}")))
        finally:
            self.on_response = _nothing  # the protocol's next request is not started from here again

    async def _read_body(self) -> bytes | Refusal | None:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        limit = self.guard.max_body_bytes
        parts: list[bytearray] = []
        seen = 0
        while self.more_body and not self.disconnected:
            if self.body:  # taken, not copied: the protocol appends the next read to a new buffer
                seen += len(self.body)
                parts.append(self.body)
                self.body = bytearray()
            if seen > limit:
                return self.guard.body_too_large()
            self.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected:
            return None
        if seen + len(self.body) > limit:
            return self.guard.body_too_large()
        if not parts:
            return bytes(self.body)
        parts.append(self.body)
        return b"".join(parts)

    def _head(self, status: int, headers: Headers, *, chunked: bool) -> bytes:
        parts = [STATUS_LINE[status]]
        for name, value in (*self.default_headers, *headers):
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            if name == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                continue  # written once, below
            parts += (name, b": ", value, b"\r\n")
        if chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _answer(self, status: int, headers: Headers, body: bytes | memoryview) -> None:
        self.response_started = True
        if not self.disconnected:
            self.transport.write(self._head(status, headers, chunked=False) + body)
        self._complete()

    def _answer_error(self, refused: Refusal) -> None:
        headers, body = error_answer(self.path, refused)  # its `connection: close` ends keep-alive (_head)
        self._answer(refused.exc.status, headers, body)

    async def _stream(self, response: StreamedResponse) -> None:
        self.response_started = True
        body = response.chunks
        transport, flow = self.transport, self.flow
        try:
            self._streaming = asyncio.current_task()
            if self.disconnected:
                return
            if not self._opened:  # held by the server's transport until the first chunk: one write
                transport.write(self._head(response.status_code, response.raw_headers, chunked=True))
            async for chunk in body:
                if flow.write_paused:  # a slow client: wait, buffering no more than the transport does
                    await flow.drain()
                if type(chunk) is LastChunk:
                    transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(chunk), chunk) if chunk else b"0\r\n\r\n")
                    break
                if chunk:
                    transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            else:
                transport.write(b"0\r\n\r\n")
            self._complete()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._gone or task is None:
                raise  # the server is shutting down: not ours to swallow
            task.uncancel()  # the client left: nobody reads the rest
        finally:
            self._streaming = None
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()
            if response.on_close is not None:
                response.on_close()

    def _complete(self) -> None:
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()


def _nothing() -> None:
    pass
