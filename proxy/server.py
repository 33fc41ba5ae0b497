"""The HTTP server the proxy runs: uvicorn with its httptools protocol, and one change to how a response
leaves: its head goes out in the same write as its first body bytes.

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
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.settings import Settings


def server_config(app: FastAPI, settings: Settings) -> uvicorn.Config:
    """The HTTP server's settings; a client's idle connection is kept `keep_alive_s` (Settings)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=settings.keep_alive_s,
        http=HeadWithBodyProtocol,
    )


class HeadWithBodyProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through `HeadHoldingTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadHoldingTransport(transport))  # type: ignore[arg-type]


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
