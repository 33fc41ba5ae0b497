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
