"""Redis with a defined outage behaviour (`Settings.redis_outage`): what the proxy does while Redis is down.

    fallback (default)  transcripts go to an embedded `MemoryStore` while Redis is unreachable; each
                        session written there is marked dirty and written back to Redis (oldest snapshot
                        first, so Redis' parent replacement runs as it would have) as soon as a probe
                        finds Redis again; until then a dirty session is read from memory (it is newer).
    refuse              every store call while Redis is down raises `StoreUnavailable` (503 +
                        Retry-After): nothing is written anywhere, the client retries.

Why fallback by default: a transcript is an optimisation, not the conversation (the harness resends
every message each turn; a turn without its snapshot is rendered fresh and only costs a re-prefill),
so an agent should keep working through a Redis restart. `refuse` is for deployments where several
proxies share Redis and a snapshot held in one proxy's memory would be invisible to the others.

A stopped (SIGSTOP) Redis accepts connections and never answers: every call is bounded by the client's
socket timeout (`redis_timeout_s`) and made without retries, and while Redis is down it is probed at
most once per `probe_s`, so a request waits at most one timeout for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

from redis.exceptions import RedisError

from proxy.errors import ProxyError
from proxy.store.memory import MemoryStore
from proxy.store.redis import RedisStore
from proxy.transcripts import Snapshot

log = logging.getLogger("proxy.store")
T = TypeVar("T")
Outage = Literal["fallback", "refuse"]
# What an unreachable, stopped or restarting Redis raises (redis-py wraps most socket errors itself).
_DOWN = (RedisError, OSError, asyncio.TimeoutError)


class StoreUnavailable(ProxyError):
    """The transcript store is down and configured to refuse (redis_outage="refuse")."""

    status = 503
    type = "server_error"
    code = "store_unavailable"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.headers = {"retry-after": str(retry_after_s)}


class FallbackStore:
    """`SessionStore` over Redis with the outage behaviour above. `down` tells whether Redis is
    currently considered unreachable; `dirty` the sessions held only in memory."""

    def __init__(self, redis: RedisStore, memory: MemoryStore, *, outage: Outage = "fallback",
                 probe_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self.memory = memory
        self.outage = outage
        self.probe_s = probe_s
        self._clock = clock
        self.down = False
        self._next_probe = 0.0
        self.dirty: set[str] = set()
        self.deleted: set[str] = set()  # deleted during the outage
        self._recovering = asyncio.Lock()
        self.outages = 0  # times Redis went down (tests, logs)
        self.written_back = 0  # sessions written back after an outage

    async def _try(self, call: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """(True, result) from Redis, or (False, None) when it is down (marked so on this failure)."""
        if self.down:
            return False, None
        try:
            return True, await call()
        except _DOWN as exc:
            self._mark_down(exc)
            return False, None

    def _mark_down(self, exc: BaseException) -> None:
        if not self.down:
            self.outages += 1
            log.warning("transcript store: Redis unreachable (%s: %s); %s", type(exc).__name__, exc,
                        "keeping transcripts in memory until it is back" if self.outage == "fallback"
                        else "refusing requests with 503 until it is back")
        self.down = True
        self._next_probe = self._clock() + self.probe_s

    async def _recover(self) -> bool:
        """While down: at most one probe per `probe_s`; when Redis answers, write the dirty sessions back
        (all of them, before anything else reads Redis) and mark it up."""
        if not self.down:
            return True
        if self._clock() < self._next_probe:
            return False
        async with self._recovering:
            if not self.down:
                return True
            try:
                await self.redis.ping()
                for session in sorted(self.deleted):
                    await self.redis.delete(session)
                    self.deleted.discard(session)
                while self.dirty:
                    session = min(self.dirty)
                    snaps = await self.memory.load(session)
                    for snap in reversed(snaps):  # oldest first
                        await self.redis.save(session, snap)
                    # A turn that ended during these awaits went to memory (still down): write again.
                    if [s.snapshot_id for s in await self.memory.load(session)] == [s.snapshot_id for s in snaps]:
                        await self.memory.delete(session)
                        self.dirty.discard(session)
                        self.written_back += 1
            except _DOWN as exc:
                self._next_probe = self._clock() + self.probe_s
                log.debug("transcript store: Redis still down: %s", exc)
                return False
            self.down = False
            log.warning("transcript store: Redis is back; %d sessions written back", self.written_back)
            return True

    def _refuse(self) -> StoreUnavailable:
        return StoreUnavailable("the transcript store (Redis) is unreachable; retry shortly",
                                max(1, round(self.probe_s)))

    async def load(self, session: str) -> list[Snapshot]:
        await self._recover()
        if session in self.dirty:  # written during the outage: memory holds the newest
            return await self.memory.load(session)
        ok, got = await self._try(lambda: self.redis.load(session))
        if ok:
            return got or []
        if self.outage == "refuse":
            raise self._refuse()
        return []  # Redis' copy is out of reach: the turn is rendered fresh (a re-prefill, nothing wrong)

    async def save(self, session: str, snapshot: Snapshot) -> None:
        await self._recover()
        if session not in self.dirty:
            ok, _ = await self._try(lambda: self.redis.save(session, snapshot))
            if ok:
                return
        if self.outage == "refuse":
            raise self._refuse()
        self.dirty.add(session)
        await self.memory.save(session, snapshot)

    async def delete(self, session: str) -> None:
        await self._recover()
        self.dirty.discard(session)
        await self.memory.delete(session)
        ok, _ = await self._try(lambda: self.redis.delete(session))
        if not ok:
            if self.outage == "refuse":
                raise self._refuse()
            self.deleted.add(session)  # deleted in Redis too once it is back

    async def count(self) -> int:
        ok, n = await self._try(self.redis.count)
        return (n or 0) + len(self.dirty) if ok else await self.memory.count()

    async def close(self) -> None:
        if self.down:
            await self._recover_now()
        await self.memory.close()
        await self.redis.close()

    async def _recover_now(self) -> None:
        self._next_probe = 0.0
        if not await self._recover():
            log.warning("transcript store: Redis still down at shutdown; %d sessions held only in memory are "
                        "lost", len(self.dirty))


__all__ = ["FallbackStore", "Outage", "StoreUnavailable"]
