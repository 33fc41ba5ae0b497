"""A turn served by the server's protocol itself (proxy/turn_http.py, proxy/server.py), on a real
uvicorn server over raw sockets: what ASGI and the front door did still happens: the key, the body
limit (declared and streamed), keep-alive, 100-continue, pipelining in order, a client leaving
mid-stream, a crash before and after the answer began; a target with a query, another method or an app
whose turns are not ready yet take the ASGI entry."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response

from proxy.auth import Guard
from proxy.errors import ProxyError
from proxy.front import ProxyApp
from proxy.http import TurnHTTPRequest, error_response, json_response, read_json
from proxy.streaming import StreamedResponse
from proxy.turn_http import InboundTurn
from proxy.wire import LastChunk, Opening
from tests.proxy.fake_vllm import serve_app

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

KEY = "sk-turn"
LIMIT = 4096


class Handlers:
    """Turn handlers that record what they were given and stream on demand."""

    def __init__(self) -> None:
        self.seen: list[tuple[type, dict[str, str], dict[str, Any]]] = []
        self.closed = asyncio.Event()
        self.ready = True
        self.go = asyncio.Event()  # an early-opened answer goes on (`early` bodies)

    async def chat(self, request: TurnHTTPRequest) -> Response:
        try:
            body = await read_json(request)
        except ProxyError as exc:  # as the turn endpoints answer it (proxy/routes.py)
            return error_response(exc)
        self.seen.append((type(request), dict(request.headers), body))
        if body.get("crash") == "before":
            raise RuntimeError("a bug")
        if body.get("early"):
            return await self.opened_early(request, body["early"])
        if not body.get("stream"):
            return json_response({"n": body.get("n")})
        return StreamedResponse(self.chunks(body), media_type="text/event-stream", headers={"x-engine": "e0"})

    async def chunks(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        try:
            for i in range(body.get("count", 2)):
                if body.get("crash") == "after" and i == 1:
                    raise RuntimeError("a bug mid-stream")
                yield b"data: %d%s\n\n" % (i, b" " * body.get("pad", 0))
                await asyncio.sleep(body.get("every_s", 0))
            yield LastChunk(b"data: [DONE]\n\n")
        finally:
            self.closed.set()


    async def opened_early(self, request: TurnHTTPRequest, then: str) -> Response:
        """As proxy/routes.py does on the engine's 200: the answer opens from a callback, before the
        handler returns; then the rest of it, or (`whole`) a whole answer of a failure caught late."""
        assert isinstance(request, InboundTurn)
        early = request.early_open({"x-engine": "e0"}, lambda: Opening(b"data: first\n\n", None))
        early.prepare()
        early.send()  # the engine connection's `on_head`
        early.send()  # at most once
        await self.go.wait()
        if then == "whole" or early.response is None:
            return json_response({"late": True})
        early.response.chunks = self.rest(early.opening)
        return early.response

    async def rest(self, opening: Opening[None] | None) -> AsyncIterator[bytes]:
        if opening is None or not opening.sent:
            yield b"data: first\n\n"
        yield b"data: 1\n\n"
        yield LastChunk(b"data: [DONE]\n\n")


def make_app(h: Handlers) -> ProxyApp:
    app = ProxyApp()
    app.serve_turns({"/v1/chat/completions": h.chat, "/v1/messages": h.chat},
                    lambda inner: Guard(inner, keys=[KEY], max_body_bytes=LIMIT), ready=lambda: h.ready)
    app.router.add_route("/v1/chat/completions", h.chat, methods=["POST"])
    return app


@contextlib.asynccontextmanager
async def served(app: ProxyApp) -> AsyncIterator[int]:
    """The app on the proxy's own protocol (`serve_app` uses it for a ProxyApp); yields the port."""
    async with serve_app(app) as url:
        yield int(url.rsplit(":", 1)[1])


def post(path: str, body: dict[str, Any] | bytes, *, key: str | None = KEY, extra: str = "") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n{auth}{extra}"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One response: its head and its body (content-length or chunked, de-chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lower = head.lower()
    if b"content-length:" in lower:
        n = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
        return head, await asyncio.wait_for(reader.readexactly(n), 5)
    body = b""
    while True:
        size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)).strip(), 16)
        chunk = await asyncio.wait_for(reader.readexactly(size + 2), 5)
        if size == 0:
            return head, body
        body += chunk[:-2]


