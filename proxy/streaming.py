"""A streamed HTTP answer written straight to the ASGI `send`, watching for the client to leave.

Why not Starlette's StreamingResponse: under uvicorn (ASGI spec 2.3) it runs the body and a disconnect
listener as two tasks of an anyio task group per response, measured at +0.9 ms to the first byte and
+0.5 ms CPU per request on the proxy's hot path (`bench_costs --hot-path`, chat mode, one core). Here
the body is written from the request's own task, and one plain asyncio task waits on `receive()`; a
client that leaves cancels the writing at once (mid-stream, or while the body waits for admission or
its first token), so the body generator's `finally` runs and the engine request is aborted.

A body's last bytes may come as `LastChunk` (proxy/wire): they go out with the end of the response (the chunked
terminator) in one write, not two (a turn's finish, usage and `[DONE]` are one `LastChunk`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from proxy.wire import LastChunk


class StreamedResponse(Response):
    """`StreamingResponse`'s contract for bytes bodies: status, headers, a body iterator (a `Response`
    so that FastAPI sends it as it is)."""

    def __init__(self, body: AsyncIterator[bytes] | None, *, status_code: int = 200,
                 headers: Mapping[str, str] | None = None, media_type: str | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        # None: set before the response is served (a turn's answer is built before its engine answers)
        self.chunks: AsyncIterator[bytes] = body if body is not None else _unset()
        # Runs once the body is done with, read or not: a generator never started (its client left
        # before the first chunk) runs no `finally` of its own, so what it holds is let go here.
        self.on_close = on_close
        self.background = None
        self.status_code = status_code
        self.media_type = media_type
        self.init_headers(headers)  # Starlette's own header rules (no length; text/* gets its charset)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("an ASGI app runs in a task")
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()  # lands at the await the writer is suspended in (it is, or this would not run)

        watcher = asyncio.get_running_loop().create_task(watch())
        body = self.chunks
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in body:
                if type(chunk) is LastChunk:
                    await send(_body(chunk, False))
                    break
                await send(_body(chunk, True))
            else:
                await send(_body(b"", False))
        except asyncio.CancelledError:
            if not gone:
                raise  # the server is shutting down: not ours to swallow
            task.uncancel()  # the client left: nobody reads the rest
        finally:
            watcher.cancel()
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                self.on_close()


def _body(chunk: bytes, more: bool) -> Message:
    return {"type": "http.response.body", "body": chunk, "more_body": more}


async def _unset() -> AsyncIterator[bytes]:
    raise RuntimeError("a StreamedResponse served before its body was set")
    yield b""  # (makes this an async generator)
