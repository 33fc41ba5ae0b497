"""Placement over several engines (proxy/routing): the policy's rules, shared state in memory and in a real
redis-server (atomic first placement with two placers at once), health checks, and the app's wiring
(engine header, metrics, failover) against two fake engines."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from proxy.admission import Footprint, Priority
from proxy.app import create_app
from proxy.ingress import Ingress, TurnRequest
from proxy.quirks import QuirkLog
from proxy.routing import Engine, EngineLoad, Health, MemoryState, PlacementRecord, RedisState, Router
from proxy.routing.policy import Placement, rendezvous
from proxy.routing.prefix import block_hashes, overlap_blocks
from proxy.scheduler import PoolGeometry, Scheduler
from proxy.settings import EngineGeometry, RoutingConfig, SchedulerConfig, Settings, UpstreamConfig
from proxy.upstream import Upstream
from tests.proxy.fake_format import ToyFormat
from tests.proxy.fake_vllm import FakeVLLM, free_port, serve_app

pytestmark = [pytest.mark.unit, pytest.mark.asyncio(loop_scope="session")]

CFG = RoutingConfig(prefix_block_tokens=16, move_after_wait_s=0.05, health_timeout_s=0.5)
INGRESS = Ingress(QuirkLog(CollectorRegistry()))


def turn(session: str, parent: str | None = None) -> TurnRequest:
    headers = {"x-session-id": session} | ({"x-parent-session-id": parent} if parent else {})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return INGRESS.openai(body, headers, max_model_len=4096)


class Health200:
    """A /health endpoint that can be switched off and on (an engine that dies and comes back)."""

    def __init__(self) -> None:
        self.ok = True
        self.server: TestServer | None = None

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.ok else 503)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self._health)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")


async def fleet(n: int = 2, url: str = "http://127.0.0.1:9", seats: int = 2) -> list[Engine]:
    engines = []
    for i in range(n):
        sched = Scheduler(SchedulerConfig(), engine=EngineGeometry(seats=seats),
                          geometry=PoolGeometry(num_blocks=1000, block_size=16))
        engines.append(Engine(UpstreamConfig(name=f"e{i}", url=url), Upstream.open(url), sched, sched))
    return engines


async def hold(engine: Engine, n: int, priority: Priority = Priority.INTERACTIVE) -> list[Any]:
    assert engine.scheduler is not None
    return [await engine.scheduler.acquire(Footprint(f"load{i}", 32, 32, 0, priority)) for i in range(n)]


async def place(router: Router, req: TurnRequest, prompt: list[int]) -> Placement:
    """A placement whose turn asks for admission at once (as `Turn.open` does): from then on the
    engine's scheduler, not its `Placing`, counts it."""
    p = await router.place(req, prompt)
    p.placed()
    return p


def value(router: Router, name: str, **labels: str) -> float:
    for metric in (router.metrics.placements, router.metrics.moves, router.metrics.reprefill,
                   router.metrics.engine_up):
        for fam in metric.collect():
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
    return 0.0


async def close(engines: list[Engine]) -> None:
    for e in engines:
        await e.upstream.close()


async def test_prefix_overlap_is_exact_in_blocks() -> None:
    ids = list(range(200))
    full = block_hashes(ids, 16)
    assert len(full) // 8 == 12  # full blocks only
    assert block_hashes(ids, 16, block_hashes(ids[:100], 16)) == full  # extending = hashing afresh
    changed = [*ids[:100], 7, *ids[101:]]
    assert overlap_blocks(full, block_hashes(changed, 16)) == 100 // 16
    assert overlap_blocks(full, block_hashes(ids + [1] * 40, 16)) == 12


async def test_new_session_hashes_then_sticks_and_spills_past_the_bound() -> None:
    engines = await fleet()
    router = Router(engines, state=MemoryState(ttl_s=60), config=CFG)
    first = await place(router, turn("s1"), list(range(40)))
    assert first.reason == "hash"
    again = await place(router, turn("s1"), list(range(90)))
    assert (again.engine, again.reason, again.reprefill_tokens) == (first.engine, "sticky", 0)
    # a new session whose hash engine would carry more than 1.25x the average load spills to the least loaded
    target = rendezvous(turn("new").session.key, engines)[0]
    await hold(target, 2)
    spilled = await place(router, turn("new"), [1, 2])
    assert spilled.reason == "spill" and spilled.engine is not target
    placed = [await place(router, turn(f"n{i}"), [i]) for i in range(8)]
    assert not any(p.engine is target for p in placed)  # 3 on it vs 0 + 1 elsewhere: over the bound
    await close(engines)


