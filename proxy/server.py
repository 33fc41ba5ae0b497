"""The HTTP server the proxy runs: uvicorn with its httptools protocol, and two changes: a turn is served
by the protocol itself, not through ASGI (proxy/turn_http.py says why and what it keeps), and a
response's head goes out in the same write as its first body bytes.

Why: uvicorn writes a response's status line and headers the moment the app sends
`http.response.start`, then the body in another write. Each write to a waiting client is a system call
that wakes it, and on the first one of a response that wake-up is the dearest write of the stream
(measured on the hot path, `bench_costs --hot-path`: 160 us wall for the head's write against 23 us
for the first chunk's, most of it not even this process's CPU). A turn sends its first chunk right
after its head when the engine's first token is already in, so holding the head until the next write
saves that write from the time to the first token.

The head is never held past the current turn of the event loop: a response whose body comes later (a
stream waiting for the engine's first token, a request queued for admission) has its head flushed on
its own, as before, before the loop waits for anything.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.auth import ASGIApp, Guard
from proxy.front import Endpoint, ProxyApp
from proxy.settings import Settings
from proxy.turn_http import TurnExchange

DirectTurns = Callable[[bytes], tuple[Endpoint, Guard] | None]


def server_config(app: ASGIApp, settings: Settings) -> uvicorn.Config:
    """The HTTP server's settings; a client's idle connection is kept `keep_alive_s` (Settings)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=settings.keep_alive_s,
        http=protocol_for(app),
    )


def protocol_for(app: ASGIApp) -> Any:
    """The protocol class uvicorn instantiates per connection: a ProxyApp's turns served directly."""
    direct = app.direct_turn if isinstance(app, ProxyApp) else None
    return functools.partial(HeadWithBodyProtocol, direct=direct)


class HeadWithBodyProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through `HeadHoldingTransport`, serving a turn itself."""

    def __init__(self, *args: Any, direct: DirectTurns | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.direct = direct

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadHoldingTransport(transport))  # type: ignore[arg-type]

    def on_headers_complete(self) -> None:
        found = self.direct(self.url) if self.direct is not None and self.parser.get_method() == b"POST" else None
        if found is None or self.limit_concurrency is not None or self.parser.should_upgrade():
            super().on_headers_complete()
            return
        handler, guard = found
        http_version = self.parser.get_http_version()
        existing = self.cycle
        exchange = TurnExchange(
            path=self.url.decode("ascii"), headers=self.headers, handler=handler, guard=guard,
            transport=self.transport, flow=self.flow, default_headers=self.server_state.default_headers,
            expect_100_continue=self.expect_100_continue,
            keep_alive=http_version != "1.0" and self.parser.should_keep_alive(),
            on_response=self.on_response_complete)
        self.cycle = exchange  # type: ignore[assignment]  # read through the cycle's names (turn_http.py)
        if existing is None or existing.response_complete:
            self._start_asgi_task(exchange, handler)
        else:  # pipelined behind an answer still being written: queued, as the protocol queues any request
            self.flow.pause_reading()
            self.pipeline.appendleft((exchange, handler))  # type: ignore[arg-type]

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if type(cycle) is not TurnExchange:
            super()._start_asgi_task(cycle, app)
            return
        task = self.loop.create_task(cycle.run())
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def connection_lost(self, exc: Exception | None) -> None:
        cycle: Any = self.cycle
        super().connection_lost(exc)
        if type(cycle) is TurnExchange:
            cycle.client_left()


class HeadHoldingTransport:
    """A transport that holds a write which is a whole response head (`HTTP/1.1 ...\\r\\n\\r\\n`) until
    the next write, which then carries both in one system call, or until the event loop's next turn,
    whichever comes first. Everything else is the wrapped transport's."""

    __slots__ = ("_head", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head: bytes | None = None
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.writelines((head, data))  # one writev
        elif data.startswith(b"HTTP/1.1 ") and data.endswith(b"\r\n\r\n"):  # no slice copied per token
            self._head = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def writelines(self, data: Any) -> None:
        self._flush()
        self._transport.writelines(data)

    def _flush(self) -> None:
        head = self._head
        if head is not None:
            self._head = None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._head = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + (len(self._head) if self._head is not None else 0)

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()
