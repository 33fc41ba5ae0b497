"""Transcript stores behind one interface: `MemoryStore` (embedded, bounded LRU, TTL, optional file
persistence) and `RedisStore` (redis.asyncio). A session holds at most `per_session` snapshots; saving
one drops its parent (which it extends) and then the oldest beyond the limit."""

from __future__ import annotations

from typing import Protocol

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
    redis_url: str | None, *, max_sessions: int, ttl_s: float, per_session: int, path: str | None = None
) -> SessionStore:
    if redis_url:
        from proxy.store.redis import RedisStore

        return RedisStore.from_url(redis_url, ttl_s=ttl_s, per_session=per_session)
    from proxy.store.memory import MemoryStore

    return MemoryStore(max_sessions=max_sessions, ttl_s=ttl_s, per_session=per_session, path=path)


__all__ = ["SessionStore", "make_store"]
