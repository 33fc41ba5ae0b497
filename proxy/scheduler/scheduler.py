"""The admission scheduler: a request starts only when a seat and its worst case in the pool are free.

`Scheduler` implements proxy/admission.py's seam (`acquire(footprint) -> Ticket`). It owns the
admitted set (private block counts, the shared-prefix index, seats per class and session) and the
waiting room (`AdmissionQueue`); `PoolReader`-style refresh keeps the engine's geometry and gauges.
Check before change: `can_admit(w)` then `_admit(w)`; everything that frees capacity calls `_pump()`.

Policy:
- classes in strict order (interactive > subagent > background); a reserve of the pool and of the
  seats is kept for interactive requests, so the main agent starts promptly during a subagent burst;
- a request bigger than its class's share starts alone, when nothing else of ours runs;
- backfill: while the head cannot fit, a *short* request behind it that fits may start, but only
  during the first `backfill_bound_s` of the head's wait, which bounds how long the head is passed
  over; after that the pool drains until the head fits;
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

from prometheus_client import CollectorRegistry

from proxy.admission import Footprint, OpenTicket, Priority, Ticket
from proxy.settings import EngineGeometry, SchedulerConfig

from .errors import QueueFull, QueueTimeout
from .footprint import PrefixIndex, granule_tokens, prefix_hashes, worst_case_blocks
from .metrics import SchedulerMetrics
from .pool import LiveGauges, PoolGeometry, read_metrics
from .queue import AdmissionQueue, Waiter

log = logging.getLogger("proxy.scheduler")


@dataclass(eq=False, slots=True)
class SeatTicket:
    """One admitted request's hold on a seat and on pool blocks; `release()` is idempotent."""

    scheduler: Scheduler
    session: str
    priority: Priority
    private_blocks: int
    hashes: tuple[bytes, ...]  # all shareable prompt granules
    shared: list[bytes]  # granules counted in the shared index on this ticket's behalf
    admitted_at: float
    released: bool = False
    materialized: bool = False
    backfilled: bool = field(default=False)

    def prefilled(self) -> None:
        """The engine produced a token: this prompt's blocks are computed and can be shared."""
        self.scheduler._materialize(self)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.scheduler._release(self)


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None, registry: CollectorRegistry | None = None, *,
                 engine: EngineGeometry | None = None, geometry: PoolGeometry | None = None,
                 read_metrics_text: Callable[[], Awaitable[str]] | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.engine = engine or EngineGeometry()  # the runtime config's facts: seats, state pages, spec tokens
        self.metrics = SchedulerMetrics(registry or CollectorRegistry())
        self.geometry = geometry
        self.live = LiveGauges()
        self._read = read_metrics_text
        self.queue = AdmissionQueue()
        self._prefix = PrefixIndex()
        self._private = 0  # blocks held by admitted requests outside the shared index
        self._running: dict[str, int] = {}  # session -> admitted requests
        self._by_class = [0 for _ in Priority]
        self._mean_hold_s = 10.0
        self._refresher: asyncio.Task[None] | None = None
        self._last_read_error = ""
        if geometry is not None:
            self._publish_geometry()

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
        return self._private + len(self._prefix) * self._granule_blocks()

    def _granule_blocks(self) -> int:
        g = self.geometry
        return 0 if g is None else granule_tokens(g) // g.block_size * g.attn_groups

    def need(self, w: Waiter) -> int:
        """Blocks `w` would add now: its worst case less the prefix granules already counted."""
        return w.blocks - self._prefix.shared_prefix(w.hashes) * self._granule_blocks()

    def _limits(self, p: Priority) -> tuple[int | None, int | None]:
        """(seats, blocks) a request of class `p` may fill up to."""
        cfg, g = self.config, self.geometry
        interactive = p == Priority.INTERACTIVE
        seats = self.engine.seats
        if seats is not None and not interactive and seats > 1:
            seats -= min(cfg.reserve_seats, seats - 1)
        blocks = None
        if g is not None:
            blocks = g.num_blocks if interactive else g.num_blocks - math.ceil(cfg.reserve_fraction * g.num_blocks)
        return seats, blocks

    def can_admit(self, w: Waiter) -> bool:
        if self.running == 0:
            return True  # alone it runs even when bigger than its class's share
        seats, blocks = self._limits(w.priority)
        if seats is not None and self.running >= seats:
            return False
        return blocks is None or self.used_blocks + self.need(w) <= blocks

    def _admit(self, w: Waiter, how: str) -> SeatTicket:
        need = self.need(w) if self.geometry is not None else 0  # private: worst case less shared prefix
        shared = list(w.hashes[: self._prefix.shared_prefix(w.hashes)])
        self._prefix.acquire(shared)
        ticket = SeatTicket(self, w.session, w.priority, need, tuple(w.hashes), shared, time.monotonic(),
                            backfilled=how == "backfill")
        self._private += need
        self._running[w.session] = self._running.get(w.session, 0) + 1
        self._by_class[w.priority] += 1
        m = self.metrics
        m.admitted.labels(w.priority.label, how).inc()
        m.wait.labels(w.priority.label).observe(time.monotonic() - w.enqueued)
        self._publish_counts()
        return ticket

    def _materialize(self, t: SeatTicket) -> None:
        if t.released or t.materialized or self.geometry is None or not self.geometry.shares_prefixes:
            return
        t.materialized = True
        new = self._prefix.materialize(t.hashes[len(t.shared):])
        if not new:
            return
        # Those granules move from this ticket's private count to the shared index (same blocks).
        moved = len(new) * self._granule_blocks()
        t.private_blocks -= moved
        self._private -= moved
        t.shared.extend(new)
        self._publish_counts()
        self._pump()  # requests sharing this prefix may fit now

    def _release(self, t: SeatTicket) -> None:
        self._private -= t.private_blocks
        self._prefix.release(t.shared)
        left = self._running.get(t.session, 0) - 1
        if left > 0:
            self._running[t.session] = left
        else:
            self._running.pop(t.session, None)
        self._by_class[t.priority] -= 1
        hold = time.monotonic() - t.admitted_at
        self._mean_hold_s = 0.8 * self._mean_hold_s + 0.2 * hold
        self._publish_counts()
        self._pump()

    def _publish_counts(self) -> None:
        m = self.metrics
        m.admitted_blocks.set(self.used_blocks)
        m.shared_blocks.set(len(self._prefix) * self._granule_blocks())
        for p in Priority:
            m.running.labels(p.label).set(self._by_class[p])
            m.queue_depth.labels(p.label).set(self.queue.depth(p))

    # -- queue ----------------------------------------------------------------------------------

    def _short(self, w: Waiter) -> bool:
        g = self.geometry
        return g is None or w.blocks <= max(g.state_blocks_per_seat + 2 * g.attn_groups,
                                            self.config.backfill_fraction * g.num_blocks)

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
            for w in order:
                if self._short(w) and self.can_admit(w):
                    self._grant(w, "backfill")
                    break
            else:
                break
        self._publish_counts()

    def _grant(self, w: Waiter, how: str) -> None:
        self.queue.served(w)
        w.future.set_result(self._admit(w, how))

    def _retry_after(self) -> int:
        per_seat = self._mean_hold_s * (len(self.queue) + 1) / max(1, self.running)
        return int(min(300, max(1, math.ceil(per_seat))))

    async def acquire(self, footprint: Footprint) -> Ticket:
        if not self.config.enabled:
            return OpenTicket()
        if self.geometry is None:
            await self.refresh()
        p = footprint.priority
        g = self.geometry
        hashes: list[bytes] = []
        if g is not None and g.shares_prefixes:
            hashes = prefix_hashes(footprint.prompt, granule_tokens(g))
        blocks = worst_case_blocks(footprint, g) if g is not None else 0
        w = Waiter(footprint.session, p, blocks, hashes, time.monotonic(), asyncio.get_running_loop().create_future())
        self.queue.push(w)
        self._pump()
        if w.future.done():
            return w.future.result()
        if len(self.queue) > self.config.max_queue:
            self.queue.remove(w)
            self.metrics.rejected.labels(p.label, "queue_full").inc()
            self._publish_counts()
            raise QueueFull(f"admission queue is full ({self.config.max_queue} waiting); retry later",
                            self._retry_after())
        try:
            done, _ = await asyncio.wait({w.future}, timeout=self.config.max_wait_s[p])
        except asyncio.CancelledError:
            self._abandon(w)
            raise
        if not done and self.queue.remove(w):  # else it was granted in the same instant
            self.metrics.rejected.labels(p.label, "wait_timeout").inc()
            self._publish_counts()
            raise QueueTimeout(f"waited {self.config.max_wait_s[p]:.0f}s for engine capacity; retry later",
                               self._retry_after())
        return w.future.result()

    def _abandon(self, w: Waiter) -> None:
        """The caller went away while queued: leave the queue, or give back what was just granted."""
        if self.queue.remove(w):
            self.metrics.cancelled.labels(w.priority.label).inc()
            self._publish_counts()
            self._pump()  # the head may have changed
        elif w.future.done() and not w.future.cancelled() and w.future.exception() is None:
            w.future.result().release()

    def snapshot(self) -> dict[str, object]:
        """A plain view for logs and tests."""
        return {"running": self.running, "queued": len(self.queue), "used_blocks": self.used_blocks,
                "pool_blocks": self.geometry.num_blocks if self.geometry else None,
                "by_class": {p.label: self._by_class[p] for p in Priority}}


def open_scheduler(upstream_get_text: Callable[[str], Awaitable[str]], registry: CollectorRegistry,
                   config: SchedulerConfig, engine: EngineGeometry) -> Scheduler:
    """The scheduler the app runs: the pool's size from the engine's /metrics, seats and per-seat costs
    from the runtime config."""
    return Scheduler(config, registry, engine=engine, read_metrics_text=lambda: upstream_get_text("/metrics"))
