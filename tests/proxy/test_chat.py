"""The chat pipeline end to end against a fake vLLM and a toy format, through the official openai SDK:
output shape (streaming and not), splicing, divergence accounting, errors, no transcript on failure."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from proxy.app import create_app
from proxy.settings import Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_format import IM_END, ToyFormat, enc
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.unit, pytest.mark.asyncio(loop_scope="session")]

KEY = "sk-chat"


@dataclass
class Env:
    url: str
    fake: FakeVLLM
    store: MemoryStore
    client: openai.AsyncOpenAI

    def say(self, text: str, finish: str = "stop") -> None:
        ids = enc(text) + ([IM_END] if finish == "stop" else [])
        self.fake.scripts.append((ids, [chr(i) if i < 2**21 else "" for i in ids], finish))

    def prompt(self, i: int = -1) -> list[int]:
        return list(self.fake.requests[i]["prompt"])


@pytest_asyncio.fixture(loop_scope="session")
async def env() -> AsyncIterator[Env]:
    fake = FakeVLLM(max_model_len=400, cached_tokens=7)
    store = MemoryStore()
    async with fake_vllm_server(fake) as upstream_url:
        settings = Settings(upstream=upstream_url, model_name="hh", api_key=KEY)
        async with serve_app(create_app(settings, fmt=ToyFormat(), store=store)) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            yield Env(url, fake, store, client)
            await client.close()


SYS = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "hi"}
H = {"x-session-id": "s1"}


async def test_non_streaming(env: Env) -> None:
    env.say("hello")
    r = await env.client.chat.completions.create(model="any", messages=[SYS, USER], extra_headers=H)
    assert r.choices[0].message.content == "hello"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == 7
    sent = env.fake.requests[-1]
    assert sent["model"] == "fake-model" and sent["return_token_ids"] is True
    assert sent["stop_token_ids"] == [IM_END]
    assert sent["max_tokens"] == 400 - len(sent["prompt"])  # capped to the room left


async def test_ignore_eos_sends_no_end_of_turn_stop(env: Env) -> None:
    """`ignore_eos` asks for max_tokens tokens; the format's stop ids would end the turn anyway."""
    env.say("hello")
    await env.client.chat.completions.create(model="any", messages=[SYS, USER], max_tokens=8,
                                             extra_body={"ignore_eos": True}, extra_headers={"x-session-id": "eos"})
    sent = env.fake.requests[-1]
    assert sent["ignore_eos"] is True and "stop_token_ids" not in sent


async def test_streaming_shape(env: Env) -> None:
    env.say("yo")
    stream = await env.client.chat.completions.create(
        model="any",
        messages=[SYS, {"role": "user", "content": "stream"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-session-id": "s-stream"},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "yo"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    async with httpx.AsyncClient() as c:
        env.say("x")
        raw = await c.post(
            env.url + "/v1/chat/completions", headers={"x-api-key": KEY}, json={"messages": [USER], "stream": True}
        )
    assert raw.text.endswith("data: [DONE]\n\n")
    assert raw.headers["x-accel-buffering"] == "no"


async def test_multi_turn_append_only_with_tool_call(env: Env) -> None:
    h = {"x-session-id": "loop"}
    env.say('CALL read {"path": "a.py", "n": 1}')
    r1 = await env.client.chat.completions.create(
        model="m",
        messages=[SYS, USER],
        tools=[{"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}}],
        extra_headers=h,
    )
    msg = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls or []
    assert call.function.name == "read" and call.id.startswith("call_")
    p1, g1 = env.prompt(), enc('CALL read {"path": "a.py", "n": 1}') + [IM_END]
    # The client re-serializes the arguments and drops content; the history still maps.
    echoed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "read", "arguments": '{"n":1,"path":"a.py"}'}}
        ],
    }
    tool = {"role": "tool", "tool_call_id": call.id, "content": "print(1)"}
    env.say("done")
    tools = [{"type": "function", "function": {"parameters": {"properties": {}, "type": "object"}, "name": "read"}}]
    await env.client.chat.completions.create(
        model="m", messages=[SYS, USER, echoed, tool], tools=tools, extra_headers=h
    )
    p2 = env.prompt()
    assert p2[: len(p1) + len(g1)] == p1 + g1
    env.say("bye")
    more = [SYS, USER, echoed, tool, {"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]
    await env.client.chat.completions.create(model="m", messages=more, tools=tools, extra_headers=h)
    p3 = env.prompt()
    assert p3[: len(p2) + 5] == p2 + enc("done") + [IM_END]
    metrics = (await httpx.AsyncClient().get(env.url + "/metrics", headers={"x-api-key": KEY})).text
    assert 'hh_transcript_lookups_total{outcome="hit"} 2.0' in metrics


async def test_divergence_is_counted(env: Env) -> None:
    h = {"x-session-id": "div"}
    env.say("first")
    await env.client.chat.completions.create(model="m", messages=[SYS, USER], extra_headers=h)
    env.say("second")
    edited = [
        SYS,
        {"role": "user", "content": "hi!"},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "go"},
    ]
    await env.client.chat.completions.create(model="m", messages=edited, extra_headers=h)
    async with httpx.AsyncClient() as c:
        metrics = (await c.get(env.url + "/metrics", headers={"x-api-key": KEY})).text
    assert 'hh_transcript_divergences_total{reason="history_edited"} 1.0' in metrics


async def test_overflow_says_maximum_context_length(env: Env) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await env.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 500}])
    assert "maximum context length is 400 tokens" in str(info.value)
    assert info.value.code == "context_length_exceeded"
    env.say("ok")
    r = await env.client.chat.completions.create(model="m", messages=[USER], max_tokens=100000)
    assert r.choices[0].message.content == "ok"  # too-large max_tokens is capped, not an error


