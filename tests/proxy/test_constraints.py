"""response_format / tool_choice / logprobs without an engine: the mapping to vLLM's structured outputs,
the 400s, the JSON tool-call parser, tool-call suppression, logprobs conversion, and the chat pipeline
against a fake vLLM (what is sent upstream, what comes back, the transcript across forced turns)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from proxy import constraints
from proxy.app import create_app
from proxy.wire.openai import ChunkWriter
from proxy.constraints import JsonToolCallParser, ToolChoice, json_tool_outputs, response_format_outputs, tool_choice
from proxy.errors import InvalidRequest
from proxy.format.base import Delta, DeltaKind
from proxy.format.qwen3x import Qwen3xFormat
from proxy.format.tokenizer import TiktokenTokenizer
from proxy.logprobs import LogprobsBuilder
from proxy.settings import Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_format import IM_END, ToyFormat, ToyParser, enc
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.unit]
ASYNC = pytest.mark.asyncio(loop_scope="session")

KEY = "k"
READ = {
    "type": "function",
    "function": {
        "name": "read",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
LS = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [READ, LS]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


# -- mapping ----------------------------------------------------------------------------------


def test_tool_choice_values() -> None:
    assert tool_choice(None, TOOLS) == ToolChoice("auto")
    assert tool_choice("auto", None) == ToolChoice("auto")
    assert tool_choice("none", None) == ToolChoice("none")
    assert tool_choice("required", TOOLS) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "ls"}}
    assert tool_choice(named, TOOLS) == ToolChoice("named", "ls")
    assert tool_choice(named, TOOLS).forced and not tool_choice("none", TOOLS).forced


@pytest.mark.parametrize(
    ("value", "tools", "param"),
    [
        ({"type": "function", "function": {"name": "write"}}, TOOLS, "tool_choice.function.name"),
        ({"type": "function", "function": {"name": "read"}}, None, "tool_choice.function.name"),
        ({"type": "function", "function": {}}, TOOLS, "tool_choice.function.name"),
        ({"type": "function"}, TOOLS, "tool_choice"),
        ("sometimes", TOOLS, "tool_choice"),
        ("required", None, "tool_choice"),
    ],
)
def test_tool_choice_errors(value: Any, tools: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        tool_choice(value, tools)
    assert info.value.status == 400 and info.value.param == param


def test_response_format_mapping() -> None:
    assert response_format_outputs(None) is None
    assert response_format_outputs({"type": "text"}) is None
    assert response_format_outputs({"type": "json_object"}) == {"json_object": True}
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}
    assert response_format_outputs(rf) == {"json": SCHEMA}


@pytest.mark.parametrize(
    "rf",
    [
        "json",
        {"type": "yaml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "obj"}}},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "required": "n"}}},
        {"type": "json_schema", "json_schema": {"schema": {"properties": {"n": {"type": 3}}}}},
        {"type": "json_schema", "json_schema": {"schema": {"anyOf": {"type": "string"}}}},
        {"type": "json_schema", "json_schema": {"schema": {"items": [1]}}},
    ],
)
def test_response_format_errors(rf: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        response_format_outputs(rf)
    assert info.value.param == "response_format"
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_top_logprobs_range() -> None:
    assert constraints.top_logprobs(True, None) == 0
    assert constraints.top_logprobs(True, 20) == 20
    assert constraints.top_logprobs(None, 3) is None
    for bad in (-1, 21):
        with pytest.raises(InvalidRequest) as info:
            constraints.top_logprobs(True, bad)
        assert info.value.param == "top_logprobs"


def test_json_tool_outputs() -> None:
    assert json_tool_outputs(TOOLS, ToolChoice("named", "read")) == {"json": READ["function"]["parameters"]}
    assert json_tool_outputs(TOOLS, ToolChoice("named", "ls")) == {"json": {"type": "object", "properties": {}}}
    schema = json_tool_outputs(TOOLS, ToolChoice("required"), parallel=False)["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["read"], ["ls"]]


@pytest.fixture(scope="module")
def qwen() -> Qwen3xFormat:
    return Qwen3xFormat(TiktokenTokenizer.qwen36())


def test_qwen_structural_tags(qwen: Qwen3xFormat) -> None:
    named = json.loads(qwen.forced_tool_outputs(TOOLS, "read")["structural_tag"])  # type: ignore[index]
    assert named["format"]["type"] == "tag"
    assert named["format"]["begin"] == "<tool_call>\n<function=read>\n"
    assert named["format"]["content"] == {
        "type": "json_schema", "json_schema": READ["function"]["parameters"], "style": "qwen_xml"
    }
    required_tag = qwen.forced_tool_outputs(TOOLS, None, parallel=False)
    required = json.loads(required_tag["structural_tag"])  # type: ignore[index]
    fmt = required["format"]
    assert fmt["type"] == "triggered_tags" and fmt["at_least_one"] and fmt["stop_after_first"]
    assert [t["begin"] for t in fmt["tags"]] == ["<tool_call>\n<function=read>\n", "<tool_call>\n<function=ls>\n"]
    xgr = pytest.importorskip("xgrammar")  # the engine's grammar compiler accepts them
    for tag in (named, required):
        xgr.Grammar.from_structural_tag(json.dumps(tag))
    hermes = Qwen3xFormat(qwen.tokenizer, tool_call_style="json").forced_tool_outputs(TOOLS, "ls")
    xgr.Grammar.from_structural_tag(hermes["structural_tag"])  # type: ignore[index]


# -- parsers --------------------------------------------------------------------------------


def _run(parser: Any, text: str) -> tuple[list[Delta], Any]:
    deltas = []
    for ch in text:
        deltas += parser.feed(enc(ch))
    deltas += parser.finish()
    return deltas, parser.result()


def test_json_parser_named_streams_arguments() -> None:
    parser = JsonToolCallParser(ToyParser(lambda: "x"), ToolChoice("named", "read"), lambda: "call_1")
    deltas, result = _run(parser, ' {"path": "a.py"}')
    assert deltas[0] == Delta(DeltaKind.TOOL_CALL, index=0, id="call_1", name="read")
    assert "".join(d.text for d in deltas[1:]) == ' {"path": "a.py"}'
    assert all(d.kind is DeltaKind.ARGUMENTS for d in deltas[1:])
    assert result.content is None and [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("read", {"path": "a.py"})
    ]


def test_json_parser_required() -> None:
    ids = iter(("c1", "c2"))
    parser = JsonToolCallParser(ToyParser(lambda: "x"), ToolChoice("required"), lambda: next(ids))
    text = '[{"name": "read", "parameters": {"path": "a"}}, {"name": "ls", "parameters": {}}]'
    deltas, result = _run(parser, text)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("c1", "read", {"path": "a"}),
        ("c2", "ls", {}),
    ]
    assert [d.kind for d in deltas] == [DeltaKind.TOOL_CALL, DeltaKind.ARGUMENTS] * 2
    _, broken = _run(JsonToolCallParser(ToyParser(lambda: "x"), ToolChoice("required"), lambda: "c"), '[{"name"')
    assert broken.tool_calls == () and broken.content is None


def test_qwen_parser_suppresses_calls_for_none(qwen: Qwen3xFormat) -> None:
    text = "Let me look.\n\n" + CALL
    ids = qwen.tokenizer.encode(text)
    on = qwen.parser(enable_thinking=False, tools=TOOLS)
    on.feed(ids)
    on.finish()
    assert [c.name for c in on.result().tool_calls] == ["read"]
    off = qwen.parser(enable_thinking=False, tools=TOOLS, tool_calls=False)
    deltas = off.feed(ids) + off.finish()
    assert {d.kind for d in deltas} == {DeltaKind.CONTENT}
    assert "".join(d.text for d in deltas) == "Let me look.\n\n"
    assert off.result().tool_calls == () and off.result().content == "Let me look.\n\n"


# -- logprobs ---------------------------------------------------------------------------------


def test_logprobs_builder(qwen: Qwen3xFormat) -> None:
    tok = qwen.tokenizer
    hello, world = tok.encode("Hello"), tok.encode(" world")
    b = LogprobsBuilder(tok, 1)
    b.add(
        {
            "tokens": [f"token_id:{hello[0]}"],
            "token_logprobs": [-0.5],
            "top_logprobs": [{f"token_id:{hello[0]}": -0.5, f"token_id:{world[0]}": -2.0}],
        },
        hello,
    )
    b.add({"tokens": [f"token_id:{world[0]}"], "token_logprobs": [float("-inf")], "top_logprobs": [None]}, world)
    b.add(None, [])
    assert b.take() == [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"),
         "top_logprobs": [{"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")}]},
        {"token": " world", "logprob": -9999.0, "bytes": list(b" world"), "top_logprobs": []},
    ]
    assert b.take() == [] and len(b.body()["content"]) == 2
    # A token that ends inside a UTF-8 character keeps its own bytes.
    partial = LogprobsBuilder(tok, 0)
    pid = next(i for i in tok.encode("🦜🦩") if not _complete(tok.token_bytes(i)))
    partial.add({"tokens": [f"token_id:{pid}"], "token_logprobs": [-1.0], "top_logprobs": [{}]}, [pid])
    assert partial.entries[0]["bytes"] == list(tok.token_bytes(pid))


def _complete(raw: bytes) -> bool:
    try:
        raw.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_chunk_writer_logprobs() -> None:
    w = ChunkWriter("c", "m", created=1)
    entry = {"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}
    deltas = [Delta(DeltaKind.CONTENT, "a"), Delta(DeltaKind.TOOL_CALL, index=0, id="i", name="f")]
    chunks = [json.loads(line[6:]) for line in w.deltas(deltas, [entry]).split(b"\n\n") if line]
    assert chunks[0]["choices"][0]["logprobs"] == {"content": [entry]}
    assert chunks[1]["choices"][0]["logprobs"] is None
    assert w.deltas([], [entry]) == b""
    fin = json.loads(w.finish("stop", [1, 2], [entry])[6:])
    assert fin["choices"][0]["logprobs"] == {"content": [entry]} and fin["choices"][0]["token_ids"] == [1, 2]
    assert json.loads(w.finish("stop")[6:])["choices"][0]["logprobs"] is None


# -- the pipeline against a fake engine -------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def qenv(qwen: Qwen3xFormat) -> AsyncIterator[tuple[FakeVLLM, openai.AsyncOpenAI, str]]:
    fake = FakeVLLM(max_model_len=65536)
    async with fake_vllm_server(fake) as upstream:
        app = create_app(Settings(upstream=upstream, model_name="q", api_key=KEY), fmt=qwen, store=MemoryStore())
        async with serve_app(app) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            yield fake, client, url
            await client.close()


@pytest_asyncio.fixture(loop_scope="session")
async def toy() -> AsyncIterator[tuple[FakeVLLM, openai.AsyncOpenAI]]:
    fake = FakeVLLM(max_model_len=4000)
    async with fake_vllm_server(fake) as upstream:
        app = create_app(Settings(upstream=upstream, model_name="t", api_key=KEY), fmt=ToyFormat(), store=MemoryStore())
        async with serve_app(app) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            yield fake, client
            await client.close()


def say(fake: FakeVLLM, qwen: Qwen3xFormat, text: str) -> list[int]:
    ids = qwen.tokenizer.encode(text) + sorted(qwen.stop_token_ids)
    fake.scripts.append((ids, [qwen.tokenizer.decode([i]) for i in ids], "stop"))
    return ids


NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
CALL = "<tool_call>\n<function=read>\n<parameter=path>\na.py\n</parameter>\n</function>\n</tool_call>"


@ASYNC
@pytest.mark.parametrize("stream", [False, True])
async def test_named_and_required_qwen(qenv: Any, qwen: Qwen3xFormat, stream: bool) -> None:
    fake, client, _ = qenv
    user = [{"role": "user", "content": "read it"}]
    for choice, finish in (({"type": "function", "function": {"name": "read"}}, "stop"), ("required", "tool_calls")):
        say(fake, qwen, CALL)
        kw: dict[str, Any] = dict(model="q", messages=user, tools=TOOLS, tool_choice=choice, extra_body=NO_THINK)
        if stream:
            chunks = [c async for c in await client.chat.completions.create(**kw, stream=True)]
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            assert calls[0].function.name == "read"
            assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"path": "a.py"}
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
        else:
            r = await client.chat.completions.create(**kw)
            (call,) = r.choices[0].message.tool_calls or []
            assert call.function.name == "read" and json.loads(call.function.arguments) == {"path": "a.py"}
            assert r.choices[0].finish_reason == finish
        tag = json.loads(fake.requests[-1]["structured_outputs"]["structural_tag"])
        assert tag["format"]["type"] == ("tag" if finish == "stop" else "triggered_tags")


@ASYNC
async def test_none_and_auto_send_no_constraint(qenv: Any, qwen: Qwen3xFormat) -> None:
    fake, client, _ = qenv
    say(fake, qwen, "Sure.\n\n" + CALL)
    r = await client.chat.completions.create(
        model="q", messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none", extra_body=NO_THINK
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == "Sure.\n\n"
    assert r.choices[0].finish_reason == "stop"
    sent = fake.requests[-1]
    assert "structured_outputs" not in sent and "You have access to the following functions" in qwen.tokenizer.decode(
        sent["prompt"]
    )  # tools still rendered with "none", as vLLM does
    say(fake, qwen, CALL)
    r = await client.chat.completions.create(model="q", messages=[{"role": "user", "content": "y"}], tools=TOOLS)
    assert r.choices[0].message.tool_calls and "structured_outputs" not in fake.requests[-1]


@ASYNC
async def test_response_format_is_sent_as_structured_outputs(qenv: Any, qwen: Qwen3xFormat) -> None:
    fake, client, _ = qenv
    say(fake, qwen, '{"n": 1}')
    r = await client.chat.completions.create(
        model="q",
        messages=[{"role": "user", "content": "n?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        extra_body={**NO_THINK, "structured_outputs": {"disable_any_whitespace": True, "regex": "x"}},
    )
    assert json.loads(r.choices[0].message.content or "") == {"n": 1}
    assert fake.requests[-1]["structured_outputs"] == {"disable_any_whitespace": True, "json": SCHEMA}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "w"}}}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
@ASYNC
async def test_bad_values_are_openai_400(qenv: Any, extra: dict[str, Any], param: str) -> None:
    fake, _, url = qenv
    before = len(fake.requests)
    async with httpx.AsyncClient() as c:
        r = await c.post(
            url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={"model": "q", "messages": [{"role": "user", "content": "x"}], **extra},
        )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert len(fake.requests) == before  # nothing reached the engine


@ASYNC
async def test_logprobs_both_ways(qenv: Any, qwen: Qwen3xFormat) -> None:
    fake, client, _ = qenv
    text = "Hello there, world."
    ids = say(fake, qwen, text)
    r = await client.chat.completions.create(
        model="q", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2, extra_body=NO_THINK
    )
    assert fake.requests[-1]["logprobs"] == 2 and fake.requests[-1]["return_tokens_as_token_ids"] is True
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == len(ids)  # every generated token, the stop token too (as vLLM's chat)
    assert "".join(e.token for e in content[:-1]) == r.choices[0].message.content == text
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in content)
    assert content[0].logprob == -(ids[0] % 7) / 10 and content[0].bytes == list(content[0].token.encode())

    ids = say(fake, qwen, text)
    stream = await client.chat.completions.create(
        model="q", messages=[{"role": "user", "content": "hi"}], logprobs=True, stream=True, extra_body=NO_THINK
    )
    chunks = [c async for c in stream]
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert len(entries) == len(ids) and all(e.top_logprobs == [] for e in entries)
    assert "".join(e.token for e in entries[:-1]) == text
    for c in chunks:  # a chunk's logprobs are for tokens read by the time it went out
        if c.choices and c.choices[0].logprobs and c.choices[0].delta.content:
            assert "".join(e.token for e in c.choices[0].logprobs.content or []).startswith(c.choices[0].delta.content)

    say(fake, qwen, text)
    r = await client.chat.completions.create(model="q", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].logprobs is None and "logprobs" not in fake.requests[-1]


@ASYNC
async def test_forced_turn_keeps_transcript_exact(qenv: Any, qwen: Qwen3xFormat) -> None:
    fake, client, _ = qenv
    h = {"x-session-id": "forced"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "read a.py"}]
    gen = say(fake, qwen, CALL)
    named = {"type": "function", "function": {"name": "read"}}
    r = await client.chat.completions.create(
        model="q", messages=messages, tools=TOOLS, tool_choice=named, extra_headers=h, extra_body=NO_THINK,
        logprobs=True,
    )
    prompt = list(fake.requests[-1]["prompt"])
    (call,) = r.choices[0].message.tool_calls or []
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "print(1)"},
    ]
    say(fake, qwen, "Done.")
    await client.chat.completions.create(
        model="q", messages=messages, tools=TOOLS, tool_choice="none", extra_headers=h, extra_body=NO_THINK
    )
    assert list(fake.requests[-1]["prompt"])[: len(prompt) + len(gen)] == prompt + gen


@ASYNC
async def test_json_forcing_without_a_tool_syntax(toy: Any) -> None:
    fake, client = toy
    h = {"x-session-id": "toy"}
    user = [{"role": "user", "content": "go"}]

    def script(text: str) -> list[int]:
        ids = enc(text) + [IM_END]
        fake.scripts.append((ids, [chr(i) if i < 2**21 else "" for i in ids], "stop"))
        return ids

    gen = script('[{"name": "ls", "parameters": {}}]')
    r = await client.chat.completions.create(
        model="t", messages=user, tools=TOOLS, tool_choice="required", extra_headers=h
    )
    sent = fake.requests[-1]
    assert sent["structured_outputs"]["json"]["type"] == "array"
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "ls" and r.choices[0].finish_reason == "tool_calls"
    script('{"path": "a.py"}')
    follow = user + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "a.py"},
    ]
    named = {"type": "function", "function": {"name": "read"}}
    r = await client.chat.completions.create(
        model="t", messages=follow, tools=TOOLS, tool_choice=named, extra_headers=h
    )
    assert fake.requests[-1]["structured_outputs"] == {"json": READ["function"]["parameters"]}
    assert list(fake.requests[-1]["prompt"])[: len(sent["prompt"]) + len(gen)] == list(sent["prompt"]) + gen
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "read" and json.loads(call.function.arguments) == {"path": "a.py"}
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
