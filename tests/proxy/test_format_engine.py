"""Fidelity against the real engine: for a conversation the proxy has not seen, our prompt ids
equal vLLM `/tokenize` of the same request (both embedded models, with tools and thinking), and
our parse of the generated ids equals vLLM's own chat output."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest

from proxy.format import load_format
from proxy.format.base import ChatFormat

pytestmark = pytest.mark.engine

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Météo for a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}}, "strict": True}},
    {"type": "function", "function": {"name": "noop"}},
]  # fmt: skip


def _call(cid: str, name: str, args: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


AGENT_LOOP: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent.\n"},
    {"role": "user", "content": "Weather in Paris and Rome? Then list files."},
    {"role": "assistant", "reasoning": "Need two lookups.\n", "content": "",
     "tool_calls": [_call("c1", "get_weather", '{"city": "Paris", "days": 2}'),
                    _call("c2", "get_weather", '{"city":"Rome","units":null,"detailed":true}')]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "reasoning": "Now bash.", "content": "Checking files.",
     "tool_calls": [_call("c3", "bash", '{"command": "ls -la\\n"}'), _call("c4", "noop", "not json")]},
    {"role": "tool", "tool_call_id": "c3", "content": "a.py\nb.py\n"},
    {"role": "tool", "tool_call_id": "c4", "content": ""},
    {"role": "assistant", "content": "<think>\nR1\n</think>\n\nParis 18, Rome 24; files a.py b.py."},
    {"role": "user", "content": [{"type": "text", "text": "Thanks! "}, {"type": "text", "text": "  Again?  "}]},
]  # fmt: skip

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "simple": ([{"role": "user", "content": "What is the capital of France?"}], None),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  \n"}], None),
    "developer": ([{"role": "developer", "content": "Dev rules."}, {"role": "user", "content": "Hi"}], None),
    "tools": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}], TOOLS),
    "agent-loop": (AGENT_LOOP, TOOLS),
    "agent-loop-mid": (AGENT_LOOP[:7], TOOLS),
    "multiturn-plain": (
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": "unicode: é 日本 🙂 e\u0301"}],
        None,
    ),
}  # fmt: skip

KWARGS = [
    pytest.param({}, id="thinking-default"),
    pytest.param({"enable_thinking": False}, id="thinking-off"),
    pytest.param({"preserve_thinking": True}, id="preserve-thinking"),
]


def vllm_tokenize(engine: Any, messages: Any, tools: Any, kwargs: dict[str, Any], gen: bool = True) -> list[int]:
    body: dict[str, Any] = {
        "model": engine.model_name,
        "messages": copy.deepcopy(messages),
        "add_generation_prompt": gen,
        "chat_template_kwargs": kwargs,
    }
    if tools is not None:
        body["tools"] = tools
    r = httpx.post(f"{engine.base_url}/tokenize", json=body, timeout=120)
    r.raise_for_status()
    return list(r.json()["tokens"])


def ours(fmt: ChatFormat, messages: Any, tools: Any, kwargs: dict[str, Any], gen: bool = True) -> list[int]:
    kw = dict(kwargs)
    thinking = kw.pop("enable_thinking", True)
    return fmt.render(messages, tools, add_generation_prompt=gen, enable_thinking=thinking, **kw).ids


@pytest.fixture(scope="module")
def hybrid_format(hybrid_engine: Any) -> ChatFormat:
    return load_format(hybrid_engine.model_dir)


@pytest.fixture(scope="module")
def smol_format(smol_engine: Any) -> ChatFormat:
    return load_format(smol_engine.model_dir)


@pytest.mark.parametrize("kwargs", KWARGS)
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_hybrid_prompt_equals_vllm_tokenize(
    hybrid_engine: Any, hybrid_format: ChatFormat, name: str, kwargs: dict[str, Any]
) -> None:
    messages, tools = CONVERSATIONS[name]
    assert ours(hybrid_format, messages, tools, kwargs) == vllm_tokenize(hybrid_engine, messages, tools, kwargs)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smol_prompt_equals_vllm_tokenize(smol_engine: Any, smol_format: ChatFormat, name: str) -> None:
    messages, tools = CONVERSATIONS[name]
    if name.startswith("agent-loop"):  # ChatML renders no tool calls; keep its roles plain
        messages = [m for m in messages if m["role"] != "tool"]
    for gen in (True, False):
        assert ours(smol_format, messages, tools, {}, gen) == vllm_tokenize(smol_engine, messages, tools, {}, gen)


def test_hybrid_continuation_extends_prompt(hybrid_engine: Any, hybrid_format: ChatFormat) -> None:
    """prompt(N) + the assistant's ids (ending in <|im_end|>) + continuation == /tokenize(N+1),
    with preserve_thinking (history rendered append-only)."""
    kwargs = {"preserve_thinking": True}
    first = AGENT_LOOP[:2]
    reply = {
        "role": "assistant",
        "reasoning": "Need two lookups.\n",
        "content": "",
        "tool_calls": AGENT_LOOP[2]["tool_calls"],
    }
    prompt = vllm_tokenize(hybrid_engine, first, TOOLS, kwargs)
    full_reply = vllm_tokenize(hybrid_engine, [*first, reply], TOOLS, kwargs, gen=False)
    generated = full_reply[len(prompt) :][:-1]  # the model's ids: everything up to <|im_end|>, no "\n"
    assert full_reply[: len(prompt)] == prompt and generated[-1] == 248046
    new = AGENT_LOOP[3:5]
    cont = hybrid_format.render_continuation(new, TOOLS)
    assert prompt + generated + cont == vllm_tokenize(hybrid_engine, [*first, reply, *new], TOOLS, kwargs)


def test_hybrid_parse_equals_vllm_chat(hybrid_engine: Any, hybrid_format: ChatFormat) -> None:
    """The random model's gibberish exercises odd tokens; our parse of its ids must equal the
    engine's own reasoning/content/tool calls."""
    for thinking in (True, False):
        body = {
            "model": hybrid_engine.model_name, "messages": AGENT_LOOP, "tools": TOOLS, "temperature": 0,
            "max_tokens": 48, "return_token_ids": True, "chat_template_kwargs": {"enable_thinking": thinking},
        }  # fmt: skip
        r = httpx.post(f"{hybrid_engine.base_url}/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        parser = hybrid_format.parser(enable_thinking=thinking, tools=TOOLS)
        for tid in choice["token_ids"]:
            parser.feed([tid])
        parser.finish()
        res = parser.result()
        msg = choice["message"]
        assert res.reasoning == msg.get("reasoning"), thinking
        assert res.content == msg.get("content"), thinking
        theirs = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
        assert [(c.name, c.arguments) for c in res.tool_calls] == theirs


def test_smol_parse_equals_vllm_chat(smol_engine: Any, smol_format: ChatFormat) -> None:
    body = {
        "model": smol_engine.model_name,
        "messages": [{"role": "user", "content": "Write one sentence about Paris, with an accent: café."}],
        "temperature": 0,
        "max_tokens": 40,
        "return_token_ids": True,
    }
    r = httpx.post(f"{smol_engine.base_url}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    parser = smol_format.parser()
    streamed = "".join(d.text for tid in choice["token_ids"] for d in parser.feed([tid]))
    streamed += "".join(d.text for d in parser.finish())
    assert parser.result().content == choice["message"]["content"] == streamed
