"""/metrics: parses with Prometheus' own text parser; the vLLM-named series the proxy re-exports carry
vLLM's exact names (read from the installed vllm package) with an `engine` label; our `hh_*` series split
each session's prompt tokens into cached / re-prefilled / new without a session id in any label.
Against the fake vLLM (fast); tests/proxy/test_dashboard.py checks the same against a real engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.metrics import VLLM_REEXPORTED
from proxy.settings import Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_format import IM_END, ToyFormat, enc
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app
from tests.proxy.vllm_names import vllm_metric_names

pytestmark = [pytest.mark.unit, pytest.mark.asyncio(loop_scope="session")]

KEY = "sk-metrics"
SESSION = "secret-session-id-4711"


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def engine_page() -> str:
    """An engine /metrics page written by prometheus_client with vLLM's names and label names."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_running", "x", labels, registry=r).labels("m", "0").set(1)
    Gauge("vllm:kv_cache_usage_perc", "x", labels, registry=r).labels("m", "0").set(0.25)
    Counter("vllm:prefix_cache_queries", "x", labels, registry=r).labels("m", "0").inc(40)
    Counter("vllm:prefix_cache_hits", "x", labels, registry=r).labels("m", "0").inc(30)
    Counter("vllm:spec_decode_num_drafts", "x", labels, registry=r).labels("m", "0").inc(10)
    Counter("vllm:spec_decode_num_draft_tokens", "x", labels, registry=r).labels("m", "0").inc(70)
    Counter("vllm:spec_decode_num_accepted_tokens", "x", labels, registry=r).labels("m", "0").inc(35)
    Histogram("vllm:time_to_first_token_seconds", "x", labels, registry=r).labels("m", "0").observe(0.2)
    Counter("vllm:request_success", "not re-exported", labels, registry=r).labels("m", "0").inc()
    return generate_latest(r).decode()


class MetricsFake(FakeVLLM):
    page: str = ""

    async def _metrics(self, _: Any) -> Any:
        from aiohttp import web

        return web.Response(text=self.page)


@pytest_asyncio.fixture(loop_scope="session")
async def proxy() -> AsyncIterator[tuple[str, MetricsFake]]:
    fake = MetricsFake(max_model_len=400, cached_tokens=5)
    fake.page = engine_page()
    async with fake_vllm_server(fake) as upstream_url:
        settings = Settings(upstream=upstream_url, model_name="hh", api_key=KEY)
        async with serve_app(create_app(settings, fmt=ToyFormat(), store=MemoryStore())) as url:
            yield url, fake


async def test_reexported_names_are_vllms_own() -> None:
    ours = set(VLLM_REEXPORTED)
    missing = ours - vllm_metric_names()
    assert not missing, f"not vLLM 0.32 series names: {sorted(missing)}"


async def test_metrics_parse_and_split_session_tokens(proxy: tuple[str, MetricsFake]) -> None:
    url, fake = proxy
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    h = {"x-session-id": SESSION, "x-harness": "pi"}
    sys_, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    for text in ("one", "two"):
        fake.scripts.append(([*enc(text), IM_END], [*text, ""], "stop"))
    await client.chat.completions.create(model="m", messages=[sys_, user], extra_headers=h)
    await client.chat.completions.create(model="m", messages=[sys_, user, {"role": "assistant", "content": "one"},
                                                               {"role": "user", "content": "more"}], extra_headers=h)
    await client.close()
    async with httpx.AsyncClient() as c:
        text = (await c.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"})).text
    fams = families(text)  # raises on anything the Prometheus parser cannot read
    assert SESSION not in text
    vllm_names = vllm_metric_names()
    reexported = {n for n in fams if n.startswith("vllm:")}
    assert reexported == {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
                          "vllm:prefix_cache_hits", "vllm:spec_decode_num_drafts",
                          "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                          "vllm:time_to_first_token_seconds"}
    assert reexported <= vllm_names
    for name in reexported:
        for s in fams[name].samples:
            assert s.labels["engine"] == "engine-0" and s.labels["engine_index"] == "0", s
    split = {s.labels["source"]: s.value for s in fams["hh_session_prompt_tokens"].samples
             if s.name.endswith("_total") and s.labels["harness"] == "pi"}
    prompts = [len(r["prompt"]) for r in fake.requests[-2:]]
    assert sum(split.values()) == sum(prompts)
    assert split["cached"] == 2 * 5  # the fake engine reports 5 cached tokens per request
    # Turn 2 extends turn 1 (a splice): its previously-sent tokens the cache did not serve are re-prefilled.
    assert split["reprefilled"] == prompts[0] + len(enc("one")) + 1 - 5
    turns = [s.value for s in fams["hh_session_turns"].samples if s.name.endswith("_total")]
    assert turns == [2.0]
    assert "hh_scheduler_wait_seconds" in fams and "hh_transcript_divergences" in fams
    assert not [n for n in fams if n.startswith("hyperharness_")], "old names are gone"


async def test_grafana_dashboard_names_exist() -> None:
    """Every series the Grafana dashboard queries is one the proxy exposes (ours, the scheduler's, the
    re-exported vLLM ones, the router's)."""
    import json
    import re
    from pathlib import Path

    from proxy.metrics import Metrics
    from proxy.quirks import QuirkLog
    from proxy.routing.router import RoutingMetrics
    from proxy.scheduler.metrics import SchedulerMetrics

    m = Metrics()
    SchedulerMetrics(m.registry)
    RoutingMetrics(m.registry)
    QuirkLog(m.registry)
    ours = {f.name for f in m.registry.collect()} | set(VLLM_REEXPORTED)
    board = json.loads((Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/hyperharness.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"\b(?:vllm:|hh_)\w+", e)}
    assert used and not used - ours, sorted(used - ours)
