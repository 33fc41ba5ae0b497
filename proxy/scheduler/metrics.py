"""The scheduler's Prometheus series, registered in the app's registry (proxy/metrics.py owns it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.admission import Priority

_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        ns = "hh_scheduler"
        r = registry
        self.queue_depth = Gauge(f"{ns}_queue_depth", "Requests waiting for admission", ["priority"], registry=r)
        self.wait = Histogram(f"{ns}_wait_seconds", "Time from arrival to admission (admitted requests)",
                              ["priority"], buckets=_WAIT_BUCKETS, registry=r)
        self.running = Gauge(f"{ns}_running_requests", "Admitted requests not yet finished", ["priority"],
                             registry=r)
        self.admitted_blocks = Gauge(f"{ns}_admitted_blocks",
                                     "Worst-case engine blocks held by admitted requests", registry=r)
        self.shared_blocks = Gauge(f"{ns}_shared_prefix_blocks",
                                   "Of those, prompt-prefix blocks counted once for several requests", registry=r)
        self.reserve_blocks = Gauge(f"{ns}_reserve_blocks", "Pool blocks kept for interactive requests (observed"
                                    " peak demand, or the configured prior)", registry=r)
        self.reserve_seats = Gauge(f"{ns}_reserve_seats", "Seats kept for interactive requests", registry=r)
        self.pool_blocks = Gauge(f"{ns}_pool_blocks", "Engine KV pool size in blocks (vllm:cache_config_info)",
                                 registry=r)
        self.block_size = Gauge(f"{ns}_block_size_tokens", "Tokens per engine block", registry=r)
        self.seats = Gauge(f"{ns}_seats", "Engine seats (max_num_seqs); 0 when unknown", registry=r)
        self.admitted = Counter(f"{ns}_admitted", "Requests admitted", ["priority", "how"], registry=r)
        self.rejected = Counter(f"{ns}_rejected", "Requests refused (queue_full: 429, wait_timeout: 503)",
                                ["priority", "reason"], registry=r)
        self.cancelled = Counter(f"{ns}_cancelled", "Clients that left while queued", ["priority"], registry=r)
        self.upstream_preemptions = Gauge(f"{ns}_upstream_preemptions",
                                          "vllm:num_preemptions_total as last read", registry=r)
        self.upstream_kv_usage = Gauge(f"{ns}_upstream_kv_usage", "vllm:kv_cache_usage_perc as last read",
                                       registry=r)
        self.upstream_running = Gauge(f"{ns}_upstream_running", "vllm:num_requests_running as last read",
                                      registry=r)
        self.upstream_waiting = Gauge(f"{ns}_upstream_waiting", "vllm:num_requests_waiting as last read",
                                      registry=r)
        for p in Priority:
            self.queue_depth.labels(p.label).set(0)
            self.running.labels(p.label).set(0)
