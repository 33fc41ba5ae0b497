"""aiohttp client to one vLLM server: raw relay for pass-through routes, SSE events for the chat path.

aiohttp rather than httpx: measured here at 32-56 µs vs 126-146 µs proxy CPU per relayed SSE event and
+0.47 vs +0.90 ms TTFB (shared/research/proxy_anchors.md §7-§8). Events are parsed incrementally
(proxy/sse.py, linear in bytes) and decoded with msgspec into the few typed fields the turn reads (it
comes with vLLM). The seam for tests is the
`aiohttp.ClientSession` passed in: point it at an in-process fake server, or at a real vLLM.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from proxy.engine_http import REUSE_RETRIES, EngineConnection, EnginePool
from proxy.errors import InvalidRequest, UpstreamError, UpstreamUnreachable
from proxy.sse import SSEParser

# Hop-by-hop and length headers must not be copied between the two connections.
_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "host",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "authorization",
        "x-api-key",
    }
)


_JSON = {"content-type": "application/json"}
# vLLM echoes the whole prompt in the first streamed event (`return_token_ids`); we sent it, so it is
# cut out before parsing instead of decoding 100K ids per request.
_PROMPT_IDS = b'"prompt_token_ids":['


def _drop_prompt_ids(data: bytes) -> bytes:
    start = data.find(_PROMPT_IDS)
    if start < 0:
        return data
    end = data.find(b"]", start + len(_PROMPT_IDS))
    if end < 0:
        return data
    return data[:start] + b'"prompt_token_ids":null' + data[end + 1 :]


# vLLM's HTTP server drops a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default), while
# aiohttp keeps one pooled for 15 s: a request sent on it just as the server closes it fails with
# "Server disconnected" (seen in CI under load). The pool lets go well before the server does, and a
# request that still meets a closed pooled connection is sent again (`Upstream._send`).
KEEPALIVE_S = 3.0
# How long the end of a response is awaited after `[DONE]` before the connection is dropped instead.
_END_WAIT_S = 0.5


class _Attempt:
    """Per-request trace context: set when aiohttp hands the request a pooled connection."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


def _reuse_tracer() -> aiohttp.TraceConfig:
    async def on_reuse(_session: Any, ctx: Any, _params: Any) -> None:
        if isinstance(ctx.trace_request_ctx, _Attempt):
            ctx.trace_request_ctx.reused = True

    tracer = aiohttp.TraceConfig()
    tracer.on_connection_reuseconn.append(on_reuse)
    return tracer


@dataclass(frozen=True, slots=True)
class ModelInfo:
    upstream_id: str  # the name vLLM serves; requests are rewritten to it
    max_model_len: int


