"""Transcripts in Redis (redis.asyncio), shared by proxy workers and kept across restarts.

Layout per session: one hash `hh:t:{session}`, field = snapshot id (time-ordered hex), value = packed
snapshot. Saving is one pipelined round trip (HSET new, HDEL parent, HKEYS, EXPIRE) plus an HDEL of
the oldest when over the per-session limit. TTL bounds growth; Redis' maxmemory policy bounds the rest.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from proxy.transcripts import Snapshot

_PREFIX = "hh:t:"


class RedisStore:
    def __init__(self, client: Any, *, ttl_s: float = 6 * 3600, per_session: int = 4) -> None:
        if per_session < 1 or ttl_s <= 0:
            raise ValueError(f"bad store bounds: per_session={per_session} ttl_s={ttl_s}")
        self.client = client
        self.ttl_ms = int(ttl_s * 1000)
        self.per_session = per_session

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float = 6 * 3600, per_session: int = 4,
                 timeout_s: float | None = None) -> RedisStore:
        """`timeout_s` bounds every call (connect and each reply) and turns redis-py's retries off, so a
        stopped Redis fails a call in `timeout_s` instead of hanging the turn (proxy/store/fallback.py)."""
        if timeout_s is None:
            return cls(aioredis.from_url(url, decode_responses=False), ttl_s=ttl_s, per_session=per_session)
        client = aioredis.from_url(url, decode_responses=False, socket_timeout=timeout_s,
                                   socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        return cls(client, ttl_s=ttl_s, per_session=per_session)

    async def ping(self) -> None:
        await self.client.ping()

    async def load(self, session: str) -> list[Snapshot]:
        key = _PREFIX + session
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(key)
            pipe.pexpire(key, self.ttl_ms)
            blobs, _ = await pipe.execute()
        ordered = sorted(blobs.items(), key=lambda kv: kv[0], reverse=True)
        return [Snapshot.from_bytes(blob) for _, blob in ordered]

    async def save(self, session: str, snapshot: Snapshot) -> None:
        key = _PREFIX + session
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, snapshot.snapshot_id, snapshot.to_bytes())
            if snapshot.parent_id:
                pipe.hdel(key, snapshot.parent_id)
            pipe.hkeys(key)
            pipe.pexpire(key, self.ttl_ms)
            results = await pipe.execute()
        fields = sorted(results[-2], reverse=True)
        stale = fields[self.per_session :]
        if stale:
            await self.client.hdel(key, *stale)

    async def delete(self, session: str) -> None:
        await self.client.delete(_PREFIX + session)

    async def count(self) -> int:
        n = 0
        async for _ in self.client.scan_iter(match=_PREFIX + "*", count=1000):
            n += 1
        return n

    async def close(self) -> None:
        await self.client.aclose()
