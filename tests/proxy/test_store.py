"""The same tests on both transcript stores: round trip, parent replacement, per-session limit, TTL,
isolation; plus the memory store's LRU bounds and file persistence."""

from __future__ import annotations

import asyncio
import uuid
from array import array
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from proxy.store import SessionStore
from proxy.store.memory import MemoryStore
from proxy.store.redis import RedisStore
from proxy.transcripts import Snapshot

pytestmark = [pytest.mark.unit, pytest.mark.asyncio(loop_scope="session")]


def snap(ids: list[int], parent: str | None = None) -> Snapshot:
    return Snapshot(
        ids=array("I", ids),
        prompt_len=max(len(ids) - 1, 0),
        msg_keys=["a", "b"],
        msg_ends=[1, 2],
        reply_key="r",
        context="c",
        finish_reason="stop",
        parent_id=parent,
    )


@pytest_asyncio.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)], loop_scope="session")
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        s: SessionStore = MemoryStore(max_sessions=8, ttl_s=0.5, per_session=3)
    else:
        url = request.getfixturevalue("redis_url")
        s = RedisStore.from_url(url, ttl_s=0.5, per_session=3)
    yield s
    await s.close()


def sid() -> str:
    return uuid.uuid4().hex


async def test_round_trip_exact(store: SessionStore) -> None:
    s = sid()
    big = list(range(0, 300_000, 3)) + [248_046, 2**31]
    await store.save(s, snap(big))
    (got,) = await store.load(s)
    assert list(got.ids) == big
    assert (got.msg_keys, got.msg_ends, got.reply_key, got.context) == (["a", "b"], [1, 2], "r", "c")


async def test_child_replaces_parent_and_limit(store: SessionStore) -> None:
    s = sid()
    first = snap([1, 2])
    await store.save(s, first)
    child = snap([1, 2, 3], parent=first.snapshot_id)
    await store.save(s, child)
    assert [x.snapshot_id for x in await store.load(s)] == [child.snapshot_id]
    others = [snap([9, i]) for i in range(4)]
    for o in others:
        await store.save(s, o)
    got = await store.load(s)
    assert [x.snapshot_id for x in got] == [o.snapshot_id for o in reversed(others)][:3]


async def test_sessions_are_isolated_and_deletable(store: SessionStore) -> None:
    a, b = sid(), sid()
    await store.save(a, snap([1]))
    assert await store.load(b) == []
    await store.delete(a)
    assert await store.load(a) == []


async def test_ttl_expires(store: SessionStore) -> None:
    s = sid()
    await store.save(s, snap([1]))
    await asyncio.sleep(0.8)
    assert await store.load(s) == []


async def test_memory_lru_bounds() -> None:
    store = MemoryStore(max_sessions=2, ttl_s=60, per_session=2, max_ids=10)
    await store.save("a", snap([1] * 4))
    await store.save("b", snap([1] * 4))
    await store.load("a")  # a is now most recent
    await store.save("c", snap([1] * 4))
    assert await store.count() == 2
    assert await store.load("b") == []
    await store.save("d", snap([1] * 8))  # over max_ids: evicts least recently used until it fits
    assert await store.load("d") and await store.count() == 1


async def test_memory_file_persistence(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "transcripts.bin"
    store = MemoryStore(ttl_s=60, path=path)
    kept = snap([5, 6, 7])
    await store.save("x", kept)
    await store.close()
    again = MemoryStore(ttl_s=60, path=path)
    (got,) = await again.load("x")
    assert list(got.ids) == [5, 6, 7] and got.snapshot_id == kept.snapshot_id
    path.write_bytes(b"garbage")
    assert await MemoryStore(path=path).count() == 0
