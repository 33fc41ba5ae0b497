"""proxy/upstream.py against a raw HTTP/1.1 server that closes a kept-alive connection the moment the
next request arrives on it: what a server whose keep-alive timer fires just as the pool reuses the
connection does (CI saw it as "upstream ... unreachable: Server disconnected" under load)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from proxy.errors import UpstreamError
from proxy.upstream import Upstream


@dataclass
class RawServer:
    """Answers the first `answer_per_conn` requests of each connection, then closes it unanswered (served
    by the `serve` fixture, tests/proxy/conftest.py)."""

    answer_per_conn: int
    connections: int = 0
    requests: int = 0
    dropped: int = 0
    bodies: list[bytes] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                self.requests += 1
                if answered == self.answer_per_conn:
                    self.dropped += 1
                    return
                answered += 1
                self.bodies.append(body)
                out = json.dumps({"n": self.requests}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(out), out))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.mark.asyncio
async def test_a_pooled_connection_closed_by_the_server_is_retried_on_a_fresh_one(serve) -> None:
    raw = RawServer(answer_per_conn=1)
    up = Upstream.open(await serve(raw))
    try:
        assert await up.post_json("/x", {"turn": 1}) == {"n": 1}
        # the pooled connection is dead when this arrives: sent again on a new one, and nothing is lost
        assert await up.post_json("/x", {"turn": 2}) == {"n": 3}
        assert (raw.connections, raw.requests, raw.dropped) == (2, 3, 1)
        assert [json.loads(b) for b in raw.bodies] == [{"turn": 1}, {"turn": 2}]
        # The turn's stream has its own pool (proxy/engine_http.py) and keeps the same rule.
        first = await up.open_events("/x", b'{"turn": 3}')
        assert await first.read_batch() is None  # answered whole (no events): back to the pool
        first.close()
        again = await up.open_events("/x", b'{"turn": 4}')  # on the pooled one, which the server drops
        again.close()
        assert (raw.connections, raw.requests, raw.dropped) == (4, 6, 2)
        assert [json.loads(b) for b in raw.bodies] == [{"turn": 1}, {"turn": 2}, {"turn": 3}, {"turn": 4}]
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_a_fresh_connection_that_fails_is_not_sent_again(serve) -> None:
    raw = RawServer(answer_per_conn=0)
    up = Upstream.open(await serve(raw))
    try:
        with pytest.raises(UpstreamError, match="unreachable: Server disconnected"):
            await up.post_json("/x", {"turn": 1})
        assert (raw.connections, raw.requests) == (1, 1)
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_the_pool_lets_an_idle_connection_go_before_the_server_would(serve) -> None:
    raw = RawServer(answer_per_conn=1)
    up = Upstream.open(await serve(raw), keepalive_s=0.2)
    try:
        assert await up.post_json("/x", {}) == {"n": 1}
        await asyncio.sleep(0.4)
        assert await up.post_json("/x", {}) == {"n": 2}  # a new connection, no failed attempt first
        assert (raw.connections, raw.requests, raw.dropped) == (2, 2, 0)
    finally:
        await up.close()


def test_the_default_keepalive_is_below_vllms(tmp_path: Path) -> None:
    from vllm import envs

    from proxy.settings import Settings
    from proxy.upstream import KEEPALIVE_S

    settings = Settings(upstream="http://127.0.0.1:1")
    assert settings.upstream_keepalive_s == KEEPALIVE_S < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    # the one way to change it is the runtime config file `serve` writes
    Settings(upstream="http://x:1", upstream_keepalive_s=1.5).dump(tmp_path / "proxy.json")
    assert Settings.load(tmp_path / "proxy.json").upstream_keepalive_s == 1.5


@pytest.mark.asyncio
async def test_the_proxy_keeps_an_idle_client_connection_past_common_client_limits() -> None:
    """The served config (proxy.server.server_config) holds an idle keep-alive connection longer
    than httpx (5 s) or undici (4 s) reuse one; uvicorn's default (5 s) would close it at 5 s."""
    import socket

    import uvicorn

    from proxy.server import server_config
    from proxy.settings import Settings

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = Settings(upstream="http://127.0.0.1:1", port=port)
    server = uvicorn.Server(server_config(app, settings))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
        for _ in range(2):
            writer.write(request)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(2) == b"ok"
            await asyncio.sleep(6.0)  # past uvicorn's default keep-alive
        assert not reader.at_eof()
        writer.close()
    finally:
        server.should_exit = True
        await task
        sock.close()


class StallingServer:
    """Reads one request, then sends `events` SSE events (or not even a status line) and goes quiet."""

    def __init__(self, events: int | None) -> None:
        self.events = events

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            if self.events is not None:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for _ in range(self.events):
                    event = b'data: {"choices":[{"token_ids":[5],"finish_reason":null}]}\n\n'
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
            await asyncio.sleep(30)  # quiet until the client gives up and the test ends
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


@pytest.mark.asyncio
async def test_a_stream_that_goes_quiet_fails_after_the_read_timeout(serve) -> None:
    # The streamed answer is watched by EventStream's own timer (not aiohttp's per-read sock_read).
    up = Upstream.open(await serve(StallingServer(events=1)), timeout_s=0.3)
    try:
        stream = await up.open_events("/x", b"{}")
        batch = await stream.read_batch()
        assert batch is not None and batch[0].choices and batch[0].choices[0].token_ids == [5]
        started = time.monotonic()
        with pytest.raises(UpstreamError, match=r"no data from the engine in 0\.3 s"):
            await stream.read_batch()
        assert 0.25 <= time.monotonic() - started < 3
        stream.close()
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_an_engine_that_never_answers_fails_after_the_read_timeout(serve) -> None:
    up = Upstream.open(await serve(StallingServer(events=None)), timeout_s=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(UpstreamError, match=r"sent no answer in 0\.3 s"):
            await up.open_events("/x", b"{}")
        assert 0.25 <= time.monotonic() - started < 3
    finally:
        await up.close()
