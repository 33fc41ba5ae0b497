"""Bad input on a real uvicorn server in front of a fake vLLM: every case is an OpenAI-shaped (Anthropic-
shaped on /v1/messages) 4xx within BOUND_S, never a 5xx, and nothing reaches the engine or a session
transcript. The limits are the defaults (`InputLimits`, proxy/constraints.py), not test values.

Cases are grouped by class; `test_summary` prints cases per class and the worst time to a 4xx."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from proxy.app import create_app
from proxy.settings import InputLimits, Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_format import ToyFormat
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app
from tests.proxy.test_auth import raw

pytestmark = [pytest.mark.unit]
aio = pytest.mark.asyncio(loop_scope="session")

KEY = "sk-bad-input"
AUTH = {"authorization": f"Bearer {KEY}"}
BOUND_S = 2.0  # the longest any refusal may take here (2 busy cores); measured worst is printed
LIMIT = InputLimits().max_body_bytes
USER = [{"role": "user", "content": "hi"}]
TIMES: dict[str, list[float]] = defaultdict(list)


@dataclass
class Env:
    url: str
    port: int
    fake: FakeVLLM
    store: MemoryStore
    client: httpx.AsyncClient


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def env() -> AsyncIterator[Env]:
    fake = FakeVLLM(max_model_len=400)
    store = MemoryStore()
    async with fake_vllm_server(fake) as upstream_url:
        settings = Settings(upstream=upstream_url, model_name="hh", api_key=KEY)
        async with (serve_app(create_app(settings, fmt=ToyFormat(), store=store)) as url,
                    httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as client):
            yield Env(url, int(url.rsplit(":", 1)[1]), fake, store, client)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "hh", "messages": USER, **extra}


def tool(parameters: Any, name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
HOSTILE_SCHEMAS = {
    "catastrophic-pattern": {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(a+)+$"}}},
    "nested-star": {"type": "string", "pattern": "(\\w+\\s?)*$"},
    "10000-properties": WIDE,
    "huge-repeat": {"type": "string", "pattern": "a{1,100000}"},
    "repeat-256": {"type": "string", "pattern": "^[a-z]{1,256}$"},
    "word-boundary": {"type": "string", "pattern": "\\bword\\b"},
    "lookahead": {"type": "string", "pattern": "(?=a)a"},
    "backreference": {"type": "string", "pattern": "(a)\\1"},
    "invalid-regex": {"type": "string", "pattern": "[a-"},
    "nul-in-pattern": {"type": "string", "pattern": "a\x00b"},
    "pattern-not-string": {"type": "string", "pattern": 5},
    "pattern-properties-key": {"type": "object", "patternProperties": {"^(a|b+)+$": {"type": "string"}}},
    "enum-flood": {"enum": list(range(10_000))},
}
CHAT_CASES: dict[str, dict[str, Any]] = {
    **{f"tools/{name}": chat(tools=[tool(s)]) for name, s in HOSTILE_SCHEMAS.items()},
    "tools/forced-catastrophic": chat(tools=[tool(HOSTILE_SCHEMAS["catastrophic-pattern"])], tool_choice="required"),
    "tools/parameters-not-object": chat(tools=[tool([1, 2])]),
    "tools/no-name": chat(tools=[{"type": "function", "function": {"parameters": {}}}]),
    **{f"response_format/{name}": chat(response_format=schema_format(s)) for name, s in HOSTILE_SCHEMAS.items()},
    "response_format/bad-type": chat(response_format=schema_format({"type": "any"})),
    "response_format/not-object": chat(response_format="json"),
    "structured_outputs/regex": chat(structured_outputs={"regex": "(a*)*b"}),
    "structured_outputs/json": chat(structured_outputs={"json": WIDE}),
    "structured_outputs/choice": chat(structured_outputs={"choice": [str(i) for i in range(5000)]}),
    "structured_outputs/grammar": chat(structured_outputs={"grammar": "root ::= " + "\"a\" " * 40_000}),
    "structured_outputs/not-object": chat(structured_outputs=["regex"]),
    "numbers/n-huge": chat(n=10**9),
    "numbers/n-2": chat(n=2),
    "numbers/n-zero": chat(n=0),
    "numbers/top-logprobs-huge": chat(logprobs=True, top_logprobs=10**9),
    "numbers/top-logprobs-negative": chat(logprobs=True, top_logprobs=-1),
    "numbers/max-tokens-negative": chat(max_tokens=-1),
    "numbers/max-tokens-float": chat(max_tokens=1.5),
    "numbers/max-tokens-string": chat(max_tokens="lots"),
    "numbers/seed-over-int64": chat(seed=2**70),
    "numbers/top-k-huge": chat(top_k=2**40),
    "numbers/temperature-negative": chat(temperature=-1),
    "numbers/stop-flood": chat(stop=["x"] * 1000),
    "templates/chat-template": chat(chat_template="{% for m in messages %}{{ m }}{% endfor %}"),
    "templates/ssti": chat(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"),
    "templates/kwargs-unknown": chat(chat_template_kwargs={"tools": [], "messages": []}),
    "templates/kwargs-not-bool": chat(chat_template_kwargs={"enable_thinking": "{{7*7}}"}),
    "templates/mm-processor-kwargs": chat(mm_processor_kwargs={"size": 10**9}),
    "messages/empty": chat(messages=[]),
    "messages/bad-role": chat(messages=[{"role": "root", "content": "x"}]),
    "messages/content-number": chat(messages=[{"role": "user", "content": 5}]),
    "messages/over-context": chat(messages=[{"role": "user", "content": "word " * 2000}]),
    "model/not-string": chat(model=5),
    "model/too-long": chat(model="m" * 10_000),
}
MSG = {"model": "hh", "max_tokens": 10}
ANTHROPIC_CASES: dict[str, dict[str, Any]] = {
    "user-tool-use": {**MSG, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
    "assistant-tool-result": {**MSG, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
    "unknown-block": {**MSG, "messages": [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}]},
    "block-not-object": {**MSG, "messages": [{"role": "user", "content": ["text"]}]},
    "text-not-string": {**MSG, "messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
    "tool-use-input-list": {**MSG, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]},
    "tool-result-nested-tool-use": {**MSG, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_use", "id": "u", "name": "g"}]}]}]},
    "system-image": {**MSG, "system": [{"type": "image", "source": {}}],
                     "messages": [{"role": "user", "content": "x"}]},
    "system-role": {**MSG, "messages": [{"role": "system", "content": "x"}]},
    "tools-schema-list": {**MSG, "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"name": "f", "input_schema": [1]}]},
    "tools-hostile-schema": {**MSG, "messages": [{"role": "user", "content": "x"}],
                             "tools": [{"name": "f", "input_schema": HOSTILE_SCHEMAS["catastrophic-pattern"]}]},
    "messages-not-list": {**MSG, "messages": {"role": "user"}},
}


def timed(cls: str, started: float) -> float:
    took = time.perf_counter() - started
    TIMES[cls].append(took)
    assert took < BOUND_S, f"{cls}: {took:.2f}s to a 4xx"
    return took


def check_openai(r: httpx.Response, cls: str, started: float, status: int | None = None) -> None:
    timed(cls, started)
    assert 400 <= r.status_code < 500 and (status is None or r.status_code == status), (cls, r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["type"] == "invalid_request_error", err
    assert set(err) == {"message", "type", "param", "code"}, err


ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
                   415: "invalid_request_error"}


def check_anthropic(r: httpx.Response, cls: str, started: float) -> None:
    timed(cls, started)
    assert 400 <= r.status_code < 500, (cls, r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == ANTHROPIC_TYPES[r.status_code], body


@aio
@pytest.mark.parametrize("case", list(CHAT_CASES))
async def test_chat_cases(env: Env, case: str) -> None:
    started = time.perf_counter()
    r = await env.client.post("/v1/chat/completions", json=CHAT_CASES[case])
    check_openai(r, case.split("/")[0], started, 400)


@aio
@pytest.mark.parametrize("case", list(ANTHROPIC_CASES))
async def test_anthropic_cases(env: Env, case: str) -> None:
    started = time.perf_counter()
    r = await env.client.post("/v1/messages", json=ANTHROPIC_CASES[case])
    check_anthropic(r, "anthropic-blocks", started)


RAW_BODIES = {
    "depth-65": json.dumps(chat(metadata=nested(65))).encode(),
    "depth-100000-arrays": b'{"model": "hh", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "depth-100000-unclosed": b'{"a":' * 100_000,
    "utf8-invalid-byte": b'{"model": "hh", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    "utf8-overlong": b'{"model": "hh", "messages": [{"role": "user", "content": "\xc0\xaf"}]}',
    "utf8-lone-surrogate": b'{"model": "hh", "messages": [{"role": "user", "content": "\\ud800x"}]}',
    "utf8-surrogate-key": b'{"model": "hh", "\\udfff": 1, "messages": []}',
    "utf16-body": json.dumps(chat()).encode("utf-16"),
    "json-nan": b'{"model": "hh", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    "json-infinity": b'{"model": "hh", "messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}',
    "json-max-tokens-1e400": b'{"model": "hh", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
    "json-truncated": b'{"model": "hh", "messages": [',
    "json-array": b"[]",
    "json-string": b'"hello"',
    "json-empty": b"",
}


@aio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions"])
@pytest.mark.parametrize("case", list(RAW_BODIES))
async def test_raw_bodies(env: Env, case: str, path: str) -> None:
    started = time.perf_counter()
    r = await env.client.post(path, content=RAW_BODIES[case], headers={"content-type": "application/json"})
    cls = case.split("-")[0]
    (check_anthropic if path == "/v1/messages" else check_openai)(r, cls, started)
    assert r.status_code == 400


@aio
@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                                   "application/xml", "text/json"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions"])
async def test_wrong_content_type(env: Env, media: str, path: str) -> None:
    started = time.perf_counter()
    r = await env.client.post(path, content=json.dumps(chat()).encode(), headers={"content-type": media})
    assert r.status_code == 415
    (check_anthropic if path == "/v1/messages" else check_openai)(r, "content-type", started)


@aio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/embeddings"])
async def test_declared_size_over_limit_refused_unread(env: Env, path: str) -> None:
    """A Content-Length over the limit is answered before one body byte is sent."""
    started = time.perf_counter()
    status, headers, body = await raw(
        env.port, f"POST {path} HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {KEY}\n"
                  f"Content-Type: application/json\nContent-Length: {LIMIT + 1}\n")
    timed("size", started)
    assert status == 413 and headers.get("connection") == "close"
    assert str(LIMIT) in (json.loads(body).get("error") or {}).get("message", "")


async def _chunks(total: int) -> AsyncIterator[bytes]:
    head = b'{"model": "hh", "messages": [{"role": "user", "content": "'
    yield head
    block = b"a" * (1 << 20)
    sent = len(head)
    while sent < total:
        yield block
        sent += len(block)
    yield b'"}]}'


COMPLETION_CASES = {
    "n-huge": {"n": 10**6}, "logprobs-huge": {"logprobs": 10**6}, "prompt-logprobs": {"prompt_logprobs": -5},
    "regex": {"structured_outputs": {"regex": "(a+)+$"}}, "json": {"structured_outputs": {"json": WIDE}},
    "response-format": {"response_format": schema_format(HOSTILE_SCHEMAS["nested-star"])},
    "chat-template": {"chat_template": "{{ x }}"},
}


@aio
@pytest.mark.parametrize("case", list(COMPLETION_CASES))
async def test_completions_passthrough_cases(env: Env, case: str) -> None:
    """/v1/completions is relayed to vLLM as is: the same bounds hold there."""
    started = time.perf_counter()
    r = await env.client.post("/v1/completions", json={"model": "hh", "prompt": [1, 2], **COMPLETION_CASES[case]})
    check_openai(r, "completions", started, 400)


@aio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions"])
async def test_streamed_size_over_limit(env: Env, path: str) -> None:
    """A chunked body (no Content-Length) is counted as it arrives and refused once over the limit."""
    started = time.perf_counter()
    try:
        r = await env.client.post(path, content=_chunks(LIMIT + (2 << 20)),
                                  headers={"content-type": "application/json"})
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        timed("size", started)  # the server answered 413 and closed while the client was still writing
        return
    assert r.status_code == 413, r.text
    (check_anthropic if path == "/v1/messages" else check_openai)(r, "size", started)


@aio
async def test_strict_model() -> None:
    """With `strict_model` on, another model name is a 404 model_not_found on both wires."""
    fake = FakeVLLM(max_model_len=400)
    async with fake_vllm_server(fake) as upstream_url:
        settings = Settings(upstream=upstream_url, model_name="hh", limits=InputLimits(strict_model=True))
        async with (serve_app(create_app(settings, fmt=ToyFormat(), store=MemoryStore())) as url,
                    httpx.AsyncClient(base_url=url) as client):
            started = time.perf_counter()
            r = await client.post("/v1/chat/completions", json=chat(model="gpt-4o"))
            check_openai(r, "model", started, 404)
            assert r.json()["error"]["code"] == "model_not_found"
            started = time.perf_counter()
            r = await client.post("/v1/messages", json={**MSG, "model": "claude", "messages": USER})
            check_anthropic(r, "model", started)
            assert r.status_code == 404
            assert (await client.post("/v1/chat/completions", json=chat(max_tokens=2))).status_code == 200
    assert len(fake.requests) == 1


@aio
async def test_nothing_reached_the_engine_or_a_transcript(env: Env) -> None:
    """Runs after the cases above (file order): no refused request was sent on or left a transcript."""
    assert env.fake.requests == []
    assert await env.store.count() == 0


@aio
async def test_still_serving_and_quirks_kept(env: Env) -> None:
    """After all that: a plain request works, the documented thinking switch is still honoured, and a
    huge max_tokens means "as much as fits" (capped, not refused: harnesses send the whole window)."""
    r = await env.client.post("/v1/chat/completions", json=chat(max_tokens=10**30))
    assert r.status_code == 200, r.text
    sent = env.fake.requests[-1]
    assert 0 < sent["max_tokens"] <= 400 - len(sent["prompt"])
    r = await env.client.post("/v1/chat/completions", json=chat(
        chat_template_kwargs={"enable_thinking": False, "preserve_thinking": True}))
    assert r.status_code == 200, r.text
    r = await env.client.post("/v1/chat/completions", json=chat(tools=[tool({"type": "object", "properties": {
        "path": {"type": "string", "pattern": "^[\\w./-]+$"}, "n": {"type": "string", "pattern": "(\\d{3}-)+"}}})]))
    assert r.status_code == 200, r.text


def test_summary() -> None:
    """Cases per class and the worst time to a 4xx (printed with -s; asserted per case above)."""
    if not TIMES:
        pytest.skip("prints the figures of the cases above; none ran")
    worst = max((max(t), cls) for cls, t in TIMES.items())
    for cls, times in sorted(TIMES.items()):
        print(f"{cls:20s} {len(times):4d} cases, worst {max(times) * 1000:7.1f} ms")
    print(f"total {sum(map(len, TIMES.values()))} cases, worst {worst[0] * 1000:.1f} ms ({worst[1]}),"
          f" bound {BOUND_S} s")
    assert worst[0] < BOUND_S