async def test_length_finish_then_continue(env: Env) -> None:
    h = {"x-session-id": "len"}
    env.say("abcdef", finish="length")
    r = await env.client.chat.completions.create(model="m", messages=[USER], extra_headers=h)
    assert r.choices[0].finish_reason == "length"
    p1 = env.prompt()
    env.say("z")
    await env.client.chat.completions.create(
        model="m",
        messages=[USER, {"role": "assistant", "content": "abcdef"}, {"role": "user", "content": "go on"}],
        extra_headers=h,
    )
    p2 = env.prompt()
    assert p2[: len(p1) + 7] == p1 + enc("abcdef") + [IM_END]  # the cut turn is closed by the continuation


@pytest.mark.parametrize("status", [400, 500])
async def test_upstream_failure_writes_no_transcript(env: Env, status: int) -> None:
    h = {"x-session-id": f"fail{status}"}
    env.fake.fail_with = status
    try:
        with pytest.raises(openai.APIStatusError) as info:
            await env.client.chat.completions.create(model="m", messages=[USER], extra_headers=h)
    finally:
        env.fake.fail_with = None
    assert info.value.status_code == (400 if status == 400 else 502)
    assert await env.store.load(f"h:fail{status}") == []


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "wizard", "content": "x"}]},
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
        },
        {"messages": "nope"},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
    ],
)
async def test_bad_input_is_openai_400(env: Env, body: dict) -> None:  # type: ignore[type-arg]
    async with httpx.AsyncClient() as c:
        r = await c.post(env.url + "/v1/chat/completions", headers={"x-api-key": KEY}, json=body)
        bad_json = await c.post(env.url + "/v1/chat/completions", headers={"x-api-key": KEY}, content=b"{")
    for resp in (r, bad_json):
        assert resp.status_code == 400, resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


async def test_return_token_ids_both_ways(env: Env) -> None:
    h = {"x-session-id": "ids"}
    env.say("hey")
    r = await env.client.chat.completions.create(
        model="m", messages=[USER], extra_headers=h, extra_body={"return_token_ids": True}
    )
    extra = r.model_extra or {}
    assert extra["prompt_token_ids"] == env.prompt()
    assert (r.choices[0].model_extra or {})["token_ids"] == enc("hey") + [IM_END]
    env.say("ho")
    stream = await env.client.chat.completions.create(
        model="m",
        messages=[USER, {"role": "assistant", "content": "hey"}, {"role": "user", "content": "again"}],
        extra_headers=h,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = [c async for c in stream]
    assert (chunks[0].model_extra or {})["prompt_token_ids"] == env.prompt()
    fin = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert (fin.choices[0].model_extra or {})["token_ids"] == enc("ho") + [IM_END]
    assert env.prompt()[: len(extra["prompt_token_ids"]) + 4] == extra["prompt_token_ids"] + enc("hey") + [IM_END]


class RecordingAdmission:
    def __init__(self) -> None:
        self.footprints: list[Any] = []
        self.released = 0

    def try_acquire(self, footprint: Any) -> Any:
        return None  # every turn takes the waiting path, which this test watches

    async def acquire(self, footprint: Any) -> Any:
        self.footprints.append(footprint)
        outer = self

        class Ticket:
            def release(self) -> None:
                outer.released += 1

        return Ticket()


async def test_admission_seam_and_client_disconnect() -> None:
    import asyncio

    fake = FakeVLLM(max_model_len=1000, delay_s=0.05)
    admission = RecordingAdmission()
    store = MemoryStore()
    async with fake_vllm_server(fake) as upstream:
        app = create_app(Settings(upstream=upstream, model_name="m"), fmt=ToyFormat(), store=store, admission=admission)
        async with serve_app(app) as url:
            ids = enc("x" * 40) + [IM_END]
            fake.scripts.append((ids, [""] * len(ids), "stop"))
            async with httpx.AsyncClient() as c:
                async with c.stream(
                    "POST",
                    url + "/v1/chat/completions",
                    headers={"x-session-id": "gone"},
                    json={"messages": [USER], "stream": True, "max_tokens": 50},
                ) as r:
                    async for _ in r.aiter_lines():
                        break  # the client goes away after the first chunk
            for _ in range(100):
                if admission.released and fake.aborted:
                    break
                await asyncio.sleep(0.05)
    (foot,) = admission.footprints
    assert foot.prompt_tokens == len(fake.requests[-1]["prompt"]) and foot.max_tokens == 50
    assert admission.released == 1  # the seat is freed
    assert fake.aborted == 1  # and the engine's stream was dropped (vLLM aborts the request)
    assert await store.load("h:gone") == []  # an unfinished response writes no transcript
