"""The chat pipeline with the real Qwen3.x format (Qwen3.6 vocabulary) against a fake engine that
"generates" chosen ids: reasoning and parallel tool calls parsed out, and every client variant
(faithful, reasoning stripped, reasoning renamed, arguments re-serialized) keeps the next prompt an
exact extension of prompt + output."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from proxy.app import create_app
from proxy.format.qwen3x import Qwen3xFormat
from proxy.format.tokenizer import TiktokenTokenizer
from proxy.settings import Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.unit, pytest.mark.asyncio(loop_scope="session")]

KEY = "k"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    }
]
CALLS = (
    "<tool_call>\n<function=read>\n<parameter=path>\na.py\n</parameter>\n<parameter=limit>\n5\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=read>\n<parameter=path>\nb.py\n</parameter>\n</function>\n"
    "</tool_call>"
)


@pytest.fixture(scope="module")
def qwen() -> Qwen3xFormat:
    return Qwen3xFormat(TiktokenTokenizer.qwen36())


@pytest_asyncio.fixture(loop_scope="session")
async def env(qwen: Qwen3xFormat) -> AsyncIterator[tuple[FakeVLLM, openai.AsyncOpenAI]]:
    fake = FakeVLLM(max_model_len=65536)
    async with fake_vllm_server(fake) as upstream:
        app = create_app(Settings(upstream=upstream, model_name="q", api_key=KEY), fmt=qwen, store=MemoryStore())
        async with serve_app(app) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            yield fake, client
            await client.close()


def script(fake: FakeVLLM, qwen: Qwen3xFormat, text: str) -> list[int]:
    ids = qwen.tokenizer.encode(text) + sorted(qwen.stop_token_ids)
    fake.scripts.append((ids, [qwen.tokenizer.decode([i]) for i in ids], "stop"))
    return ids


def echo(msg: Any, variant: str) -> dict[str, Any]:
    """The assistant message as a given kind of client sends it back."""
    out: dict[str, Any] = {"role": "assistant", "content": msg.content}
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    if variant == "faithful" and reasoning is not None:
        out["reasoning_content"] = reasoning
    if variant == "renamed" and reasoning is not None:
        out["reasoning"] = reasoning
    if msg.tool_calls:
        out["tool_calls"] = []
        for c in msg.tool_calls:
            args = c.function.arguments
            if variant == "reserialized":
                args = json.dumps(json.loads(args), sort_keys=True, separators=(",", ":"))
            out["tool_calls"].append(
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
            )
    return out


@pytest.mark.parametrize("variant", ["faithful", "stripped", "renamed", "reserialized"])
@pytest.mark.parametrize("thinking", [True, False])
async def test_agent_loop_append_only(env: Any, qwen: Qwen3xFormat, variant: str, thinking: bool) -> None:
    fake, client = env
    session = {"x-session-id": f"{variant}-{thinking}"}
    extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Read a.py and b.py"},
    ]
    think = "I should read both files.\n</think>\n\n" if thinking else ""
    outputs = [think + "Reading both." + "\n\n" + CALLS, think + "Both files are short.", think + "Done."]
    prev: list[int] | None = None
    for turn, text in enumerate(outputs):
        gen = script(fake, qwen, text)
        r = await client.chat.completions.create(
            model="q", messages=messages, tools=TOOLS, extra_headers=session, extra_body=extra, temperature=0
        )
        prompt = list(fake.requests[-1]["prompt"])
        if prev is not None:
            assert prompt[: len(prev)] == prev, f"turn {turn}: prompt does not extend the previous one"
        prev = prompt + gen
        msg = r.choices[0].message
        if turn == 0:
            assert r.choices[0].finish_reason == "tool_calls"
            calls = msg.tool_calls or []
            assert [json.loads(c.function.arguments) for c in calls] == [{"path": "a.py", "limit": 5}, {"path": "b.py"}]
            assert [c.index for c in calls] == [0, 1] if hasattr(calls[0], "index") else True
            if thinking:
                assert (msg.model_extra or {})["reasoning_content"] == "I should read both files.\n"
                assert (msg.model_extra or {})["reasoning"] == "I should read both files.\n"
            messages.append(echo(msg, variant))
            messages += [
                {"role": "tool", "tool_call_id": c.id, "content": f"contents of {i}"} for i, c in enumerate(calls)
            ]
        else:
            messages.append(echo(msg, variant))
            messages.append({"role": "user", "content": f"next {turn}"})


async def test_streamed_tool_calls_are_incremental(env: Any, qwen: Qwen3xFormat) -> None:
    fake, client = env
    script(fake, qwen, "ok\n</think>\n\n" + CALLS)
    stream = await client.chat.completions.create(
        model="q", messages=[{"role": "user", "content": "go"}], tools=TOOLS, stream=True
    )
    calls: dict[int, dict[str, str]] = {}
    reasoning = ""
    finish = None
    async for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "args": ""})
            entry["id"] += tc.id or ""
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["args"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == "ok\n"
    assert [json.loads(c["args"]) for c in calls.values()] == [{"path": "a.py", "limit": 5}, {"path": "b.py"}]
    assert all(c["id"].startswith("call_") and c["name"] == "read" for c in calls.values())
    assert finish == "tool_calls"