async def test_subagent_goes_with_its_parent_while_it_has_a_seat() -> None:
    engines = await fleet(seats=2)
    router = Router(engines, state=MemoryState(ttl_s=60), config=CFG)
    home = (await place(router, turn("parent"), list(range(64)))).engine
    child = await place(router, turn("child-1", parent="parent"), list(range(20)))
    assert (child.engine, child.reason) == (home, "parent")
    await hold(home, 2)  # both seats taken: the next subagent goes where it fits
    late = await place(router, turn("child-2", parent="parent"), list(range(20)))
    assert late.reason == "least_loaded" and late.engine is not home
    await close(engines)


async def test_a_burst_placed_in_one_instant_spreads_before_any_admission() -> None:
    """Three children and three new sessions placed before any of them reached admission (a fan-out
    arriving at once): each placement counts on its engine, so they do not all read the same idle fleet."""
    engines = await fleet(seats=8)
    router = Router(engines, state=MemoryState(ttl_s=60), config=CFG)
    parent = await place(router, turn("parent"), list(range(64)))
    burst = [await router.place(turn(f"kid{i}", parent="parent"), list(range(20))) for i in range(3)]
    burst += [await router.place(turn(f"new{i}"), [i]) for i in range(3)]
    on = [sum(p.engine is e for p in burst) for e in engines]
    assert on == [3, 3], on
    assert engines[0].local_load().queued + engines[1].local_load().queued == 6
    for p in burst:
        p.placed()
    assert engines[0].local_load().queued + engines[1].local_load().queued == 0
    assert parent.engine in {p.engine for p in burst if p.reason == "parent"}
    await close(engines)


async def test_move_only_when_drained_or_saturated_counted_with_reprefill(caplog: pytest.LogCaptureFixture) -> None:
    engines = await fleet()
    router = Router(engines, state=MemoryState(ttl_s=60), config=CFG)
    prompt = list(range(100))
    p1 = await place(router, turn("s"), prompt)
    await router.sent(turn("s").session.key, p1, prompt + [500 + i for i in range(30)])  # prompt + reply held
    old = p1.engine
    old.health = Health.DRAINING
    caplog.set_level(logging.INFO, "proxy.routing")
    moved = await place(router, turn("s"), prompt + [500 + i for i in range(30)] + [9] * 20)
    assert moved.reason == "moved" and moved.engine is not old
    assert moved.reprefill_tokens == 130 // 16 * 16  # exactly what the old engine held, in blocks
    assert value(router, "hh_session_moves_total", from_engine=old.name, to_engine=moved.engine.name) == 1
    assert value(router, "hh_moved_reprefill_tokens_total", engine=moved.engine.name) == moved.reprefill_tokens
    line = caplog.records[-1].getMessage()
    assert re.fullmatch(rf"placement session=[0-9a-f]{{8}} parent=- engine={moved.engine.name} reason=moved "
                        rf"reprefill={moved.reprefill_tokens}", line), line
    # saturated: its queue made a request wait past the bound while the other engine has room
    old.health = Health.UP
    back = await place(router, turn("s"), [1])
    assert back.reason == "sticky"
    sat = back.engine
    await hold(sat, 2)
    assert sat.scheduler is not None
    waiting = asyncio.create_task(sat.scheduler.acquire(Footprint("w", 32, 32, 0)))
    await asyncio.sleep(0.1)
    away = await place(router, turn("s"), [1])
    assert away.reason == "moved" and away.engine is not sat
    waiting.cancel()
    await close(engines)


