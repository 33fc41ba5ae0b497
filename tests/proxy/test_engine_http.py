"""proxy/engine_http.py (the turn's lean client to the engine) against raw asyncio servers: the pool's
reuse and expiry, what is retried and what is not, a dropped stream reaching the engine as a closed
connection, and reading paused while a slow reader has a lot buffered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from proxy.engine_http import _HIGH_WATER, EnginePool
from proxy.errors import InvalidRequest, UpstreamError, UpstreamUnreachable
from proxy.upstream import Upstream


class Engine:
    """Counts connections and requests; `answer` writes each response (None: close unanswered)."""

    def __init__(self, answer: Callable[[int, bytes], bytes | None]) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.eofs = 0  # connections the client closed

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.eofs += 1
                    return
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                out = self.answer(len(self.requests), body)
                if out is None:
                    return
                writer.write(out)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client or the test ended it
        finally:
            writer.close()


def sse_answer(events: int) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(b'data: {"choices":[{"token_ids":[%d]}]}\n\n' % i for i in range(events)) + b"data: [DONE]\n\n"
    return head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


async def read_ids(up: Upstream, body: bytes = b"{}") -> list[int]:
    stream = await up.open_events("/v1/completions", body)
    ids: list[int] = []
    try:
        while (batch := await stream.read_batch()) is not None:
            ids += [t for ev in batch for c in ev.choices or () for t in c.token_ids or ()]
    finally:
        stream.close()
    return ids


@pytest.mark.asyncio
async def test_streams_reuse_one_connection_and_send_the_engine_key(serve) -> None:
    engine = Engine(lambda n, body: sse_answer(3))
    up = Upstream.open(await serve(engine), api_key="engine-key")
    try:
        for _ in range(3):
            assert await read_ids(up, b'{"x":1}') == [0, 1, 2]
        assert engine.connections == 1 and len(engine.requests) == 3
        head = engine.requests[0].decode()
        assert head.startswith("POST /v1/completions HTTP/1.1\r\n")
        assert "Authorization: Bearer engine-key\r\n" in head and head.endswith('\r\n\r\n{"x":1}')
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_a_stream_dropped_unfinished_closes_its_connection(serve) -> None:
    # A client gone mid-stream must reach vLLM as a closed connection (it aborts the request then).
    def answer(n: int, body: bytes) -> bytes:
        whole = sse_answer(5)
        return whole if n > 1 else whole[: whole.index(b"data: {") + 30]  # the first: cut mid-event

    engine = Engine(answer)
    up = Upstream.open(await serve(engine))
    try:
        stream = await up.open_events("/v1/completions", b"{}")
        stream.close()
        for _ in range(50):
            if engine.eofs:
                break
            await asyncio.sleep(0.01)
        assert engine.eofs == 1
        assert await read_ids(up) == [0, 1, 2, 3, 4]  # a new connection, no failed attempt first
        assert engine.connections == 2 and len(engine.requests) == 2
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_a_fresh_connection_closed_unanswered_is_not_sent_again(serve) -> None:
    engine = Engine(lambda n, body: None)
    up = Upstream.open(await serve(engine))
    try:
        with pytest.raises(UpstreamError, match="unreachable: Server disconnected"):
            await up.open_events("/v1/completions", b"{}")
        assert len(engine.requests) == 1
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_no_engine_listening_is_unreachable() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    up = Upstream.open(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(UpstreamUnreachable, match="unreachable"):
            await up.open_events("/v1/completions", b"{}")
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_an_idle_connection_is_let_go_before_the_engine_would(serve) -> None:
    engine = Engine(lambda n, body: sse_answer(1))
    up = Upstream.open(await serve(engine), keepalive_s=0.2)
    try:
        assert await read_ids(up) == [0]
        await asyncio.sleep(0.4)
        assert engine.eofs == 1  # closed by the pool itself, not left open until the next request
        assert await read_ids(up) == [0]
        assert engine.connections == 2 and len(engine.requests) == 2
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_an_engine_error_is_the_engines_message(serve) -> None:
    err = json.dumps({"error": {"message": "prompt is too long", "type": "BadRequestError"}}).encode()
    engine = Engine(lambda n, body: b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                    b"content-length: %d\r\n\r\n%s" % (len(err), err))
    up = Upstream.open(await serve(engine))
    try:
        with pytest.raises(InvalidRequest, match="prompt is too long"):
            await up.open_events("/v1/completions", b"{}")
        with pytest.raises(InvalidRequest):  # the connection went back to the pool whole
            await up.open_events("/v1/completions", b"{}")
        assert engine.connections == 1
    finally:
        await up.close()


@pytest.mark.asyncio
async def test_reading_pauses_while_a_slow_reader_has_much_buffered(serve) -> None:
    events = 40_000  # ~1.4 MB of events, written at once
    engine = Engine(lambda n, body: sse_answer(events))
    pool = EnginePool(await serve(engine))
    try:
        conn = await pool.request("POST", "/v1/completions", b"{}")
        paused = 0
        received = []
        while not conn.complete:
            await conn.wait()
            await asyncio.sleep(0.02)  # a slow reader: the engine's bytes pile up meanwhile
            paused += conn._paused
            assert conn.buffered <= _HIGH_WATER + 256 * 1024  # one socket read over the mark at most
            received.append(conn.take())
        received.append(conn.take())
        assert paused > 0
        assert b"".join(received) == sse_answer(events).split(b"\r\n", 5)[-1].split(b"\r\n")[0]
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_on_head_runs_once_from_the_data_callback_and_only_for_a_200(serve) -> None:
    """A turn's answer opens from `on_head` (proxy/turn_http.py `EarlyOpen`): called in the connection's
    own data callback (no task: the turn's has not woken yet) before `open_events` returns, once however
    the body is read, and never for an engine error."""
    error = b'{"error":{"message":"no such model"}}'
    engine = Engine(lambda n, body: sse_answer(3) if n == 1 else
                    b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error))
    up = Upstream.open(await serve(engine))
    calls: list[tuple[asyncio.Task[object] | None, bool]] = []
    returned = False

    def on_head() -> None:
        calls.append((asyncio.current_task(), returned))

    try:
        stream = await up.open_events("/v1/completions", b"{}", on_head=on_head)
        returned = True
        while await stream.read_batch() is not None:
            pass
        stream.close()
        assert calls == [(None, False)]
        with pytest.raises(InvalidRequest, match="no such model"):
            await up.open_events("/v1/completions", b"{}", on_head=on_head)
        assert len(calls) == 1
    finally:
        await up.close()