async def test_a_streamed_turn_is_served_without_asgi_and_its_head_leaves_with_the_first_chunk() -> None:
    h = Handlers()
    async with served(make_app(h)) as port:
        loop = asyncio.get_running_loop()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        try:
            await loop.sock_sendall(sock, post("/v1/chat/completions", {"stream": True, "count": 2, "every_s": 0.05},
                                               extra="x-session: a\r\nX-Session: b\r\n"))
            first = await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
            assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked\r\n" in first
            assert b"x-engine: e0\r\n" in first and b"content-type: text/event-stream" in first
            assert first.endswith(b"\r\n\r\n9\r\ndata: 0\n\n\r\n")  # the head and the first chunk: one write
            rest = b""
            while not rest.endswith(b"0\r\n\r\n"):
                rest += await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
            assert rest == b"9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
        finally:
            sock.close()
    kind, headers, body = h.seen[0]
    assert kind is InboundTurn and body["stream"] is True
    assert headers["x-session"] == "b" and headers["content-type"] == "application/json"


async def test_keep_alive_continue_and_close_on_one_connection() -> None:
    h = Handlers()
    async with served(make_app(h)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for n in range(3):
                request = post("/v1/chat/completions", {"n": n}, extra="expect: 100-continue\r\n")
                head, _, payload = request.partition(b"\r\n\r\n")
                writer.write(head + b"\r\n\r\n")
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
                writer.write(payload)
                head, body = await read_answer(reader)
                assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"n": n}
                assert b"connection: close" not in head
            writer.write(post("/v1/messages", {"stream": True, "count": 1}, extra="connection: close\r\n"))
            head, body = await read_answer(reader)
            assert b"connection: close\r\n" in head and body == b"data: 0\n\ndata: [DONE]\n\n"
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after its answer
        finally:
            writer.close()
    assert all(kind is InboundTurn for kind, _, _ in h.seen) and len(h.seen) == 4


