"""The scheduler's Prometheus series, registered in the app's registry (proxy/metrics.py owns it).

Every series carries an `engine` label: a proxy over several engines runs one scheduler per engine, all
into the one registry that /metrics serves. `SchedulerMetrics` owns the families (one per registry);
`bind(engine)` gives a scheduler its own children, resolved once, so the admission path never looks a
label set up again (`labels()` hashes and locks on every call).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.admission import Priority

_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
_HOWS = ("head", "backfill")
_REJECTS = ("queue_full", "wait_timeout")


class SchedulerMetrics:
    """The families, one set per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        ns = "hh_scheduler"
        r = registry
        e = ["engine"]
        self.queue_depth = Gauge(f"{ns}_queue_depth", "Requests waiting for admission", [*e, "priority"],
                                 registry=r)
        self.wait = Histogram(f"{ns}_wait_seconds", "Time from arrival to admission (admitted requests)",
                              [*e, "priority"], buckets=_WAIT_BUCKETS, registry=r)
        self.running = Gauge(f"{ns}_running_requests", "Admitted requests not yet finished", [*e, "priority"],
                             registry=r)
        self.admitted_blocks = Gauge(f"{ns}_admitted_blocks",
                                     "Worst-case engine blocks held by admitted requests", e, registry=r)
        self.shared_blocks = Gauge(f"{ns}_shared_prefix_blocks",
                                   "Of those, prompt-prefix blocks counted once for several requests", e,
                                   registry=r)
        self.reserve_blocks = Gauge(f"{ns}_reserve_blocks", "Pool blocks kept for interactive requests (observed"
                                    " peak demand, or the configured prior)", e, registry=r)
        self.reserve_seats = Gauge(f"{ns}_reserve_seats", "Seats kept for interactive requests", e, registry=r)
        self.pool_blocks = Gauge(f"{ns}_pool_blocks", "Engine KV pool size in blocks (vllm:cache_config_info)",
                                 e, registry=r)
        self.block_size = Gauge(f"{ns}_block_size_tokens", "Tokens per engine block", e, registry=r)
        self.seats = Gauge(f"{ns}_seats", "Engine seats (max_num_seqs); 0 when unknown", e, registry=r)
        self.admitted = Counter(f"{ns}_admitted", "Requests admitted", [*e, "priority", "how"], registry=r)
        self.rejected = Counter(f"{ns}_rejected", "Requests refused (queue_full: 429, wait_timeout: 503)",
                                [*e, "priority", "reason"], registry=r)
        self.cancelled = Counter(f"{ns}_cancelled", "Clients that left while queued", [*e, "priority"],
                                 registry=r)
        self.upstream_preemptions = Gauge(f"{ns}_upstream_preemptions",
                                          "vllm:num_preemptions_total as last read", e, registry=r)
        self.upstream_kv_usage = Gauge(f"{ns}_upstream_kv_usage", "vllm:kv_cache_usage_perc as last read",
                                       e, registry=r)
        self.upstream_running = Gauge(f"{ns}_upstream_running", "vllm:num_requests_running as last read",
                                      e, registry=r)
        self.upstream_waiting = Gauge(f"{ns}_upstream_waiting", "vllm:num_requests_waiting as last read",
                                      e, registry=r)

    def bind(self, engine: str) -> EngineSchedulerMetrics:
        per_class = [p for p in Priority]
        m = EngineSchedulerMetrics(
            queue_depth=[self.queue_depth.labels(engine, p.label) for p in per_class],
            wait=[self.wait.labels(engine, p.label) for p in per_class],
            running=[self.running.labels(engine, p.label) for p in per_class],
            admitted={(p, how): self.admitted.labels(engine, p.label, how) for p in per_class for how in _HOWS},
            rejected={(p, why): self.rejected.labels(engine, p.label, why) for p in per_class for why in _REJECTS},
            cancelled=[self.cancelled.labels(engine, p.label) for p in per_class],
            admitted_blocks=self.admitted_blocks.labels(engine),
            shared_blocks=self.shared_blocks.labels(engine),
            reserve_blocks=self.reserve_blocks.labels(engine),
            reserve_seats=self.reserve_seats.labels(engine),
            pool_blocks=self.pool_blocks.labels(engine),
            block_size=self.block_size.labels(engine),
            seats=self.seats.labels(engine),
            upstream_preemptions=self.upstream_preemptions.labels(engine),
            upstream_kv_usage=self.upstream_kv_usage.labels(engine),
            upstream_running=self.upstream_running.labels(engine),
            upstream_waiting=self.upstream_waiting.labels(engine),
        )
        for g in (*m.queue_depth, *m.running):
            g.set(0)
        return m


@dataclass(frozen=True)
class EngineSchedulerMetrics:
    """One engine's children. Lists are indexed by `Priority` (an IntEnum)."""

    queue_depth: list[Gauge]
    wait: list[Histogram]
    running: list[Gauge]
    admitted: dict[tuple[Priority, str], Counter]  # (priority, how)
    rejected: dict[tuple[Priority, str], Counter]  # (priority, reason)
    cancelled: list[Counter]
    admitted_blocks: Gauge
    shared_blocks: Gauge
    reserve_blocks: Gauge
    reserve_seats: Gauge
    pool_blocks: Gauge
    block_size: Gauge
    seats: Gauge
    upstream_preemptions: Gauge
    upstream_kv_usage: Gauge
    upstream_running: Gauge
    upstream_waiting: Gauge
