"""The admission scheduler: a request starts only when a seat and its worst case in the pool are free.

`Scheduler` implements proxy/admission.py's seam (`acquire(footprint) -> Ticket`). It owns the
admitted set (private block counts, the shared-prefix index, seats per class and session) and the
waiting room (`AdmissionQueue`); `PoolReader`-style refresh keeps the engine's geometry and gauges.
Check before change: `can_admit(w)` then `_admit(w)`; everything that frees capacity calls `_pump()`.

Policy:
- classes in strict order (interactive > subagent > background); room in the pool and seats is kept
  for interactive requests, sized from their observed peak (reserve.py), as headroom beyond what they
  hold now, so the main agent starts promptly during a subagent burst without idling a fixed share;
- footprints count the prompt blocks the engine will find cached once (footprint.py): those of
  running requests that produced a token, and those of requests that just ended;
- a request that does not fit the pool with every admitted request at its worst case at once may still
  start if it fits at every future step: generating requests end within their tokens left and cannot
  write their output faster than 1 + spec_tokens a step (`_fits_over_time`; tickets report progress);
- a request bigger than its class's share starts alone, when nothing else of ours runs;
- backfill: while the head cannot fit, a *short* request behind it (small against the pool or against
  the head) that fits the gap may start (background work only while no interactive request runs),
  but only during the first `backfill_bound_s` of the head's wait, which bounds how long the head is
  passed over; after that the pool drains until the head fits;
- queue longer than `max_queue` -> 429, waited longer than the class's `max_wait_s` -> 503, both
  with Retry-After from the recent mean hold time; a caller cancelled while queued leaves at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from prometheus_client import CollectorRegistry

from proxy.admission import Footprint, OpenTicket, Priority, Ticket
from proxy.settings import EngineGeometry, SchedulerConfig

from .errors import QueueFull, QueueTimeout
from .footprint import PrefixIndex, PromptChains, RecentPrefixes, worst_case_blocks
from .metrics import SchedulerMetrics
from .pool import LiveGauges, PoolGeometry, read_metrics
from .queue import AdmissionQueue, Waiter
from .reserve import DemandReserve, Reserve

log = logging.getLogger("proxy.scheduler")


@dataclass(eq=False, slots=True)
class SeatTicket:
    """One admitted request's hold on a seat and on pool blocks; `release()` is idempotent."""

    scheduler: Scheduler
    session: str
    priority: Priority
    private_blocks: int
    hashes: tuple[bytes, ...]  # all shareable prompt blocks
    shared: list[bytes]  # blocks counted in the shared index on this ticket's behalf
    admitted_at: float
    released: bool = False
    materialized: bool = False
    backfilled: bool = field(default=False)
    added: int = 0  # blocks this ticket added to the admitted total when it started (its demand)
    out_tokens: int = 0  # the most it may generate
    generated: int = 0  # what the engine has produced so far (0: still prefilling)

    def prefilled(self) -> None:
        """The engine produced a token: this prompt's blocks are computed and can be shared."""
        self.scheduler._materialize(self)

    def progress(self, generated: int) -> None:
        before, self.generated = self.generated, generated
        self.scheduler._progressed(self, before)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.scheduler._release(self)


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None,
                 registry: CollectorRegistry | SchedulerMetrics | None = None, *,
                 engine: EngineGeometry | None = None, geometry: PoolGeometry | None = None,
                 read_metrics_text: Callable[[], Awaitable[str]] | None = None, name: str = "engine-0") -> None:
        self.config = config or SchedulerConfig()
        self.engine = engine or EngineGeometry()  # the runtime config's facts: seats, state pages, spec tokens
        # `registry`: the app's families (several engines share them) or a registry to register them in
        family = (registry if isinstance(registry, SchedulerMetrics)
                  else SchedulerMetrics(registry or CollectorRegistry()))
        self.metrics = family.bind(name)  # this engine's children, resolved once
        self.geometry = geometry
        self.live = LiveGauges()
        self._read = read_metrics_text
        self.queue = AdmissionQueue()
        self._prefix = PrefixIndex()
        self._chains = PromptChains()  # each session's last prompt chain: a turn hashes its new blocks only
        self._private = 0  # blocks held by admitted requests outside the shared index
        self._running: dict[str, int] = {}  # session -> admitted requests
        self._live: set[SeatTicket] = set()  # the admitted tickets (their progress bounds the future)
        self._by_class = [0 for _ in Priority]
        self._interactive_blocks = 0  # what running interactive requests added (their held demand)
        self._admitted_total = 0  # blocks admitted since start: the clock of vLLM's free-queue evictions
        cfg = self.config
        self.reserve = DemandReserve(cfg.reserve_fraction, cfg.reserve_seats, cfg.reserve_window_s,
                                     cfg.reserve_max_fraction)
        self._recent = RecentPrefixes(geometry.num_blocks if geometry else 0, cfg.prefix_recent_s)
        self._mean_hold_s = 10.0
        self._refresher: asyncio.Task[None] | None = None
        self._last_read_error = ""
        if geometry is not None:
            self._publish_geometry()
        self._gauges_read_at_scrape()

    # -- geometry -------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the engine's /metrics once: geometry (first time or when it changed) and gauges."""
        if self._read is None:
            return
        try:
            geom, live = read_metrics(await self._read(), self.engine)
        except Exception as exc:  # the engine may still be starting; keep what we had
            if str(exc) != self._last_read_error:
                log.warning("scheduler: cannot read engine metrics: %s", exc)
                self._last_read_error = str(exc)
            return
        self._last_read_error = ""
        self.live = live
        m = self.metrics
        m.upstream_preemptions.set(live.preemptions)
        m.upstream_kv_usage.set(live.kv_usage)
        m.upstream_running.set(live.running)
        m.upstream_waiting.set(live.waiting)
        if geom is not None and geom != self.geometry:
            log.info("scheduler: pool %d blocks x %d tokens, %d state blocks per seat, seats %s",
                     geom.num_blocks, geom.block_size, geom.state_blocks_per_seat, self.engine.seats or "?")
            self.geometry = geom
            self._recent.capacity = geom.num_blocks
            self._publish_geometry()
            self._pump()

    def _publish_geometry(self) -> None:
        if self.geometry is not None:
            self.metrics.pool_blocks.set(self.geometry.num_blocks)
            self.metrics.block_size.set(self.geometry.block_size)
        self.metrics.seats.set(self.engine.seats or 0)

    async def start(self) -> None:
        if self._read is None or self._refresher is not None:
            return
        await self.refresh()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            await self.refresh()

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
            self._refresher = None
        for w in list(self.queue.in_order(self._running)):
            self.queue.remove(w)
            if not w.future.done():
                w.future.set_exception(QueueTimeout("the proxy is shutting down", 1))

    # -- accounting -----------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return sum(self._by_class)

    @property
    def used_blocks(self) -> int:
        return self._private + len(self._prefix) * self._block_cost()

    def _block_cost(self) -> int:
        """Pool blocks one shared prompt block stands for (one per attention group)."""
        g = self.geometry
        return 0 if g is None else g.attn_groups

    def _cached(self, w: Waiter) -> tuple[int, int]:
        """(leading prompt blocks the engine will find cached, how many of those running requests
        already hold and are counted)."""
        hit = self._recent.cached_prefix(w.hashes, self._prefix.shared_prefix(w.hashes), self._prefix,
                                         self._admitted_total)
        return hit, self._prefix.held(w.hashes[:hit])

    def need(self, w: Waiter) -> int:
        """Blocks `w` would add now: its worst case less the prompt blocks already counted."""
        return w.blocks - self._cached(w)[1] * self._block_cost()

    def can_admit(self, w: Waiter) -> bool:
        if self.running == 0:
            return True  # alone it runs even when bigger than its class's share
        g, seats = self.geometry, self.engine.seats
        room_blocks = room_seats = 0
        if w.priority != Priority.INTERACTIVE:  # keep the main agent's headroom beyond what it holds now
            r = self._reserve()
            room_blocks = max(0, r.blocks - self._interactive_blocks)
            room_seats = max(0, r.seats - self._by_class[Priority.INTERACTIVE])
        if seats is not None and self.running + 1 + room_seats > seats:
            return False
        if g is None:
            return True
        need = self.need(w)
        return self.used_blocks + need + room_blocks <= g.num_blocks or self._fits_over_time(w, need, room_blocks)

    def _fits_over_time(self, w: Waiter, need: int, room: int) -> bool:
        """Whether `w` fits at every future engine step, not only if every request were at its worst
        case at once. Requests that are generating free their blocks when they end, at the latest after
        `out_tokens - generated` more steps (each step gives every running request a token), while the
        output blocks they have not written yet cannot be needed sooner than `1 + spec_tokens` tokens
        per step. So a request may start while the others are still growing if the sum stays within
        the pool at each step where one of them ends (usage only grows between those steps), and once
        all of them ended. Requests still prefilling, and `w` itself, are counted as never ending.
        Shared prompt blocks and the interactive reserve stay counted throughout."""
        g = self.geometry
        if g is None:
            return True
        rate, bs, groups = 1 + g.spec_tokens, g.block_size, g.attn_groups

        def unwritten(left: int, step: int) -> int:  # output blocks not yet needed after `step` steps
            return max(0, left - rate * step) // bs * groups

        fixed = self.used_blocks - self._private + room  # shared prompt blocks, the reserve
        ending: list[tuple[int, int]] = []  # (blocks, tokens left) of generating tickets
        staying: list[tuple[int, int]] = [(need, w.out_tokens)]
        for t in self._live:
            left = t.out_tokens - t.generated
            (ending if t.generated > 0 and left > 0 else staying).append((t.private_blocks, left))
        steps = sorted({0, *(left - 1 for _, left in ending)})
        for step in steps:
            use = fixed + sum(b - unwritten(left, step) for b, left in staying)
            use += sum(b - unwritten(left, step) for b, left in ending if step < left)
            if use > g.num_blocks:
                return False
        return fixed + sum(b for b, _ in staying) <= g.num_blocks  # after every generating one ended

    def _progressed(self, t: SeatTicket, before: int) -> None:
        """A ticket crossed into a new output block: the future may have room for a waiter now."""
        g = self.geometry
        # Per token: the integer test first, the queue's length (a Python __len__) only on a crossing.
        if g is not None and t.generated // g.block_size != before // g.block_size and self.queue:
            self._pump()

    def _admit(self, w: Waiter, how: str) -> SeatTicket:
        hit, held = self._cached(w) if self.geometry is not None else (0, 0)
        cost = self._block_cost()
        need = w.blocks - held * cost if self.geometry is not None else 0
        shared = list(w.hashes[:hit])
        self._prefix.take(shared)  # held ones gain a reference; recently freed ones are counted once from now on
        private = need - (hit - held) * cost
        ticket = SeatTicket(self, w.session, w.priority, private, tuple(w.hashes), shared, time.monotonic(),
                            backfilled=how == "backfill", added=need, out_tokens=w.out_tokens)
        self._live.add(ticket)
        self._private += private
        self._admitted_total += need
        self._running[w.session] = self._running.get(w.session, 0) + 1
        self._by_class[w.priority] += 1
        if w.priority == Priority.INTERACTIVE:
            # Demand: the blocks beyond the prompt prefix the engine caches (reserve.py).
            self._interactive_blocks += need
            self.reserve.observe(private, self._by_class[Priority.INTERACTIVE])
        m = self.metrics
        m.admitted[w.priority, how].inc()
        m.wait[w.priority].observe(time.monotonic() - w.enqueued)
        return ticket

    def _materialize(self, t: SeatTicket) -> None:
        if t.released or t.materialized or self.geometry is None or not self.geometry.shares_prefixes:
            return
        t.materialized = True
        new = self._prefix.materialize(t.hashes[len(t.shared):])
        if not new:
            return
        # Those blocks move from this ticket's private count to the shared index (same blocks).
        moved = len(new) * self._block_cost()
        t.private_blocks -= moved
        self._private -= moved
        t.shared.extend(new)
        self._pump()  # requests sharing this prefix may fit now

    def _release(self, t: SeatTicket) -> None:
        # Its computed blocks stay cached behind the blocks already free (at least pool - admitted worst cases).
        free = self.geometry.num_blocks - self.used_blocks if self.geometry is not None else 0
        self._private -= t.private_blocks
        self._live.discard(t)
        self._prefix.release(t.shared)
        self._recent.add(t.hashes if t.materialized else t.shared, self._admitted_total + max(0, free))
        if t.priority == Priority.INTERACTIVE:
            self._interactive_blocks -= t.added
        left = self._running.get(t.session, 0) - 1
        if left > 0:
            self._running[t.session] = left
        else:
            self._running.pop(t.session, None)
        self._by_class[t.priority] -= 1
        hold = time.monotonic() - t.admitted_at
        self._mean_hold_s = 0.8 * self._mean_hold_s + 0.2 * hold
        self._pump()

    def _gauges_read_at_scrape(self) -> None:
        """The counts as gauges computed when /metrics is scraped, not on every admission and release
        (which set ten gauges, four times per request: the scheduler's largest per-request cost)."""
        m = self.metrics
        m.admitted_blocks.set_function(lambda: self.used_blocks)
        m.shared_blocks.set_function(lambda: len(self._prefix) * self._block_cost())
        m.reserve_blocks.set_function(lambda: self._reserve().blocks)
        m.reserve_seats.set_function(lambda: self._reserve().seats)
        for p in Priority:
            m.running[p].set_function(partial(self._by_class.__getitem__, p))
            m.queue_depth[p].set_function(partial(self.queue.depth, p))

    def _reserve(self) -> Reserve:
        g = self.geometry
        return self.reserve.current(g.num_blocks if g is not None else 0, self.engine.seats)

    # -- queue ----------------------------------------------------------------------------------

    def _short(self, w: Waiter, head: Waiter) -> bool:
        """Small enough to pass a blocked head: small against the pool, or at most half the head."""
        g = self.geometry
        return g is None or w.blocks <= max(g.state_blocks_per_seat + 2 * g.attn_groups,
                                            self.config.backfill_fraction * g.num_blocks,
                                            self.need(head) // 2)

    def _pump(self) -> None:
        """Admit waiters in service order while they fit; backfill short ones behind a blocked head."""
        now = time.monotonic()
        while len(self.queue):
            order = self.queue.in_order(self._running)
            head = next(order)
            if self.can_admit(head):
                self._grant(head, "head")
                continue
            if now - head.enqueued > self.config.backfill_bound_s:
                break
            # Background work is not backfilled while the main agent generates: it would share the
            # engine's steps with the turn a person is waiting on.
            quiet = self._by_class[Priority.INTERACTIVE] == 0
            for w in order:
                if (quiet or w.priority != Priority.BACKGROUND) and self._short(w, head) and self.can_admit(w):
                    self._grant(w, "backfill")
                    break
            else:
                break

    def _grant(self, w: Waiter, how: str) -> None:
        self.queue.served(w)
        w.future.set_result(self._admit(w, how))

    def _retry_after(self) -> int:
        per_seat = self._mean_hold_s * (len(self.queue) + 1) / max(1, self.running)
        return int(min(300, max(1, math.ceil(per_seat))))

    def _waiter(self, footprint: Footprint) -> Waiter:
        g = self.geometry
        hashes: list[bytes] = []
        if g is not None and g.shares_prefixes:
            hashes = self._chains.hashes(footprint.session, footprint.prompt, g.block_size)
        blocks = worst_case_blocks(footprint, g) if g is not None else 0
        return Waiter(footprint.session, footprint.priority, blocks, hashes, time.monotonic(),
                      asyncio.get_running_loop().create_future(), out_tokens=max(0, footprint.max_tokens))

    def try_acquire(self, footprint: Footprint) -> Ticket | None:
        """Admitted at once when the queue is empty and the request fits now: what `acquire` would
        grant without waiting (the queue's head is this request), without going through the queue."""
        if not self.config.enabled:
            return OpenTicket()
        if self.geometry is None or len(self.queue):
            return None
        w = self._waiter(footprint)
        if not self.can_admit(w):
            return None
        self.queue.stamp_served(w.session)
        return self._admit(w, "head")

    async def acquire(self, footprint: Footprint) -> Ticket:
        if not self.config.enabled:
            return OpenTicket()
        if self.geometry is None:
            await self.refresh()
        p = footprint.priority
        w = self._waiter(footprint)
        self.queue.push(w)
        self._pump()
        if w.future.done():
            return w.future.result()
        if len(self.queue) > self.config.max_queue:
            self.queue.remove(w)
            self.metrics.rejected[p, "queue_full"].inc()
            raise QueueFull(f"admission queue is full ({self.config.max_queue} waiting); retry later",
                            self._retry_after())
        try:
            done, _ = await asyncio.wait({w.future}, timeout=self.config.max_wait_s[p])
        except asyncio.CancelledError:
            self._abandon(w)
            raise
        if not done and self.queue.remove(w):  # else it was granted in the same instant
            self.metrics.rejected[p, "wait_timeout"].inc()
            raise QueueTimeout(f"waited {self.config.max_wait_s[p]:.0f}s for engine capacity; retry later",
                               self._retry_after())
        return w.future.result()

    def _abandon(self, w: Waiter) -> None:
        """The caller went away while queued: leave the queue, or give back what was just granted."""
        if self.queue.remove(w):
            self.metrics.cancelled[w.priority].inc()
            self._pump()  # the head may have changed
        elif w.future.done() and not w.future.cancelled() and w.future.exception() is None:
            w.future.result().release()

    def snapshot(self) -> dict[str, object]:
        """A plain view for logs and tests."""
        return {"running": self.running, "queued": len(self.queue), "used_blocks": self.used_blocks,
                "pool_blocks": self.geometry.num_blocks if self.geometry else None,
                "by_class": {p.label: self._by_class[p] for p in Priority}}


def open_scheduler(upstream_get_text: Callable[[str], Awaitable[str]], registry: CollectorRegistry | SchedulerMetrics,
                   config: SchedulerConfig, engine: EngineGeometry, name: str = "engine-0") -> Scheduler:
    """The scheduler the app runs: the pool's size from the engine's /metrics, seats and per-seat costs
    from the runtime config."""
    return Scheduler(config, registry, engine=engine, read_metrics_text=lambda: upstream_get_text("/metrics"),
                     name=name)