async def test_health_drains_a_failing_engine_and_a_recovered_one_takes_new_sessions() -> None:
    health = Health200()
    url = await health.start()
    engines = await fleet(url=url)
    router = Router(engines, state=MemoryState(ttl_s=60), config=CFG.model_copy(update={"failures_to_drain": 2}))
    sick = engines[0]
    health.ok = False
    assert not await router.check(sick)
    assert sick.health is Health.UP  # one failure is not yet a drain
    await router.check(sick)
    assert sick.health is Health.DRAINING and value(router, "hh_engine_up", engine=sick.name) == 0
    placed = [await place(router, turn(f"d{i}"), [i]) for i in range(10)]
    assert all(p.engine is engines[1] for p in placed)
    health.ok = True
    await router.check(sick)
    assert sick.live and value(router, "hh_engine_up", engine=sick.name) == 1
    placed = [await place(router, turn(f"r{i}"), [i]) for i in range(10)]
    assert any(p.engine is sick for p in placed)
    # a turn that broke on its engine: the next placement checks it at once instead of sticking to it
    home = (await place(router, turn("r0"), [0])).engine
    health.ok = home is not sick
    if home is sick:
        router.failed(sick)
        nxt = await place(router, turn("r0"), [0])
        assert nxt.reason == "moved" and nxt.engine is not sick
    assert health.server is not None
    await health.server.close()
    await close(engines)


async def test_redis_first_placement_is_atomic_and_ttl_refreshed(redis_url: str) -> None:
    engines = await fleet()
    a = RedisState.from_url(redis_url, ttl_s=30)
    b = RedisState.from_url(redis_url, ttl_s=30)
    rec_a, rec_b = PlacementRecord("e0", 10, b"x" * 8), PlacementRecord("e1", 10, b"y" * 8)
    got = await asyncio.gather(a.claim("h:race", rec_a), b.claim("h:race", rec_b))
    assert got[0] == got[1]
    # two replicas whose round-robin counters point at different engines place one new session at once
    ra = Router(engines, state=a, config=CFG, policy="round_robin")
    rb = Router(engines, state=b, config=CFG, policy="round_robin")
    await rb.place(turn("warm"), [1])  # b's counter is one ahead of a's
    pa, pb = await asyncio.gather(ra.place(turn("both"), [1, 2]), rb.place(turn("both"), [1, 2]))
    assert pa.engine is pb.engine
    # TTL refreshed on use
    client = aioredis.from_url(redis_url)
    await client.pexpire("hh:p:h:both", 1000)
    assert await a.get("h:both") is not None
    assert await client.pttl("hh:p:h:both") > 20_000
    # each replica's admitted load is summed by the others; its own figure is the live one
    await a.publish_load({"e0": EngineLoad(running=3, seats=4)})
    seen = await b.loads({"e0": EngineLoad(running=1, seats=4), "e1": EngineLoad()})
    assert seen["e0"].running == 4 and seen["e1"].running == 0
    await client.aclose()
    await a.close()
    await b.close()
    await close(engines)


async def two_fake_engines(health_period_s: float) -> tuple[list[TestServer], Settings]:
    """Two fake vLLM servers, gpu0 and gpu1, and the proxy settings that list them."""
    servers = [TestServer(FakeVLLM().app(), host="127.0.0.1") for _ in range(2)]
    for s in servers:
        await s.start_server()
    ups = tuple(UpstreamConfig(name=f"gpu{i}", url=str(s.make_url("")).rstrip("/")) for i, s in enumerate(servers))
    return servers, Settings(upstreams=ups, model_name="m", routing=RoutingConfig(health_period_s=health_period_s))


