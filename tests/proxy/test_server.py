"""The proxy's HTTP server (proxy/server.py): a response head leaves with its first body bytes, and is
never held back when the body is late; everything else is uvicorn's behaviour, unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvicorn

from proxy.server import server_config
from proxy.settings import Settings

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


@contextlib.asynccontextmanager
async def served(app: App) -> AsyncIterator[int]:
    """Serve an ASGI app with the proxy's server config on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, Settings(upstream="http://127.0.0.1:1", port=port)))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        await task
        sock.close()


async def _recv(reader: asyncio.StreamReader, until: bytes, timeout: float = 5.0) -> bytes:
    return await asyncio.wait_for(reader.readuntil(until), timeout)


def _sse_app(first_after_s: float) -> App:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if first_after_s:
            await asyncio.sleep(first_after_s)
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": False})
    return app


@pytest.mark.asyncio
async def test_a_head_and_the_first_chunk_sent_together_leave_in_one_write() -> None:
    async with served(_sse_app(0.0)) as port:
        loop = asyncio.get_running_loop()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        try:
            await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            # one read: whatever the first write put on the wire
            first = await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
            assert first.startswith(b"HTTP/1.1 200")
            assert b"\r\n\r\n" in first and b"data: 1\n\n" in first, first
            rest = b""
            while not rest.endswith(b"0\r\n\r\n"):
                rest += await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
            assert b"data: 2\n\n" in rest and b"data: 1" not in rest
        finally:
            sock.close()


@pytest.mark.asyncio
async def test_a_head_whose_body_is_late_is_not_held() -> None:
    """A stream waiting for its first token (or for admission) shows its status line at once."""
    async with served(_sse_app(1.0)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            started = time.perf_counter()
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await _recv(reader, b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            assert time.perf_counter() - started < 0.5  # the body comes after 1 s
            assert b"data: 1" in await _recv(reader, b"data: 1\n\n")
        finally:
            writer.close()


@pytest.mark.asyncio
async def test_keep_alive_and_expect_continue_work_as_before() -> None:
    async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async with served(echo) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for n in range(3):  # one connection, three requests
                payload = b'{"n": %d}' % n
                writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\nexpect: 100-continue\r\n\r\n"
                             % len(payload))
                assert (await _recv(reader, b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
                writer.write(payload)
                head = await _recv(reader, b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200") and b"content-length: %d" % len(payload) in head.lower()
                assert await asyncio.wait_for(reader.readexactly(len(payload)), 5) == payload
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert (await _recv(reader, b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after its answer
        finally:
            writer.close()
