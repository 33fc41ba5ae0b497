"""Request quirks (proxy/quirks.py): each named function on the shapes the harnesses were seen sending,
then the hooks in the app against a fake vLLM (probes, /v1/files, whole-context max_tokens, priority)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from proxy import quirks
from proxy.admission import Priority
from proxy.app import create_app
from proxy.settings import Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_format import IM_END, ToyFormat, enc
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.unit]
aio = pytest.mark.asyncio(loop_scope="session")

KEY = "sk-quirks"
USER = {"role": "user", "content": "hi"}


# --- harness identity -------------------------------------------------------------------

@pytest.mark.parametrize("headers, harness", [
    ({"x-harness": "Pi"}, "pi"),
    ({"x-harness": "random-" + "x" * 40}, "other"),
    ({"user-agent": "deepseek-harness/0.2.1-rc.2 (+https://github.com/deepseek-ai/deepseek-harness)"}, "dsh"),
    ({"x-deepseek-harness-session-id": "s"}, "dsh"),
    ({"user-agent": "OpenAI/Python 2.24.0"}, "unknown"),
    ({}, "unknown"),
])
def test_identify_harness(headers: dict[str, str], harness: str) -> None:
    assert quirks.identify_harness(headers) == harness


# --- priority classes --------------------------------------------------------------------------------

def test_priority_background_for_compaction_and_summaries() -> None:
    assert quirks.priority_class({"x-deepseek-harness-compact": "1"}, {}, None) == Priority.BACKGROUND
    pi_summary = {"messages": [{"role": "system", "content": "You are a context summarization assistant. ..."},
                               USER]}
    assert quirks.priority_class({}, pi_summary, None) == Priority.BACKGROUND
    title = {"system": [{"type": "text", "text": "Generate a title for this session in five words."}]}
    assert quirks.priority_class({}, title, None) == Priority.BACKGROUND
    dsh_title = {"messages": [{"role": "system", "content": "Create a concise title for an AI coding-assistant"
                                                            " session from the supplied human messages.\nReturn"},
                              USER]}
    assert quirks.priority_class({}, dsh_title, None) == Priority.BACKGROUND
    assert quirks.priority_class({}, {"messages": [{"role": "system", "content": "You are a coding agent.\n"
                                                   "Give each file a title."}, USER]}, None) == Priority.INTERACTIVE


def test_priority_subagent_and_explicit() -> None:
    assert quirks.priority_class({}, {"messages": [USER]}, "parent") == Priority.SUBAGENT
    assert quirks.priority_class({}, {"messages": [USER]}, None) == Priority.INTERACTIVE
    assert quirks.priority_class({quirks.PRIORITY_HEADER: "background"}, {}, None) == Priority.BACKGROUND
    assert quirks.priority_class({quirks.PRIORITY_HEADER: "urgent!"}, {}, None) == Priority.INTERACTIVE


# --- thinking switch ----------------------------------------------------------------------------------

@pytest.mark.parametrize("body, switch", [
    ({}, None),
    ({"reasoning_effort": "medium"}, True),  # Pi
    ({"reasoning_effort": "none", "think": False}, False),  # Hermes with reasoning off
    ({"reasoning_effort": "high", "think": False}, False),  # `think` is the more specific switch
    ({"thinking": {"type": "enabled"}}, True),  # DSH (no budget: vLLM's /v1/messages refuses it)
    ({"thinking": {"type": "disabled"}, "reasoning_effort": "high"}, False),
    ({"output_config": {"effort": "low"}}, True),  # DSH Anthropic route
    ({"reasoning": {"effort": "minimal"}}, False),  # OpenRouter style
    ({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"}, False),
])
def test_thinking_switch(body: dict[str, Any], switch: bool | None) -> None:
    assert quirks.thinking_switch(body) is switch


# --- payload, max_tokens, files, probes ----------------------------------------------------------------

def test_drop_harness_payload() -> None:
    body = {"messages": [USER], "dsh_session_log": {"events": ["x"] * 1000}, "dsh_plugin_packages": []}
    assert quirks.drop_harness_payload(body)
    assert body == {"messages": [USER]}
    assert not quirks.drop_harness_payload(body)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_whole_context_max_tokens(field: str) -> None:
    body = {field: 65536}
    assert quirks.whole_context_max_tokens(body, 65536)
    assert field not in body
    body = {field: 13107}  # Pi's summary on an 8K model: more than the room, less than the window
    assert not quirks.whole_context_max_tokens(body, 65536)
    assert body == {field: 13107}


def test_files_refused_is_a_clear_400() -> None:
    exc = quirks.files_refused()
    assert exc.status == 400
    assert exc.body()["error"]["code"] == "files_not_supported"
    assert "inline" in exc.message


def test_probe_answers() -> None:
    assert quirks.probe_answer("/version", "0.32.0") == (200, {"version": "0.32.0"})
    for path in ("/api/v1/models", "/api/tags", "/props", "/v1/props"):
        status, body = quirks.probe_answer(path, "0.32.0")
        assert status == 404 and "vLLM-compatible" in body["error"]["message"]


# --- hooked into the app ----------------------------------------------------------------------------------

@dataclass
class Env:
    url: str
    fake: FakeVLLM
    app: Any

    def say(self, text: str) -> None:
        ids = enc(text) + [IM_END]
        self.fake.scripts.append((ids, [chr(i) if i < 2**21 else "" for i in ids], "stop"))


@pytest_asyncio.fixture(loop_scope="session")
async def env() -> AsyncIterator[Env]:
    fake = FakeVLLM(max_model_len=400)
    async with fake_vllm_server(fake) as upstream_url:
        app = create_app(Settings(upstream=upstream_url, model_name="hh", api_key=KEY), fmt=ToyFormat(),
                         store=MemoryStore())
        async with serve_app(app) as url:
            yield Env(url, fake, app)


@aio
async def test_probes_answered_locally(env: Env) -> None:
    async with httpx.AsyncClient(base_url=env.url, headers={"authorization": "Bearer " + KEY}) as c:
        assert (await c.get("/version")).json() == {"version": "0.32.0"}
        for path in ("/api/v1/models", "/api/tags", "/props", "/v1/props"):
            r = await c.get(path)
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "not_found"
        assert (await c.get("/version", headers={"authorization": "Bearer wrong"})).status_code == 401


@aio
async def test_files_refused_through_app(env: Env) -> None:
    async with httpx.AsyncClient(base_url=env.url, headers={"authorization": "Bearer " + KEY}) as c:
        r = await c.post("/v1/files", files={"file": ("a.png", b"\x89PNG", "image/png")}, data={"purpose": "vision"})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "files_not_supported"
        assert (await c.get("/v1/files/file-1")).status_code == 400
    assert not [r for r in env.fake.requests if "file" in str(r)]


@aio
async def test_hermes_whole_context_request_is_served(env: Env) -> None:
    """Hermes' `max_tokens` = the whole window would be a 400 from vLLM; here it gets the room left."""
    env.say("ok")
    body = {"model": "hh", "messages": [USER], "max_tokens": 400, "reasoning_effort": "none", "think": False}
    headers = {"authorization": "Bearer " + KEY, "x-harness": "hermes", "x-session-id": "hermes-1"}
    async with httpx.AsyncClient(base_url=env.url) as c:
        r = await c.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ok"
    sent = env.fake.requests[-1]
    assert sent["max_tokens"] == 400 - len(sent["prompt"])
    info = env.app.state.services.quirk_log.recent[-1]
    assert (info.harness, info.session.key, info.priority) == ("hermes", "h:hermes-1", Priority.INTERACTIVE)
    assert "whole_context_max_tokens" in info.quirks


@aio
async def test_quirk_counters_in_metrics(env: Env) -> None:
    env.say("ok")
    summary = {"model": "hh", "max_tokens": 5, "messages": [
        {"role": "system", "content": "You are a context summarization assistant."}, USER]}
    async with httpx.AsyncClient(base_url=env.url, headers={"authorization": "Bearer " + KEY}) as c:
        assert (await c.post("/v1/chat/completions", json=summary, headers={"x-harness": "pi"})).status_code == 200
        text = (await c.get("/metrics")).text
    series = ('hh_harness_requests_total'
              '{harness="pi",priority="background",session_source="fingerprint"}')
    assert series in text
