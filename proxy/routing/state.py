"""Placements (session -> engine + what that engine was last sent) and per-engine load, shared by the
proxy replicas.

`MemoryState` is the single-replica default (`make serve` needs no Redis). `RedisState` lets several
replicas agree: a session's first placement is `SET NX` (two replicas placing one new session at once
both end on the winner's engine), every read refreshes the TTL (`GETEX`), and each replica publishes its
own admitted load per engine into a hash the others sum (stale entries of a dead replica are ignored).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .engine import EngineLoad

_PLACE = "hh:p:"
_LOAD = "hh:l:"


class StateUnavailable(RuntimeError):
    """The shared state cannot be reached (Redis down): the router places without it meanwhile."""


@dataclass(frozen=True, slots=True)
class PlacementRecord:
    engine: str
    sent_tokens: int  # tokens the engine was last sent for the session (prompt, then prompt + reply)
    hashes: bytes = b""  # their block chain (proxy/routing/prefix.py)

    def to_bytes(self) -> bytes:
        head = json.dumps({"e": self.engine, "n": self.sent_tokens}, separators=(",", ":")).encode()
        return head + b"\n" + self.hashes

    @classmethod
    def from_bytes(cls, data: bytes) -> PlacementRecord:
        head, _, hashes = data.partition(b"\n")
        meta = json.loads(head)
        return cls(str(meta["e"]), int(meta["n"]), hashes)


class RoutingState(Protocol):
    async def get(self, session: str) -> PlacementRecord | None:
        """The session's placement, refreshing its TTL; None for a session never placed (or expired)."""
        ...

    async def claim(self, session: str, record: PlacementRecord) -> PlacementRecord:
        """Place a new session unless another placer did first; returns the placement that holds."""
        ...

    async def put(self, session: str, record: PlacementRecord) -> None: ...

    async def publish_load(self, loads: dict[str, EngineLoad]) -> None:
        """This replica's own admitted load per engine."""
        ...

    async def loads(self, local: dict[str, EngineLoad]) -> dict[str, EngineLoad]:
        """Per engine: this replica's `local` load plus what the other live replicas published."""
        ...

    async def close(self) -> None: ...


class MemoryState:
    """In-process placements, LRU-bounded by count and by the bytes of their block chains (a 100K-token
    session's chain is 50 KB: a count bound alone let the soak's proxy grow 600 bytes per request), with
    the same TTL rule as the Redis state."""

    def __init__(self, *, ttl_s: float, max_sessions: int = 4096, max_bytes: int = 32 * 1024 * 1024) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, tuple[float, PlacementRecord]] = OrderedDict()
        self._bytes = 0

    async def get(self, session: str) -> PlacementRecord | None:
        item = self._records.get(session)
        if item is None:
            return None
        if item[0] < time.monotonic():
            self._drop(session)
            return None
        await self.put(session, item[1])
        return item[1]

    async def claim(self, session: str, record: PlacementRecord) -> PlacementRecord:
        held = await self.get(session)
        if held is not None:
            return held
        await self.put(session, record)
        return record

    async def put(self, session: str, record: PlacementRecord) -> None:
        self._drop(session)
        now = time.monotonic()
        self._records[session] = (now + self.ttl_s, record)
        self._bytes += len(record.hashes)
        # Every use re-inserts at the end with a fresh expiry: the head is the oldest, and the expired.
        records = self._records
        while records and (len(records) > self.max_sessions or self._bytes > self.max_bytes
                           or next(iter(records.values()))[0] < now):
            self._drop(next(iter(records)))

    def _drop(self, session: str) -> None:
        item = self._records.pop(session, None)
        if item is not None:
            self._bytes -= len(item[1].hashes)

    async def publish_load(self, loads: dict[str, EngineLoad]) -> None:
        return None

    async def loads(self, local: dict[str, EngineLoad]) -> dict[str, EngineLoad]:
        return dict(local)

    async def close(self) -> None:
        return None


class RedisState:
    """Placements and loads in Redis, shared by every replica that names the same Redis."""

    def __init__(self, client: Any, *, ttl_s: float, stale_s: float = 10.0, replica: str | None = None) -> None:
        self.client = client
        self.ttl_ms = int(ttl_s * 1000)
        self.stale_s = stale_s  # a replica that has not published for this long counts for nothing
        self.replica = replica or uuid.uuid4().hex[:12]

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float, stale_s: float = 10.0) -> RedisState:
        import redis.asyncio as aioredis

        return cls(aioredis.from_url(url, decode_responses=False), ttl_s=ttl_s, stale_s=stale_s)

    async def get(self, session: str) -> PlacementRecord | None:
        data = await self._call(self.client.getex(_PLACE + session, px=self.ttl_ms))
        return None if data is None else PlacementRecord.from_bytes(data)

    async def claim(self, session: str, record: PlacementRecord) -> PlacementRecord:
        key = _PLACE + session
        if await self._call(self.client.set(key, record.to_bytes(), nx=True, px=self.ttl_ms)):
            return record
        held = await self.get(session)
        if held is None:  # expired in between: ours now
            await self.put(session, record)
            return record
        return held

    async def put(self, session: str, record: PlacementRecord) -> None:
        await self._call(self.client.set(_PLACE + session, record.to_bytes(), px=self.ttl_ms))

    @staticmethod
    async def _call(pending: Awaitable[Any]) -> Any:
        from redis.exceptions import RedisError

        try:
            return await pending
        except (RedisError, OSError) as exc:
            raise StateUnavailable(f"routing state unavailable: {exc}") from exc

    async def publish_load(self, loads: dict[str, EngineLoad]) -> None:
        now = time.time()
        async with self.client.pipeline(transaction=False) as pipe:
            for engine, load in loads.items():
                pipe.hset(_LOAD + engine, self.replica, json.dumps([now, *load.to_list()]))
                pipe.pexpire(_LOAD + engine, self.ttl_ms)
            await pipe.execute()

    async def loads(self, local: dict[str, EngineLoad]) -> dict[str, EngineLoad]:
        names = list(local)
        async with self.client.pipeline(transaction=False) as pipe:
            for engine in names:
                pipe.hgetall(_LOAD + engine)
            published = await self._call(pipe.execute())
        now = time.time()
        out = {}
        for engine, entries in zip(names, published, strict=True):
            total = local[engine]
            for replica, blob in _items(entries):
                if replica == self.replica:
                    continue  # our own figure is the live one
                value = json.loads(blob)
                if now - float(value[0]) <= self.stale_s:
                    total = total.plus(EngineLoad.from_list(value[1:]))
            out[engine] = total
        return out

    async def close(self) -> None:
        await self.client.aclose()


def _items(entries: dict[bytes, bytes]) -> Iterable[tuple[str, bytes]]:
    for k, v in entries.items():
        yield (k.decode() if isinstance(k, bytes) else str(k)), v


def make_state(redis_url: str | None, *, ttl_s: float, stale_s: float = 10.0) -> RoutingState:
    if redis_url:
        return RedisState.from_url(redis_url, ttl_s=ttl_s, stale_s=stale_s)
    return MemoryState(ttl_s=ttl_s)