class RelayResponse:
    """An upstream response being relayed; iterate `chunks()` then `release()` (also on error)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS]

    async def chunks(self) -> AsyncIterator[bytes]:
        # iter_any: forward bytes as they arrive, one yield per network read, not per line.
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        finally:
            self.release()

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        finally:
            self.release()

    def release(self) -> None:
        self._resp.release()


class Choice(msgspec.Struct):
    """What the turn reads of a streamed completion choice (the rest of it is skipped by the decoder)."""

    token_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: Any = None


class Event(msgspec.Struct):
    """What the turn reads of one streamed completion event: typed decoding is about twice as fast as
    building the whole event as dicts, and skips `id`, `model`, `text`, ... without allocating them."""

    choices: list[Choice] | None = None
    usage: dict[str, Any] | None = None
    error: Any = None


_EVENT = msgspec.json.Decoder(Event)


class EventStream:
    """An open SSE response; `read_batch()` returns the events of each network read until `[DONE]`.

    A proxy that falls behind gets several events per read and handles them as one (one parser call,
    one chunk, one write), so its cost per event drops exactly when the load rises. The bytes come from
    the lean engine connection (proxy/engine_http.py): each wake-up takes everything received so far.
    """

    def __init__(self, conn: EngineConnection, pool: EnginePool, idle_s: float | None = None) -> None:
        self._conn = conn
        self._pool = pool
        self._sse = SSEParser()
        self._first = True
        self._closed = False
        # `idle_s`: the stream fails after that long without a byte, watched by one timer per stream
        # (`_check`) rather than a timer re-armed on every network read (once per token).
        self._idle_s = idle_s
        self._watch: asyncio.TimerHandle | None = None
        if idle_s is not None:
            loop = asyncio.get_running_loop()
            conn.last = loop.time()
            self._watch = loop.call_later(idle_s, self._check)

    def _check(self) -> None:
        idle_s = self._idle_s or 0.0
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self._conn.last
        if quiet < idle_s:
            self._watch = loop.call_later(idle_s - quiet, self._check)
            return
        self._watch = None
        self._conn.abort(UpstreamError(f"no data from the engine in {idle_s:g} s"))

    async def read_batch(self) -> list[Event] | None:
        """The events completed by the next read(s), at least one; None at `[DONE]` or the end of the
        response. The caller closes the stream (`close()`) when done with it."""
        sse, conn = self._sse, self._conn
        try:
            while not sse.done:
                if conn.chunks:
                    datas = sse.feed(conn.take())
                    if datas:
                        if self._first:
                            datas[0] = _drop_prompt_ids(datas[0])
                            self._first = False
                        return [_EVENT.decode(datas[0])] if len(datas) == 1 else [_EVENT.decode(d) for d in datas]
                elif conn.error is not None:
                    raise UpstreamError(f"upstream stream broke: {conn.error}")
                elif conn.complete:
                    return None
                else:
                    await conn.wait()
            await self._finish_body()
            return None
        except ValueError as exc:
            raise UpstreamError(f"upstream sent a malformed event: {exc}") from exc

    async def _finish_body(self) -> None:
        """After `[DONE]`, read the response's end (the chunked terminator, sent right after it) so the
        connection goes back to the pool: closing it unfinished would make the next request open a new
        one (a connect on both sides, measured as most of the per-request gap to a bare relay)."""
        conn = self._conn
        try:
            async with asyncio.timeout(_END_WAIT_S):
                while not (conn.complete or conn.error is not None or conn.closed):
                    await conn.wait()
        except TimeoutError:
            pass  # an engine that keeps the response open: close() drops the connection

    async def batches(self) -> AsyncIterator[list[Event]]:
        """`read_batch()` as an async iterator (for callers that want one); closes the stream at the end."""
        try:
            while (batch := await self.read_batch()) is not None:
                yield batch
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        # An unfinished response is dropped with its connection, which makes vLLM abort the request
        # and free its seat when a client goes away mid-stream; a finished one goes back to the pool.
        self._pool.release(self._conn)


# The client's credential is for the proxy; the engine has its own key (set on the session), which a
# forwarded Authorization header would override.
_CLIENT_CREDENTIALS = frozenset({"authorization", "x-api-key"})


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS | _CLIENT_CREDENTIALS}


class Upstream:
    """The engine's HTTP API. A turn's stream goes over the lean client (`streams`, proxy/engine_http.py);
    every other call over the aiohttp session."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession, read_timeout_s: float | None = None, *,
                 api_key: str | None = None, keepalive_s: float = KEEPALIVE_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.streams = EnginePool(base_url, api_key=api_key, keepalive_s=keepalive_s)
        self._model: ModelInfo | None = None
        # A streamed answer fails after this long without a byte (EventStream watches it).
        self.read_timeout_s = read_timeout_s

    @classmethod
    def open(
        cls, base_url: str, *, timeout_s: float = 3600, api_key: str | None = None, keepalive_s: float = KEEPALIVE_S
    ) -> Upstream:
        # limit=0: no connection cap here; admission (proxy/admission.py) decides concurrency.
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True, keepalive_timeout=keepalive_s)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, headers=headers,
            trace_configs=[_reuse_tracer()],
        )
        return cls(base_url, session, timeout_s, api_key=api_key, keepalive_s=keepalive_s)

    async def _send(self, method: str, path: str, **kwargs: Any) -> aiohttp.ClientResponse:
        """Send a request and wait for its status line. A pooled connection the server closed while it
        sat idle fails at once with ServerDisconnectedError and nothing read; that attempt reached no
        handler, so it is sent again (a fresh connection's failure is a real one and raises)."""
        retries = 0
        while True:
            ctx = _Attempt()
            try:
                return await self.session.request(method, self.base_url + path, trace_request_ctx=ctx, **kwargs)
            except aiohttp.ServerDisconnectedError as exc:
                retries += 1
                if not ctx.reused or retries > REUSE_RETRIES:
                    raise UpstreamError(f"upstream {self.base_url} unreachable: {exc}") from exc
            except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
                raise UpstreamUnreachable(f"upstream {self.base_url} unreachable: {exc}") from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise UpstreamError(f"upstream {self.base_url} unreachable: {exc}") from exc

    async def close(self) -> None:
        self.streams.close()
        await self.session.close()

    async def relay(self, method: str, path: str, *, headers: Mapping[str, str], body: bytes | None) -> RelayResponse:
        return RelayResponse(await self._send(method, path, headers=dict(headers), data=body))

    async def get_json(self, path: str) -> Any:
        resp = await self._send("GET", path)
        data = await self._read_all(resp)
        if resp.status != 200:
            raise UpstreamError(f"upstream GET {path} answered {resp.status}: {data[:200]!r}")
        return json.loads(data)

    async def get_text(self, path: str) -> str:
        resp = await self._send("GET", path)
        data = await self._read_all(resp)
        return data.decode(resp.get_encoding(), errors="replace")

    async def _read_all(self, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(f"upstream {self.base_url} broke off its answer: {exc}") from exc
        finally:
            resp.release()

    async def post_json(self, path: str, payload: Mapping[str, Any]) -> Any:
        return await self.post_raw(path, json.dumps(payload).encode())

    async def post_raw(self, path: str, payload: bytes) -> Any:
        resp = await self._send("POST", path, data=payload, headers=_JSON)
        data = await self._read_all(resp)
        _raise_for_status(resp.status, data)
        return json.loads(data)

    async def open_events(self, path: str, payload: bytes, *, on_head: Callable[[], None] | None = None) -> EventStream:
        """POST a streaming request (JSON bytes) and wait for the status line only: a 4xx/5xx raises
        here, before the caller has sent a byte, so it can still answer with a proper error.
        `on_head`: called the moment a 200 arrives, before this returns (`EnginePool.request`)."""
        idle_s = self.read_timeout_s
        try:  # the status line within the read timeout
            async with asyncio.timeout(idle_s):
                conn = await self.streams.request("POST", path, payload, on_head)
        except TimeoutError as exc:
            raise UpstreamError(f"upstream {self.base_url} sent no answer in {idle_s:g} s") from exc
        if conn.status != 200:
            try:
                async with asyncio.timeout(idle_s):
                    while not conn.complete and conn.error is None:
                        await conn.wait()
                data = conn.take()
            except TimeoutError as exc:
                raise UpstreamError(f"upstream {self.base_url} answered {conn.status} and then nothing") from exc
            finally:
                self.streams.release(conn)
            _raise_for_status(conn.status, data)
            raise UpstreamError(f"upstream answered {conn.status}")
        return EventStream(conn, self.streams, idle_s)

    async def model(self, *, refresh: bool = False) -> ModelInfo:
        """The served model id and max_model_len, read once from vLLM's /v1/models."""
        if self._model is None or refresh:
            data = await self.get_json("/v1/models")
            try:
                first = data["data"][0]
                self._model = ModelInfo(upstream_id=str(first["id"]), max_model_len=int(first["max_model_len"]))
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise UpstreamError(f"upstream /v1/models has no usable model entry: {str(data)[:200]}") from exc
        return self._model


def _raise_for_status(status: int, data: bytes) -> None:
    if status < 400:
        return
    try:
        message = str(json.loads(data)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = data[:500].decode(errors="replace")
    if 400 <= status < 500:
        raise InvalidRequest(f"upstream rejected the request: {message}")
    raise UpstreamError(f"upstream answered {status}: {message}")
