"""The operator view's accounting, fast (fake vLLM, toy format, in-process proxy): a client that drops the
previous reply's reasoning counts as restored reasoning, one that sends it back does not; an edited
history is a divergence with its reason; the board is bounded; /dashboard/state shows session labels,
never session ids; and `top`'s frame, rendered from that state, shows the same numbers."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
import pytest_asyncio
from rich.console import Console

from backend.top import fmt_int, fmt_pct, render
from proxy.app import create_app
from proxy.format.base import Delta, OutputParser, ParsedOutput
from proxy.observe import session_label
from proxy.settings import Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_format import IM_END, ToyFormat, enc
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.unit, pytest.mark.asyncio(loop_scope="session")]

KEY = "sk-view"


class ReasoningParser(OutputParser):
    """The toy parser, with reasoning in every reply (the toy format has none of its own)."""

    def __init__(self, inner: OutputParser) -> None:
        self.inner = inner

    def feed(self, token_ids: Sequence[int]) -> list[Delta]:
        return self.inner.feed(token_ids)

    def finish(self) -> list[Delta]:
        return self.inner.finish()

    def result(self) -> ParsedOutput:
        return dataclasses.replace(self.inner.result(), reasoning="thinking it over")


class ReasoningFormat(ToyFormat):
    def parser(self, **kwargs: Any) -> OutputParser:  # type: ignore[override]
        return ReasoningParser(super().parser(**kwargs))


@pytest_asyncio.fixture(loop_scope="session")
async def proxy() -> AsyncIterator[tuple[str, FakeVLLM, Any]]:
    fake = FakeVLLM(max_model_len=400, cached_tokens=3)
    async with fake_vllm_server(fake) as upstream_url:
        app = create_app(Settings(upstream=upstream_url, model_name="hh", api_key=KEY), fmt=ReasoningFormat(),
                         store=MemoryStore())
        async with serve_app(app) as url:
            yield url, fake, app


async def test_restored_reasoning_divergence_and_top(proxy: tuple[str, FakeVLLM, Any]) -> None:
    url, fake, app = proxy
    auth = {"authorization": f"Bearer {KEY}"}
    h = {**auth, "x-session-id": "very-secret-session", "x-harness": "hermes"}
    sys_, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    async with httpx.AsyncClient() as c:
        async def turn(messages: list[dict[str, Any]], say: str) -> None:
            fake.scripts.append(([*enc(say), IM_END], [*say, ""], "stop"))
            r = await c.post(url + "/v1/chat/completions", headers=h, json={"model": "m", "messages": messages})
            r.raise_for_status()

        await turn([sys_, user], "one")
        stripped = [sys_, user, {"role": "assistant", "content": "one"}, {"role": "user", "content": "go"}]
        await turn(stripped, "two")  # Hermes strips the reasoning: restored from the transcript
        kept = [*stripped, {"role": "assistant", "content": "two", "reasoning_content": "thinking it over"},
                {"role": "user", "content": "on"}]
        await turn(kept, "three")  # sent back with its reasoning: nothing to restore
        edited = [sys_, {"role": "user", "content": "hi, edited"}, {"role": "assistant", "content": "one"},
                  {"role": "user", "content": "go"}]
        await turn(edited, "four")
        state = (await c.get(url + "/dashboard/state", headers=auth)).json()
        metrics = (await c.get(url + "/metrics", headers=auth)).text
    assert "very-secret-session" not in str(state) and "very-secret-session" not in metrics
    (s,) = state["sessions"]
    assert s["label"] == session_label("h:very-secret-session") and s["harness"] == "hermes"
    assert s["turns"] == 4 and s["restored_reasoning"] == 1
    assert [t["restored_reasoning"] for t in s["history"]] == [False, True, False, False]
    assert s["divergences"] == {"history_edited": 1} and s["history"][3]["divergence"] == "history_edited"
    prompts = [len(r["prompt"]) for r in fake.requests[-4:]]
    assert [t["prompt"] for t in s["history"]] == prompts
    assert all(t["cached"] + t["reprefilled"] + t["new"] == t["prompt"] for t in s["history"])
    assert s["history"][3]["reprefilled"] > 0, "the edit forces tokens sent before to be prefilled again"
    assert 'hh_reasoning_restored_total{harness="hermes"} 1.0' in metrics

    console = Console(width=300, record=True, color_system=None)
    console.print(render(state))
    frame = console.export_text()
    row = next(line for line in frame.splitlines() if s["label"] in line)
    for value in (fmt_int(s["turns"]), fmt_pct(s["cache_pct"]), f"{s['cached']} / {s['reprefilled']} / {s['new']}",
                  "history_edited ×1", fmt_int(s["restored_reasoning"])):
        assert value in row, (value, row)

    # The board keeps the most recent sessions only.
    view = app.state.services.observer
    view.keep_sessions = 2
    async with httpx.AsyncClient() as c:
        for i in range(3):
            fake.scripts.append(([*enc("x"), IM_END], ["x", ""], "stop"))
            r = await c.post(url + "/v1/chat/completions", headers={**auth, "x-session-id": f"s{i}"},
                             json={"model": "m", "messages": [sys_, user]})
            r.raise_for_status()
    assert [x["label"] for x in view.state()["sessions"]] == [session_label("h:s2"), session_label("h:s1")]


async def test_state_answers_with_the_engine_down() -> None:
    """No engine behind the proxy: the page still answers at once and shows the engine as down."""
    import socket
    import time

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
    app = create_app(Settings(upstream=dead, model_name="hh", api_key=KEY), fmt=ReasoningFormat(), store=MemoryStore())
    async with serve_app(app) as url, httpx.AsyncClient() as c:
        started = time.monotonic()
        state = (await c.get(url + "/dashboard/state", headers={"authorization": f"Bearer {KEY}"})).json()
        assert time.monotonic() - started < 5
    sock.close()
    (engine,) = state["engines"]
    assert engine["name"] == "engine-0" and engine["up"] is False and engine["error"]
    assert state["sessions"] == []


async def test_engine_view_hybrid_pool_and_spec_decode() -> None:
    """A hybrid engine's page (state pages per seat from the runtime config) with speculative decoding:
    the view shows pool tokens, state pages in use and the acceptance rate from vLLM's own counters."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from proxy.admission import Priority
    from proxy.metrics import Metrics
    from proxy.observe import Observer
    from proxy.scheduler import Scheduler
    from proxy.settings import EngineGeometry

    r = CollectorRegistry()
    lab = ["model_name", "engine"]
    info = Gauge("vllm:cache_config_info", "x", ["num_gpu_blocks", "block_size", "mamba_cache_mode"], registry=r)
    info.labels("1000", "384", "align").set(1)
    Gauge("vllm:num_requests_running", "x", lab, registry=r).labels("m", "0").set(2)
    Gauge("vllm:kv_cache_usage_perc", "x", lab, registry=r).labels("m", "0").set(0.125)
    Counter("vllm:spec_decode_num_drafts", "x", lab, registry=r).labels("m", "0").inc(100)
    Counter("vllm:spec_decode_num_draft_tokens", "x", lab, registry=r).labels("m", "0").inc(700)
    Counter("vllm:spec_decode_num_accepted_tokens", "x", lab, registry=r).labels("m", "0").inc(420)
    page = generate_latest(r).decode()

    async def get_text(path: str) -> str:
        return page

    geometry = EngineGeometry(seats=4, gdn_groups=3, state_slots_per_seat=9)
    view = Observer(Metrics())
    src = view.engine("gpu-0", "http://engine")
    tapped = src.tap(get_text)  # as the app wires it: the scheduler's reads feed the view
    src.scheduler = Scheduler(engine=geometry, read_metrics_text=lambda: tapped("/metrics"))
    await src.scheduler.refresh()
    (e,) = view.state()["engines"]
    pool = e["pool"]
    assert pool["kv_tokens"] == 1000 * 384 and pool["kv_tokens_used"] == 1000 * 384 // 8
    assert pool["kv_usage_pct"] == 12.5 and pool["seats"] == 4 and pool["seats_used"] == 2
    assert pool["state_pages_per_seat"] == geometry.state_blocks_per_seat == 27
    assert pool["state_pages"] == 4 * 27 and pool["state_pages_used"] == 2 * 27
    assert e["queue"] == {p.label: 0 for p in Priority}
    assert e["spec_decode"]["acceptance_pct"] == 60.0 and e["spec_decode"]["mean_acceptance_length"] == 5.2
    frame_console = Console(width=300, record=True, color_system=None)
    frame_console.print(render(view.state()))
    frame = frame_console.export_text()
    assert "60.0% · mean length 5.20" in frame and "54 / 108 (27/seat)" in frame
