"""The proxy's Prometheus series, in registries owned by the app (no global default registry).

Naming (docs/metrics.md lists every series):
- `vllm:*`: where vLLM has a series (requests running/waiting, KV usage, prefix-cache queries/hits, TTFT,
  inter-token latency, spec-decode drafts/accepted, ...), the proxy re-exports what it last read from
  each engine's own /metrics under vLLM's exact name, with `engine` = our engine's name (vLLM's own
  engine index moves to `engine_index`). Prometheus then scrapes one target per proxy, and the engines
  stay bound to loopback behind it.
- `hh_*`: what vLLM cannot know (sessions, transcripts, admission, placement). The proxy's older
  `hyperharness_proxy_*` / `hyperharness_scheduler_*` names were renamed to `hh_*` / `hh_scheduler_*`,
  so one prefix covers every series of ours.
No raw session ids in labels: per-session facts are aggregated by harness (proxy/observe.py keeps the
per-session view in memory, for the dashboard only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# vLLM families re-exported per engine (names as vLLM 0.32 registers them; counters without `_total`).
VLLM_REEXPORTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:cache_config_info",
)

EngineTexts = Callable[[], Iterable[tuple[str, str]]]  # (engine name, its last /metrics text)


class EngineSeries:
    """Collector: the `VLLM_REEXPORTED` families of every engine's last /metrics text, relabelled.

    A family seen on several engines is yielded once with all their samples (one HELP/TYPE each).
    Parsed text is cached per engine until the text changes (the scheduler re-reads it every second)."""

    def __init__(self, texts: EngineTexts) -> None:
        self._texts = texts
        self._cache: dict[str, tuple[str, list[Metric]]] = {}

    def describe(self) -> list[Metric]:
        return []  # families depend on what the engines expose; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for engine, text in self._texts():
            for fam in self._parsed(engine, text):
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                out.samples.extend(fam.samples)
        yield from merged.values()

    def _parsed(self, engine: str, text: str) -> list[Metric]:
        cached = self._cache.get(engine)
        if cached is not None and cached[0] is text:
            return cached[1]
        fams = relabel(engine, text)
        self._cache[engine] = (text, fams)
        return fams


def _wanted(line: str) -> bool:
    """A sample line of a re-exported family (a prefix match: filtered again after parsing), or its
    HELP/TYPE line. vLLM's page is long and is read every second; the parser sees only these lines."""
    if line.startswith("#"):
        parts = line.split(" ", 3)
        # prometheus_client writes a counter's HELP/TYPE under `name_total`
        return len(parts) > 2 and parts[2].removesuffix("_total") in VLLM_REEXPORTED
    return line.startswith(VLLM_REEXPORTED)


def relabel(engine: str, text: str) -> list[Metric]:
    """The re-exported families of one engine's exposition, samples labelled `engine=<our name>`."""
    keep = [ln for ln in text.splitlines() if _wanted(ln)]
    out = []
    for fam in text_string_to_metric_families("\n".join(keep) + "\n"):
        if fam.name not in VLLM_REEXPORTED:
            continue
        m = Metric(fam.name, fam.documentation, fam.type)
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = dict(s.labels)
            if "engine" in labels:
                labels["engine_index"] = labels.pop("engine")
            labels["engine"] = engine
            m.add_sample(s.name, labels, s.value)
        out.append(m)
    return out


class Children:
    """`family.labels(*values)`, kept: `labels()` checks, hashes and locks on every call (2.6 µs
    measured here), and a turn asks for ~10 children. The families keep every child anyway, so this
    holds no more than they do (no series here is ever removed)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[object, tuple[str, ...]], Any] = {}

    def __call__(self, family: Counter | Gauge | Histogram, *values: str) -> Any:
        key = (family, values)
        got = self._kept.get(key)
        if got is None:
            got = self._kept[key] = family.labels(*values)
        return got


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The engines' re-exported series live apart, so reading our own series (the dashboard) never
        # parses the engines' pages; `render()` exposes both.
        self.engine_registry = CollectorRegistry(auto_describe=False)
        ns = "hh"
        r = self.registry
        self._children = Children()  # `child()`
        self.requests = Counter(f"{ns}_requests", "Requests answered", ["route", "status"], registry=r)
        self.latency = Histogram(
            f"{ns}_request_seconds", "Time to the last byte", ["route"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttfb = Histogram(
            f"{ns}_time_to_first_token_seconds",
            "Request start to first content/reasoning/tool delta, as the client sees it (vLLM's own is"
            " vllm:time_to_first_token_seconds)",
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
        # Per-session accounting, aggregated (proxy/observe.py feeds these once per finished turn).
        self.session_tokens = Counter(
            f"{ns}_session_prompt_tokens",
            "Prompt tokens of finished turns by where they came from: cached (engine prefix cache),"
            " reprefilled (sent earlier in the session, computed again), new",
            ["engine", "harness", "source"],
            registry=r,
        )
        self.turns = Counter(f"{ns}_session_turns", "Finished turns", ["engine", "harness"], registry=r)
        self.reasoning_restored = Counter(
            f"{ns}_reasoning_restored",
            "Turns whose client dropped the previous reply's reasoning, restored from the transcript",
            ["harness"],
            registry=r,
        )
        self.active_sessions = Gauge(
            f"{ns}_active_sessions", "Sessions on the operator view's board (the most recent ones, bounded)",
            ["harness"], registry=r,
        )
        # Read at each scrape: a count that keeps growing while the load is flat is a leak
        # (backend/tools/soak.py fails on it).
        self.tasks = Gauge(f"{ns}_event_loop_tasks", "asyncio tasks alive in the proxy's event loop", registry=r)

    def child(self, family: Counter | Gauge | Histogram, *values: str) -> Any:
        """`family.labels(*values)`, kept (`Children`)."""
        return self._children(family, *values)

    def engines(self, texts: EngineTexts) -> None:
        """Re-export the engines' vLLM series from `texts()` (called at every scrape)."""
        self.engine_registry.register(EngineSeries(texts))

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.engine_registry)
