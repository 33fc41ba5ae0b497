"""Holding a client while its request waits for admission, without FastAPI; the same for both wires.

`hold(work, ...)` waits for the opened turn (admission + upstream open) while watching the client:
- a client that disconnects cancels the wait at once (the scheduler then drops it from the queue);
- a streaming request still queued after `after_s` is answered 200 right away with SSE comment lines
  (`: queued`, which every SSE parser skips, OpenAI's and Anthropic's alike) every `every_s`, so
  harness watchdogs that count the time to the first byte do not fire; its body then continues with the
  real stream, or with the wire's error event if the wait ends in a refusal (the status line is already
  sent by then).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from proxy.errors import ProxyError

T = TypeVar("T")
KEEPALIVE = b": queued for engine capacity\n\n"
_POLL_S = 0.25  # how often the client connection is checked while queued


class ClientGone(ProxyError):
    """The client disconnected while its request was queued; nobody reads this answer."""

    status = 499
    type = "client_closed_request"


@dataclass
class Queued(Generic[T]):
    """A streaming request still waiting: its body is keep-alives, then the real stream."""

    work: asyncio.Task[T]
    every_s: float

    async def body(self, stream: Callable[[T], AsyncIterator[bytes]],
                   refused: Callable[[ProxyError], bytes]) -> AsyncIterator[bytes]:
        """Keep-alives until admitted, then `stream(turn)`; `refused(exc)` if the wait ends in an error."""
        streaming = False
        try:
            while True:
                done, _ = await asyncio.wait({self.work}, timeout=self.every_s)
                if done:
                    break
                yield KEEPALIVE
            try:
                turn = self.work.result()
            except ProxyError as exc:
                yield refused(exc)
                return
            streaming = True
            async for chunk in stream(turn):
                yield chunk
        finally:
            # A client gone while queued: Starlette cancels this generator; take the request out too.
            if not self.work.done():
                self.work.cancel()
            elif not streaming and not self.work.cancelled() and self.work.exception() is None:
                # Admitted in the same instant the client left: run its stream's cleanup (seat, upstream)
                # in a task of its own, since this one is being cancelled.
                _spawn_drain(stream(self.work.result()))


_draining: set[asyncio.Task[None]] = set()


def _spawn_drain(body: AsyncIterator[bytes]) -> None:
    async def drain() -> None:
        agen = aiter(body)
        try:
            await anext(agen)  # start it, so that closing it runs its finally
        except StopAsyncIteration:
            return
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                await aclose()

    task = asyncio.get_running_loop().create_task(drain())
    _draining.add(task)
    task.add_done_callback(_draining.discard)


async def hold(work: Awaitable[T], *, stream: bool, is_disconnected: Callable[[], Awaitable[bool]],
               after_s: float, every_s: float) -> T | Queued[T]:
    """The opened turn, or (streams only) a `Queued` to answer with while it keeps waiting.
    Raises what `work` raises; cancels `work` and raises ClientGone if the client disconnects first."""
    task: asyncio.Task[T] = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + after_s
    try:
        while True:
            timeout = _POLL_S if not stream else max(0.0, min(_POLL_S, deadline - loop.time()))
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if done:
                return task.result()
            if await is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ClientGone("client disconnected while queued")
            if stream and loop.time() >= deadline:
                return Queued(task, every_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
