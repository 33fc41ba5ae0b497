"""The turn's request to the engine over a lean HTTP/1.1 client: one asyncio Protocol per kept-alive
connection, each response parsed by httptools (llhttp, the parser uvicorn serves with), its body bytes
handed to the one reader as they arrive.

Why not aiohttp for this one call (it stays for every other request to the engine: models, metrics,
health, warm-ups, the pass-through): a turn's stream is the proxy's hot path, and aiohttp's client
costs there were measured as the largest single share of both per-request and per-token proxy CPU
(`bench_costs --hot-path`, chat mode): building a `ClientRequest`
(URL, multidict headers, tracing signals, a writer task) per request, and per network read a
`StreamReader` feed, a flow-control check, a timer re-arm and a waiter hop before our code sees the
bytes. Here a request is one write of a prebuilt head and the body, and a read is one
`feed_data` into llhttp whose body callback appends to a list the reader takes whole.

What it keeps from the aiohttp path: a pool of idle connections let go well before the engine's own
keep-alive (`keepalive_s`), a request that meets a pooled connection the engine just closed is sent
again on a fresh one (nothing reached a handler), a connect that fails is `UpstreamUnreachable`, and
a response dropped unfinished closes its connection (vLLM aborts the request and frees its seat).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

from proxy.errors import UpstreamError, UpstreamUnreachable

log = logging.getLogger("proxy.engine_http")

CONNECT_TIMEOUT_S = 10.0
# Reading pauses while this much body is buffered unread (a client slower than the engine).
_HIGH_WATER = 256 * 1024
# How often a request that met a pooled connection the engine had just closed is sent again (both pools).
REUSE_RETRIES = 2


class EngineConnection(asyncio.Protocol):
    """One connection; one request at a time. State of the response in flight: `status` once its head
    is in, `chunks` of body not taken yet, `complete` at its end, `error` if the connection failed."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.closed = False
        self.reset()

    def reset(self) -> None:
        self.status = 0  # 0 until the response head is in
        self.on_head: Callable[[], None] | None = None  # called once when a 200 head is in (`send`)
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.keep_alive = True
        self.received = False  # any byte of this response
        self.error: Exception | None = None
        self.last = 0.0  # loop time of the last byte

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        self.last = asyncio.get_running_loop().time()
        parser = self._parser
        if parser is None:  # bytes nobody asked for: the connection is not reusable
            self.abort(UpstreamError("the engine sent data outside a response"))
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.abort(UpstreamError(f"the engine sent a malformed HTTP response: {exc}"))
            return
        if self.buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        if self.on_head is not None and self.status == 200:
            self._headed()
        self._wake()

    def _headed(self) -> None:
        """The engine said 200: `on_head` runs now, in this callback, not after the reader's task wakes."""
        on_head, self.on_head = self.on_head, None
        try:
            on_head()  # type: ignore[misc]  # checked by the caller
        except Exception:  # the caller's bug: its own path still answers, only later
            log.exception("on_head failed")

    def eof_received(self) -> bool:
        return False  # close: the engine ended the connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._parser is not None and not self.complete and self.error is None:
            self.error = UpstreamError(f"Server disconnected{f': {exc}' if exc else ''}")
        self._wake()

    # -- httptools callbacks
    def on_headers_complete(self) -> None:
        if self._parser is not None:
            self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        if self._parser is not None:
            self.keep_alive = self._parser.should_keep_alive()
        self._parser = None  # anything after the response is not ours to read

    # -- the reader's side
    def send(self, head: bytes, body: bytes, on_head: Callable[[], None] | None = None) -> None:
        self.reset()
        self.on_head = on_head
        self._parser = httptools.HttpResponseParser(self)
        if self.transport is None or self.closed:
            self.error = UpstreamError("Server disconnected")
            return
        self.transport.writelines((head, body))  # one write of both, without copying a long prompt

    async def wait(self) -> None:
        """Until something happens on the connection (bytes, its end, an error)."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        """The body bytes received and not taken yet, as one piece."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def abort(self, exc: Exception) -> None:
        """Fail the response in flight and drop the connection (the engine sees its client leave)."""
        if self.error is None:
            self.error = exc
        self.close()
        self._wake()

    def close(self) -> None:
        self._parser = None
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and self.error is None and not self.closed

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class EnginePool:
    """Kept-alive connections to one engine. `request()` returns a connection whose response head is in;
    the caller reads its body and gives it back with `release()` (reused only if the response ended)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, keepalive_s: float = 3.0) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"the engine URL must be http(s)://host[:port]: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._prefix = url.path.rstrip("/")
        netloc = url.netloc.rsplit("@", 1)[-1]
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._fixed = f"Host: {netloc}\r\nContent-Type: application/json\r\n{auth}".encode("latin-1")
        self.keepalive_s = keepalive_s
        self._idle: list[tuple[EngineConnection, float]] = []  # most recently used last
        self._sweep: asyncio.TimerHandle | None = None  # closes connections idle past keepalive_s

    async def request(self, method: str, path: str, body: bytes,
                      on_head: Callable[[], None] | None = None) -> EngineConnection:
        """`on_head`: called from the connection's data callback the moment a 200 head is in, before
        this returns (a turn's answer opens then: proxy/turn_http.py `EarlyOpen`)."""
        head = b"%s %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n" % (
            method.encode(), (self._prefix + path).encode(), self._fixed, len(body))
        retries = 0
        while True:
            conn, reused = await self._acquire()
            try:
                conn.send(head, body, on_head)
                while not conn.status and conn.error is None:
                    await conn.wait()
            except BaseException:
                conn.close()  # cancelled or timed out mid-request: the engine must see it dropped
                raise
            if conn.status:
                return conn
            conn.close()
            retries += 1
            # A pooled connection the engine closed as this arrived: nothing of it was read, so no
            # handler ran; sent again on a fresh connection. A fresh connection's failure is real.
            if not reused or conn.received or retries > REUSE_RETRIES:
                raise UpstreamError(f"upstream {self.base_url} unreachable: {conn.error}")

    async def _acquire(self) -> tuple[EngineConnection, bool]:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._idle:
            conn, since = self._idle.pop()
            if not conn.closed and now - since < self.keepalive_s:
                return conn, True
            conn.close()
        conn = EngineConnection()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await loop.create_connection(lambda: conn, self._host, self._port, ssl=self._ssl)
        except (OSError, TimeoutError) as exc:
            raise UpstreamUnreachable(f"upstream {self.base_url} unreachable: {exc or type(exc).__name__}") from exc
        return conn, False

    def release(self, conn: EngineConnection) -> None:
        if not conn.reusable:
            conn.close()
            return
        loop = asyncio.get_running_loop()
        self._idle.append((conn, loop.time()))
        if self._sweep is None:  # one timer per pool, not one per request
            self._sweep = loop.call_later(self.keepalive_s, self._expire)

    def _expire(self) -> None:
        """Close the connections idle for `keepalive_s` (not left for the engine to drop)."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        keep = []
        for conn, since in self._idle:
            if now - since >= self.keepalive_s or conn.closed:
                conn.close()
            else:
                keep.append((conn, since))
        self._idle = keep
        if keep:
            self._sweep = loop.call_later(self.keepalive_s - (now - keep[0][1]), self._expire)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn, _ in self._idle:
            conn.close()
        self._idle.clear()
