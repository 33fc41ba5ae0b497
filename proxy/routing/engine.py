"""One engine behind the proxy: its upstream connection, its own admission (each engine keeps its own
pool-geometry scheduler) and its health, plus the load numbers placement compares."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from proxy.admission import Admission, NoAdmission
from proxy.scheduler import Scheduler
from proxy.settings import UpstreamConfig
from proxy.upstream import Upstream


class Health(StrEnum):
    UP = "up"  # takes new sessions and keeps its own
    DRAINING = "draining"  # failed its checks: takes nothing new, its sessions move on their next turn
    DOWN = "down"  # unreachable for longer: as draining, and shown as down


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """An engine's load as one replica (or all, summed from the shared state) sees it."""

    running: int = 0  # admitted requests
    queued: int = 0  # requests waiting for admission
    used_blocks: int = 0  # worst-case pool blocks admitted requests hold
    pool_blocks: int = 0  # 0: unknown
    seats: int = 0  # 0: unknown
    head_wait_s: float = 0.0  # how long the oldest queued request has waited

    @property
    def footprint(self) -> float:
        """Share of the engine's capacity in use: pool blocks when known, else seats, else requests."""
        if self.pool_blocks:
            return self.used_blocks / self.pool_blocks
        if self.seats:
            return (self.running + self.queued) / self.seats
        return float(self.running + self.queued)

    def plus(self, other: EngineLoad) -> EngineLoad:
        return EngineLoad(self.running + other.running, self.queued + other.queued,
                          self.used_blocks + other.used_blocks, max(self.pool_blocks, other.pool_blocks),
                          max(self.seats, other.seats), max(self.head_wait_s, other.head_wait_s))

    def to_list(self) -> list[float]:
        return [self.running, self.queued, self.used_blocks, self.pool_blocks, self.seats, self.head_wait_s]

    @classmethod
    def from_list(cls, v: list[float]) -> EngineLoad:
        return cls(int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]), float(v[5]))


@dataclass(eq=False)
class Engine:
    config: UpstreamConfig
    upstream: Upstream
    admission: Admission = field(default_factory=NoAdmission)
    scheduler: Scheduler | None = None  # the admission when it is the pool-geometry scheduler
    health: Health = Health.UP
    failures: int = 0  # consecutive failed health checks

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def weight(self) -> float:
        return self.config.weight

    @property
    def live(self) -> bool:
        return self.health is Health.UP

    def local_load(self) -> EngineLoad:
        """This replica's own admitted requests on the engine (the scheduler's books)."""
        s = self.scheduler
        if s is None:
            return EngineLoad(seats=self.config.geometry.seats or 0)
        waiting = list(s.queue.in_order({}))
        head = min((w.enqueued for w in waiting), default=None)
        return EngineLoad(
            running=s.running, queued=len(s.queue), used_blocks=s.used_blocks,
            pool_blocks=s.geometry.num_blocks if s.geometry else 0, seats=s.engine.seats or 0,
            head_wait_s=0.0 if head is None else time.monotonic() - head,
        )
