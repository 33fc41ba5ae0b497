"""Fixtures shared by the proxy's tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import pytest_asyncio


class RawHandler(Protocol):
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None: ...


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[[RawHandler], Awaitable[str]]]:
    """Start raw asyncio servers (an object's `handle` per connection) on loopback; yields a function
    that starts one and returns its base URL. All are closed after the test."""
    servers: list[asyncio.Server] = []

    async def start(raw: RawHandler) -> str:
        server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()
