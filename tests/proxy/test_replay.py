"""The replay benchmark's mechanics against the fake engine and toy format: client echo styles, tool
results, side requests, compaction, and the accounting (no divergence through the proxy)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from proxy.app import create_app
from backend.tools.replay import bundled_traces, echo, load_trace, replay
from proxy.settings import Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_format import IM_END, ToyFormat, enc
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = pytest.mark.unit


def test_bundled_traces_parse() -> None:
    traces = bundled_traces()
    assert {p.name for p in traces} == {"deepseek_harness.jsonl", "pi.jsonl", "hermes.jsonl"}
    for path in traces:
        events = load_trace(path)
        assert "start" in events[0] and events[0]["start"].get("force")
        assert any("compact" in e for e in events) or path.name == "deepseek_harness.jsonl"


def test_echo_styles() -> None:
    reply = {"content": "x", "reasoning_content": "r", "tool_calls": [{"id": "c"}]}
    assert echo(reply, "faithful")["reasoning_content"] == "r"
    assert echo(reply, "renamed")["reasoning"] == "r"
    assert "reasoning" not in echo(reply, "stripped") and "reasoning_content" not in echo(reply, "stripped")


@pytest.mark.asyncio(loop_scope="session")
async def test_replay_through_proxy_has_no_divergence(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    events = [
        {
            "session": "a",
            "start": {"system": "sys", "user": "go", "client": "stripped", "headers": {"x-session-id": "a"}},
        },
        {"session": "a", "side": {"user": "title?"}},
        {"session": "a", "turn": {"tool_results": ["out"]}},
        {"session": "a", "turn": {"user": "more"}},
        {"session": "a", "compact": {"summary": "so far"}},
        {"session": "a", "turn": {"user": "again"}},
    ]
    trace.write_text("\n".join(json.dumps(e) for e in events))
    fake = FakeVLLM(max_model_len=10_000)
    for text in ['CALL read {"p": 1}', "title", "ok", "fine", "sum", "end"]:
        ids = enc(text) + [IM_END]
        fake.scripts.append((ids, [""] * len(ids), "stop"))
    async with fake_vllm_server(fake) as upstream:
        app = create_app(Settings(upstream=upstream, model_name="m"), fmt=ToyFormat(), store=MemoryStore())
        async with serve_app(app) as url:
            out = io.StringIO()
            summary = await replay([trace], url, None, gap_s=0, warmup=False, out=out)
    totals = summary["t.jsonl"]["proxy"]
    assert totals["diverged"] == 0 and totals["seen"] > 0
    assert "compact" in out.getvalue()
