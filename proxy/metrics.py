"""The proxy's own Prometheus series, in a registry owned by the app (no global default registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ns = "hyperharness_proxy"
        r = self.registry
        self.requests = Counter(f"{ns}_requests", "Requests answered", ["route", "status"], registry=r)
        self.latency = Histogram(
            f"{ns}_request_seconds", "Time to the last byte", ["route"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttfb = Histogram(
            f"{ns}_time_to_first_token_seconds",
            "Request start to first content/reasoning/tool delta",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.transcript_lookups = Counter(
            f"{ns}_transcript_lookups",
            "Chat requests by transcript outcome (hit, miss, diverged)",
            ["outcome"],
            registry=r,
        )
        self.divergences = Counter(
            f"{ns}_transcript_divergences", "Fresh renders of a known session, by reason", ["reason"], registry=r
        )
        self.reprefilled_tokens = Counter(
            f"{ns}_reprefilled_tokens",
            "Previously-sent tokens that a divergence forces the engine to prefill again",
            registry=r,
        )
        self.spliced_tokens = Counter(
            f"{ns}_spliced_tokens", "Prompt tokens reused verbatim from stored transcripts", registry=r
        )
        self.prompt_tokens = Counter(f"{ns}_prompt_tokens", "Prompt tokens sent upstream", registry=r)
        self.completion_tokens = Counter(f"{ns}_completion_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter(
            f"{ns}_cached_prompt_tokens", "Prompt tokens the engine reported as served from cache", registry=r
        )
        self.render_seconds = Histogram(
            f"{ns}_render_seconds",
            "Render + tokenize + splice time per chat request",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.argument_mismatches = Counter(
            f"{ns}_tool_argument_mismatches",
            "Streamed tool-call arguments that differ from the final parse (a parser defect)",
            registry=r,
        )
        self.warmups = Counter(f"{ns}_warmups", "Next-turn warm-up prefills", ["outcome"], registry=r)
        self.sessions = Gauge(f"{ns}_store_sessions", "Sessions held by the transcript store", registry=r)
        self.inflight = Gauge(f"{ns}_inflight_requests", "Requests being served", registry=r)
        # Read at each scrape: a count that keeps growing while the load is flat is a leak
        # (backend/tools/soak.py fails on it).
        self.tasks = Gauge(f"{ns}_event_loop_tasks", "asyncio tasks alive in the proxy's event loop", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
