"""Anthropic Messages on the turn path (proxy/wire/anthropic.py): request translation, the writer of a
turn's typed events, then
`/v1/messages` end to end through the official anthropic SDK against a fake vLLM and a toy format,
streamed and not, including a two-turn tool loop that must splice (append-only prompt)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from proxy.app import create_app
from proxy.errors import InvalidRequest
from proxy.format.base import Delta, DeltaKind, ParsedOutput, ToolCall
from proxy.reply import FinalEvent, Usage, assistant_message
from proxy.settings import Settings
from proxy.wire import anthropic as am
from proxy.store.memory import MemoryStore
from tests.proxy.fake_format import IM_END, ToyFormat, enc
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

anthropic_sdk = pytest.importorskip("anthropic")

pytestmark = [pytest.mark.unit]
aio = pytest.mark.asyncio(loop_scope="session")
KEY = "sk-anthropic"
TOOL = {"name": "read", "description": "Read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


# --- translation ------------------------------------------------------------------------------------

def test_request_translation_dsh_shape() -> None:
    body = {
        "model": "deepseek-flash", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "You are a coding agent."}],
        "thinking": {"type": "enabled"}, "output_config": {"effort": "high"},
        "tools": [TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "tool_choice": {"type": "auto"}, "stop_sequences": ["END"], "dsh_session_log": {"sessionId": "s"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "read a.py"},
                                         {"type": "text", "text": "\n<runtime-context>cwd=/x</runtime-context>"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "need the file", "signature": ""},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "x = 1"}]},
                {"type": "text", "text": "and now?"}]},
        ],
    }
    chat = am.to_chat_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "read a.py\n<runtime-context>cwd=/x</runtime-context>"},
        {"role": "assistant", "content": "Reading.", "reasoning_content": "need the file", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "x = 1"},
        {"role": "user", "content": "and now?"},
    ]
    assert [t["function"]["name"] for t in chat["tools"]] == ["read"]  # the server tool is dropped
    assert chat["tools"][0]["function"]["parameters"] == TOOL["input_schema"]
    assert chat["tool_choice"] == "auto" and chat["stop"] == ["END"] and chat["max_tokens"] == 32000
    assert chat["thinking"] == {"type": "enabled"} and chat["dsh_session_log"] == {"sessionId": "s"}
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("choice, expected", [
    ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "read"}, {"type": "function", "function": {"name": "read"}}),
])
def test_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    chat = am.to_chat_request({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": choice})
    assert chat["tool_choice"] == expected


def test_disable_parallel_tool_use_and_named_stop_reason() -> None:
    choice = {"type": "tool", "name": "read", "disable_parallel_tool_use": True}
    chat = am.to_chat_request({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": choice})
    assert chat["parallel_tool_calls"] is False
    # A forced named call finishes with "stop" on the OpenAI side; Anthropic says tool_use.
    final = _final(ParsedOutput(None, None, (ToolCall("c", "read", "{}"),)), "stop", Usage(1, 1, 0))
    assert am.to_message(final, "hh")["stop_reason"] == "tool_use"
    s = am.MessageStream("hh", 1)
    s.deltas([Delta(DeltaKind.TOOL_CALL, index=0, id="c", name="read"), Delta(DeltaKind.ARGUMENTS, "{}")])
    assert json.loads(s.end(final)[-2].split(b"data: ")[1])["delta"]["stop_reason"] == "tool_use"


def _final(parsed: ParsedOutput, finish: str, usage: Usage, tail: list[Delta] | None = None) -> FinalEvent:
    return FinalEvent(finish=finish, reply=assistant_message(parsed), parsed=parsed, tail=tail or [], generated=[],
                      usage=usage)


@pytest.mark.parametrize("body", [
    {"messages": []}, {"messages": [{"role": "system", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "no id"}]}]},
    {"messages": [{"role": "user", "content": 5}]},
])
def test_bad_requests_are_400(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        am.to_chat_request(body)


def test_tool_result_error_flag() -> None:
    chat = am.to_chat_request({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}]}]})
    assert chat["messages"] == [{"role": "tool", "tool_call_id": "t", "content": "Error: boom"}]


def test_response_translation() -> None:
    parsed = ParsedOutput("Reading.", "hmm", (ToolCall("call_1", "read", '{"path":"a"}'),))
    msg = am.to_message(_final(parsed, "tool_calls", Usage(100, 9, 64)), "hh")
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][2]["input"] == {"path": "a"}
    assert msg["stop_reason"] == "tool_use"
    assert msg["usage"] == {"input_tokens": 36, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 64,
                            "output_tokens": 9}


def _events(raw: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for item in raw:
        for block in item.decode().strip().split("\n\n"):
            name, data = block.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_stream_translation_blocks() -> None:
    s = am.MessageStream("hh", 10)
    out = [s.start()]
    for deltas in (
        [Delta(DeltaKind.REASONING, "th")],
        [Delta(DeltaKind.REASONING, "ink"), Delta(DeltaKind.CONTENT, "Hi")],
        [Delta(DeltaKind.TOOL_CALL, index=0, id="c1", name="read")],
        [Delta(DeltaKind.ARGUMENTS, '{"path":"a"}', index=0)],
        [Delta(DeltaKind.TOOL_CALL, index=1, id="c2", name="read")],
    ):
        out += s.deltas(deltas)
    # The second call's arguments were not streamed: they come in the final event's tail.
    parsed = ParsedOutput("Hi", "think", (ToolCall("c1", "read", '{"path":"a"}'), ToolCall("c2", "read", "{}")))
    out += s.end(_final(parsed, "tool_calls", Usage(10, 5, 4), tail=[Delta(DeltaKind.ARGUMENTS, "{}", index=1)]))
    names = [n for n, _ in _events(out)]
    assert names == ["message_start",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
                     "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    events = _events(out)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert events[-2][1]["usage"]["cache_read_input_tokens"] == 4
    assert events[9][1]["content_block"]["name"] == "read"
    assert events[13][1]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}


# --- /v1/messages end to end ----------------------------------------------------------------------------

@dataclass
class Env:
    fake: FakeVLLM
    client: Any

    def say(self, text: str) -> None:
        ids = enc(text) + [IM_END]
        self.fake.scripts.append((ids, [chr(i) if i < 2**21 else "" for i in ids], "stop"))


@pytest_asyncio.fixture(loop_scope="session")
async def env() -> AsyncIterator[Env]:
    fake = FakeVLLM(max_model_len=2000, cached_tokens=3)
    async with fake_vllm_server(fake) as upstream_url:
        app = create_app(Settings(upstream=upstream_url, model_name="hh", api_key=KEY), fmt=ToyFormat(),
                         store=MemoryStore())
        async with serve_app(app) as url:
            client = anthropic_sdk.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
            yield Env(fake, client)
            await client.close()


HEADERS = {"x-deepseek-harness-session-id": "dsh-s1"}


@aio
async def test_messages_non_streaming(env: Env) -> None:
    env.say("hello")
    msg = await env.client.messages.create(model="deepseek-flash", max_tokens=50, system="be brief",
                                           messages=[{"role": "user", "content": "hi"}], extra_headers=HEADERS)
    assert msg.content[0].text == "hello"
    assert msg.stop_reason == "end_turn"
    assert msg.usage.cache_read_input_tokens == 3


@aio
async def test_messages_stream_and_tool_loop_splices(env: Env) -> None:
    env.say('CALL read {"path": "a.py"}')
    sent = {"model": "m", "max_tokens": 50, "system": "be brief", "tools": [TOOL],
            "thinking": {"type": "enabled"}, "extra_headers": {"x-deepseek-harness-session-id": "dsh-loop"}}
    history: list[dict[str, Any]] = [{"role": "user", "content": "read a.py"}]
    async with env.client.messages.stream(messages=history, **sent) as stream:
        first = await stream.get_final_message()
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert (call.name, call.input) == ("read", {"path": "a.py"})
    first_prompt = list(env.fake.requests[-1]["prompt"])
    history += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "x = 1"}]}]
    env.say("done")
    async with env.client.messages.stream(messages=history, **sent) as stream:
        text = await stream.get_final_text()
    assert text == "done"
    second_prompt = list(env.fake.requests[-1]["prompt"])
    generated = enc('CALL read {"path": "a.py"}') + [IM_END]
    assert second_prompt[: len(first_prompt) + len(generated)] == first_prompt + generated  # append-only


@aio
async def test_messages_errors_in_anthropic_shape(env: Env) -> None:
    with pytest.raises(anthropic_sdk.BadRequestError) as info:
        await env.client.messages.create(model="m", max_tokens=5, messages=[])
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    async with httpx.AsyncClient() as c:
        r = await c.post(str(env.client.base_url).rstrip("/") + "/v1/messages", content=b"{",
                         headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"


@aio
async def test_count_tokens(env: Env) -> None:
    r = await env.client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}])
    assert r.input_tokens == len(ToyFormat().render([{"role": "user", "content": "hi"}]).ids)