async def test_pipelined_turns_are_answered_in_order() -> None:
    h = Handlers()
    async with served(make_app(h)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            slow = {"stream": True, "count": 3, "every_s": 0.05}
            writer.write(post("/v1/chat/completions", slow) + post("/v1/chat/completions", {"n": 7}))
            head, body = await read_answer(reader)
            assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
            head, body = await read_answer(reader)
            assert json.loads(body) == {"n": 7}
        finally:
            writer.close()


async def test_a_client_leaving_mid_stream_ends_the_body_at_once() -> None:
    h = Handlers()
    async with served(make_app(h)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/v1/chat/completions", {"stream": True, "count": 1000, "every_s": 0.05}))
        await reader.readuntil(b"data: 0")
        writer.close()
        await asyncio.wait_for(h.closed.wait(), 2)  # the generator's finally ran (the engine request ends)


async def test_the_front_door_holds_on_the_direct_path() -> None:
    h = Handlers()
    async with served(make_app(h)) as port:
        async def one(request: bytes) -> tuple[bytes, bytes, bool]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(request)
                head, body = await read_answer(reader)
                closed = await asyncio.wait_for(reader.read(), 5) == b"" if b"connection: close" in head else False
                return head, body, closed
            finally:
                writer.close()

        head, body, _ = await one(post("/v1/chat/completions", {"n": 1}, key=None))
        assert head.startswith(b"HTTP/1.1 401") and b"www-authenticate: Bearer" in head
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        head, body, _ = await one(post("/v1/messages", {"n": 1}, key="wrong"))
        assert head.startswith(b"HTTP/1.1 401") and json.loads(body)["type"] == "error"  # Anthropic's shape
        head, body, closed = await one(post("/v1/chat/completions", {"pad": "x" * LIMIT}))
        assert head.startswith(b"HTTP/1.1 413") and closed and "over the limit" in body.decode()
        chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: p\r\nauthorization: Bearer " + KEY.encode()
                   + b"\r\ntransfer-encoding: chunked\r\n\r\n" + b"800\r\n" + b"x" * 0x800 + b"\r\n") * 1
        chunked += (b"800\r\n" + b"x" * 0x800 + b"\r\n") * 2 + b"0\r\n\r\n"
        head, body, closed = await one(chunked)
        assert head.startswith(b"HTTP/1.1 413") and closed
        head, body, closed = await one(post("/v1/chat/completions", {"n": 1}).replace(b"host: proxy", b"host: evil/?"))
        assert head.startswith(b"HTTP/1.1 400") and closed and b"Host header" in body
        head, body, _ = await one(post("/v1/chat/completions", b"{not json"))
        assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert len(h.seen) == 0


async def test_a_crash_is_a_500_before_the_answer_and_a_dropped_connection_after() -> None:
    h = Handlers()
    async with served(make_app(h)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(post("/v1/chat/completions", {"crash": "before"}))
            head, body = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 500")
            assert json.loads(body)["error"] == {"message": "internal error: RuntimeError", "type": "server_error",
                                                 "param": None, "code": None}
            writer.write(post("/v1/chat/completions", {"n": 2}))  # the connection still serves
            assert json.loads((await read_answer(reader))[1]) == {"n": 2}
            writer.write(post("/v1/chat/completions", {"stream": True, "count": 3, "crash": "after"}))
            got = await asyncio.wait_for(reader.read(), 5)  # the first chunk, then the connection ends
            assert got.startswith(b"HTTP/1.1 200") and b"data: 0" in got and not got.endswith(b"0\r\n\r\n")
        finally:
            writer.close()


async def test_other_targets_and_methods_and_an_app_not_ready_take_the_asgi_entry() -> None:
    h = Handlers()
    async with served(make_app(h)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(post("/v1/chat/completions?x=1", {"n": 1}))
            head, body = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"n": 1}
            writer.write(b"GET /v1/chat/completions HTTP/1.1\r\nhost: p\r\nauthorization: Bearer sk-turn\r\n\r\n")
            head, _ = await read_answer(reader)
            assert head.startswith(b"HTTP/1.1 405")
            h.ready = False
            writer.write(post("/v1/chat/completions", {"n": 3}))
            head, body = await read_answer(reader)
            assert json.loads(body) == {"n": 3}
        finally:
            writer.close()
    assert [kind for kind, _, _ in h.seen] == [Request, Request]


async def test_a_slow_reader_holds_the_writer_back() -> None:
    """A client that stops reading pauses the body (flow control), rather than the proxy buffering it."""
    h = Handlers()
    big = {"stream": True, "count": 5000, "pad": 4096}  # 20 MB: more than any socket buffer holds
    async with served(make_app(h)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        try:
            transport = writer.transport
            transport.pause_reading()  # type: ignore[attr-defined]
            writer.write(post("/v1/chat/completions", big))
            await asyncio.sleep(0.5)
            assert not h.closed.is_set()  # 100,000 chunks did not all go into buffers
            transport.resume_reading()  # type: ignore[attr-defined]
            got = bytearray()
            while not got.endswith(b"\r\n0\r\n\r\n"):
                got += await asyncio.wait_for(reader.read(1 << 20), 5)
            assert got.count(b"data: ") == 5001
        finally:
            writer.close()


@pytest.mark.parametrize("then", ["rest", "whole"])
async def test_an_answer_opened_early_leaves_before_the_handler_returns_and_only_once(then: str) -> None:
    """The engine's 200 opens the answer (head and first chunk, one write) from the engine connection's
    callback, while the turn's handler has not returned yet; the stream then goes on without either
    again. A whole answer after that (a failure caught late) cannot follow a stream's head: the
    connection ends, as when a handler fails after its answer began."""
    h = Handlers()
    async with served(make_app(h)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(post("/v1/chat/completions", {"stream": True, "early": then}))
            first = await asyncio.wait_for(reader.readuntil(b"data: first\n\n\r\n"), 5)
            assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-engine: e0\r\n" in first
            assert b"content-type: text/event-stream" in first and b"transfer-encoding: chunked\r\n" in first
            h.go.set()  # only now may the handler return
            rest = await asyncio.wait_for(reader.read(), 5) if then == "whole" else b""
            if then == "rest":
                while not rest.endswith(b"0\r\n\r\n"):
                    rest += await asyncio.wait_for(reader.read(65536), 5)
                assert rest == b"9\r\ndata: 1\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
                writer.write(post("/v1/chat/completions", {"n": 2}))  # kept alive: the next request is served
                head, body = await read_answer(reader)
                assert head.startswith(b"HTTP/1.1 200 OK") and json.loads(body) == {"n": 2}
            else:
                assert rest == b""  # no second head, no JSON: the connection ended
        finally:
            writer.close()
