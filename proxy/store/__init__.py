"""Transcript stores behind one interface: `MemoryStore` (embedded, bounded LRU, TTL, optional file
persistence) and `RedisStore` (redis.asyncio), served behind `FallbackStore` (what happens while Redis
is down: fallback.py). A session holds at most `per_session` snapshots; saving
one drops its parent (which it extends) and then the oldest beyond the limit."""

from __future__ import annotations

from typing import Literal, Protocol

from proxy.transcripts import Snapshot


class SessionStore(Protocol):
    async def load(self, session: str) -> list[Snapshot]:
        """The session's snapshots, newest first; refreshes the TTL."""
        ...

    async def save(self, session: str, snapshot: Snapshot) -> None:
        """Add `snapshot`, drop `snapshot.parent_id` if present, keep the newest `per_session`."""
        ...

    async def delete(self, session: str) -> None: ...

    async def count(self) -> int:
        """Sessions held (approximate for Redis)."""
        ...

    async def close(self) -> None: ...


def make_store(
    redis_url: str | None, *, max_sessions: int, ttl_s: float, per_session: int, path: str | None = None,
    outage: Literal["fallback", "refuse"] = "fallback", timeout_s: float = 1.0,
) -> SessionStore:
    """The embedded store, or Redis behind `FallbackStore` with the configured outage behaviour (an
    embedded store of the same bounds holds what is written while Redis is down)."""
    from proxy.store.memory import MemoryStore

    if redis_url:
        from proxy.store.fallback import FallbackStore
        from proxy.store.redis import RedisStore

        redis = RedisStore.from_url(redis_url, ttl_s=ttl_s, per_session=per_session, timeout_s=timeout_s)
        memory = MemoryStore(max_sessions=max_sessions, ttl_s=ttl_s, per_session=per_session)
        return FallbackStore(redis, memory, outage=outage, probe_s=timeout_s)

    return MemoryStore(max_sessions=max_sessions, ttl_s=ttl_s, per_session=per_session, path=path)


__all__ = ["SessionStore", "make_store"]
