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
    used_blocks: int = 0  # worst-case pool blocks of admitted requests (and, locally, queued and placed ones)
    pool_blocks: int = 0  # 0: unknown
    seats: int = 0  # 0: unknown
    head_wait_s: float = 0.0  # how long the oldest queued request has waited

    @property
    def requests(self) -> int:
        """Admitted and waiting (queued, or locally just placed)."""
        return self.running + self.queued

    @property
    def footprint(self) -> float:
        """Share of the engine's capacity in use: pool blocks when known, else seats, else requests."""
        if self.pool_blocks:
            return self.used_blocks / self.pool_blocks
        if self.seats:
            return self.requests / self.seats
        return float(self.requests)

    def plus(self, other: EngineLoad) -> EngineLoad:
        return EngineLoad(self.running + other.running, self.queued + other.queued,
                          self.used_blocks + other.used_blocks, max(self.pool_blocks, other.pool_blocks),
                          max(self.seats, other.seats), max(self.head_wait_s, other.head_wait_s))

    def to_list(self) -> list[float]:
        return [self.running, self.queued, self.used_blocks, self.pool_blocks, self.seats, self.head_wait_s]

    @classmethod
    def from_list(cls, v: list[float]) -> EngineLoad:
        return cls(int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]), float(v[5]))


class Placing:
    """Turns placed on an engine that have not yet asked its admission: the scheduler cannot see them,
    so a burst of turns placed in one instant (a fan-out) would all read the same idle engine. Each is
    counted from its placement until `done()` (at its admission request); one that never gets there (its
    client left first) stops counting after `ttl_s`."""

    def __init__(self, ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[int, tuple[float, int]] = {}  # token -> (placed at, worst-case blocks)
        self._next = 0

    def add(self, blocks: int) -> int:
        self._next += 1
        self._entries[self._next] = (time.monotonic(), blocks)
        return self._next

    def done(self, token: int) -> None:
        self._entries.pop(token, None)

    def totals(self) -> tuple[int, int]:
        """(turns, blocks) placed and not yet at admission."""
        if not self._entries:
            return 0, 0
        old = time.monotonic() - self.ttl_s
        for k in [k for k, (t, _) in self._entries.items() if t < old]:
            del self._entries[k]
        return len(self._entries), sum(b for _, b in self._entries.values())


@dataclass(eq=False)
class Engine:
    config: UpstreamConfig
    upstream: Upstream
    admission: Admission = field(default_factory=NoAdmission)
    scheduler: Scheduler | None = None  # the admission when it is the pool-geometry scheduler
    health: Health = Health.UP
    failures: int = 0  # consecutive failed health checks
    placing: Placing = field(default_factory=Placing)

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
        """This replica's own requests on the engine (the scheduler's books) and the turns just placed on
        it: queued counts both, and the pool blocks are what admitted, queued and placed turns need."""
        placed, placed_blocks = self.placing.totals()
        s = self.scheduler
        if s is None:
            return EngineLoad(queued=placed, seats=self.config.geometry.seats or 0)
        waiting = list(s.queue.in_order({}))
        head = min((w.enqueued for w in waiting), default=None)
        return EngineLoad(
            running=s.running, queued=len(waiting) + placed,
            used_blocks=s.used_blocks + sum(w.blocks for w in waiting) + placed_blocks,
            pool_blocks=s.geometry.num_blocks if s.geometry else 0, seats=s.engine.seats or 0,
            head_wait_s=0.0 if head is None else time.monotonic() - head,
        )

    def worst_case_blocks(self, prompt_tokens: int, max_tokens: int) -> int:
        """A turn's pool blocks as the engine's scheduler would count them (0 while its pool is unknown)."""
        g = self.scheduler.geometry if self.scheduler is not None else None
        return 0 if g is None else g.token_blocks(prompt_tokens + max(0, max_tokens)) + g.state_blocks_per_seat