async def test_app_names_the_engine_and_fails_over() -> None:
    servers, settings = await two_fake_engines(health_period_s=0.2)
    msgs = [{"role": "user", "content": "hello"}]
    hdr = {"x-session-id": "sess-1"}
    async with serve_app(create_app(settings, fmt=ToyFormat())) as url, httpx.AsyncClient(base_url=url) as c:
        r1 = await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "stream": True}, headers=hdr)
        home = r1.headers["x-hyperharness-engine"]
        msgs += [{"role": "assistant", "content": "abc"}, {"role": "user", "content": "more"}]
        r2 = await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs}, headers=hdr)
        assert r2.status_code == 200 and r2.headers["x-hyperharness-engine"] == home
        r3 = await c.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "hello"}]}, headers={"x-session-id": "sess-2"})
        assert r3.status_code == 200 and r3.headers["x-hyperharness-engine"] in ("gpu0", "gpu1")
        i = int(home[-1])
        await servers[i].close()  # the session's engine dies
        await asyncio.sleep(1.0)  # drained by the periodic checks
        assert (await c.get("/health")).json()["engines"][home] != "up"
        msgs += [{"role": "assistant", "content": "abc"}, {"role": "user", "content": "again"}]
        r4 = await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs}, headers=hdr)
        assert r4.status_code == 200 and r4.headers["x-hyperharness-engine"] != home
        text = (await c.get("/metrics")).text
        assert f'hh_engine_up{{engine="{home}"}} 0.0' in text
        to = r4.headers["x-hyperharness-engine"]
        assert f'hh_session_moves_total{{from_engine="{home}",to_engine="{to}"}} 1.0' in text
        assert 'hh_placements_total{engine="' in text and "sess-1" not in text
    await servers[1 - i].close()


async def test_one_engine_still_places_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    engines = await fleet(n=1)
    router = Router(engines, state=MemoryState(ttl_s=60), config=CFG)
    caplog.set_level(logging.INFO, "proxy.routing")
    reasons = [(await place(router, turn(s, parent=p), list(range(300)))).reason
               for s, p in (("main", None), ("main", None), ("kid", "main"))]
    # one engine: no policy runs (nothing to choose, no record kept), every turn is placed and logged
    assert reasons == ["only", "only", "only"]
    assert [r.getMessage().split()[4] for r in caplog.records] == ["reason=only"] * 3
    await close(engines)


async def test_redis_down_places_by_hash_instead_of_failing() -> None:
    engines = await fleet()
    state = RedisState.from_url(f"redis://127.0.0.1:{free_port()}/0", ttl_s=30)  # nothing listens there
    router = Router(engines, state=state, config=CFG)
    p = await place(router, turn("lost"), list(range(40)))
    assert p.reason == "hash" and p.engine is rendezvous(turn("lost").session.key, engines)[0]
    await router.sent(turn("lost").session.key, p, list(range(50)))  # a finished turn is not failed for it
    await state.close()
    await close(engines)


async def test_unreachable_engine_before_any_health_check_moves_the_turn() -> None:
    """Another replica saw the engine die; this one has not checked it yet (long health period). The
    connection is refused, nothing reached the engine, so the turn is placed once more and succeeds."""
    servers, settings = await two_fake_engines(health_period_s=3600)
    msgs = [{"role": "user", "content": "hello"}]
    hdr = {"x-session-id": "sess-u"}
    async with serve_app(create_app(settings, fmt=ToyFormat())) as url, httpx.AsyncClient(base_url=url) as c:
        r1 = await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs}, headers=hdr)
        home = r1.headers["x-hyperharness-engine"]
        i = int(home[-1])
        await servers[i].close()  # gone: no periodic check will notice within this test
        msgs += [{"role": "assistant", "content": "abc"}, {"role": "user", "content": "more"}]
        for stream in (False, True):
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "stream": stream},
                             headers=hdr)
            assert r.status_code == 200, r.text
            assert r.headers["x-hyperharness-engine"] == f"gpu{1 - i}"
            assert "error" not in r.text
    await servers[1 - i].close()


async def test_memory_state_is_bounded_by_the_bytes_of_its_block_chains() -> None:
    """Placements of sessions that never come back must not grow the proxy (the soak saw +600 bytes per
    request while the bound was 65,536 sessions of any length)."""
    state = MemoryState(ttl_s=60, max_sessions=100, max_bytes=10_000)
    for i in range(50):
        await state.put(f"s{i}", PlacementRecord("engine-0", 1000, bytes(1000)))
    assert await state.get("s0") is None and await state.get("s39") is None  # oldest first
    assert await state.get("s49") is not None and await state.get("s40") is not None
    for i in range(200):
        await state.put(f"t{i}", PlacementRecord("engine-0", 10))
    assert await state.get("t99") is None and await state.get("t199") is not None
