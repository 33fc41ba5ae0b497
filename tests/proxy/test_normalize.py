"""Each normalization is a named function; each gets its test. Plus request validation (400s)."""

from __future__ import annotations

import pytest

from proxy.errors import ContextLengthExceeded, InvalidRequest
from proxy.ingress import Ingress
from proxy.normalize import (
    cap_max_tokens,
    drop_unsupported_fields,
    normalize,
    stable_tool_definitions,
    template_kwargs,
    tools_key,
)
from proxy.protocol import parse_chat_request, validate_messages
from proxy.quirks import QuirkLog

pytestmark = pytest.mark.unit


def body_of(**kw):  # type: ignore[no-untyped-def]
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def req(**kw):  # type: ignore[no-untyped-def]
    return parse_chat_request(body_of(**kw))


def test_stable_tool_definitions_and_key() -> None:
    a = [
        {
            "type": "function",
            "function": {"name": "f", "strict": True, "parameters": {"type": "object", "properties": {}}},
        }
    ]
    b = [{"function": {"parameters": {"properties": {}, "type": "object"}, "name": "f"}, "type": "function"}]
    assert "strict" not in stable_tool_definitions(a)[0]["function"]  # type: ignore[index]
    assert tools_key(stable_tool_definitions(a)) == tools_key(stable_tool_definitions(b))
    assert stable_tool_definitions([]) is None


def test_tools_key_is_the_canonical_json_text() -> None:
    """Sorted keys, compact, UTF-8 as is: the text `json.dumps(sort_keys=True)` wrote (floats aside,
    whose exponents lose their `+`), so keys stored before the faster encoder still match."""
    import json
    import random

    rng = random.Random(7)

    def value(depth: int) -> object:
        kind = rng.randrange(7 if depth < 4 else 4)
        if kind == 0:
            return rng.choice(["", "é\u2028", "\x00\x1f\"\\/", "ascii", "日本"])
        if kind == 1:
            return rng.randint(-2**70, 2**70)
        if kind == 2:
            return rng.choice([True, False, None, 0.5, -1.25, 100.0])
        if kind == 3:
            return rng.randint(0, 9)
        if kind == 4:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["b", "a", "Z", "é", "properties", "type"]) + str(i): value(depth + 1)
                for i in range(rng.randrange(5))}

    for _ in range(300):
        tools = [{"type": "function", "function": value(0)} for _ in range(rng.randrange(1, 4))]
        assert tools_key(tools) == json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert tools_key(None) == "[]"


def test_a_tool_set_is_checked_once_and_a_bad_one_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy import constraints
    from proxy.normalize import ToolsSeen

    checked: list[int] = []
    real = constraints.check_tool_schemas

    def counting(tools):  # type: ignore[no-untyped-def]
        checked.append(len(tools or ()))
        real(tools)

    monkeypatch.setattr(constraints, "check_tool_schemas", counting)
    good = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    bad = [{"type": "function", "function": {"name": "g", "parameters": {"type": "string", "pattern": "(("}}}]
    seen = ToolsSeen(keep=2)
    for _ in range(3):
        normalize(req(tools=good), body_of(tools=good), seen)
    assert checked == [1]  # the same set, three turns: checked once
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="tools.0.function.parameters"):
            normalize(req(tools=bad), body_of(tools=bad), seen)
    assert checked == [1, 1, 1]  # a refused set is never remembered as passed
    others = [[{"type": "function", "function": {"name": n}}] for n in ("a", "b")]
    for tools in others:
        normalize(req(tools=tools), body_of(tools=tools), seen)
    normalize(req(tools=good), body_of(tools=good), seen)
    assert checked == [1, 1, 1, 1, 1, 1]  # `good` fell out past keep=2 and was checked again
    assert normalize(req(tools=good), body_of(tools=good), seen).tools_key == tools_key(
        stable_tool_definitions(good))
    huge = [{"type": "function", "function": {"name": "h", "description": "x" * 300_000}}]
    checked.clear()
    for _ in range(2):
        normalize(req(tools=huge), body_of(tools=huge), seen)
    assert checked == [1, 1]  # over CACHED_TOOLS_CHARS: not kept, checked each time


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, True),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "high"}, True),
        ({"thinking": {"type": "disabled"}}, False),
        ({"think": False}, False),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
    ],
)
def test_thinking_switch_is_decided_once_at_ingress(extra, expected) -> None:  # type: ignore[no-untyped-def]
    turn = Ingress(QuirkLog(), default_thinking=True).openai(body_of(**extra), {}, max_model_len=4096)
    assert turn.thinking is expected
    # The switch never reaches the renderer's kwargs by another road.
    assert "enable_thinking" not in turn.chat.template_kwargs
    assert "enable_thinking" not in template_kwargs(req(**extra))


def test_drop_unsupported_fields() -> None:
    r = req(store=False, prompt_cache_key="k", metadata={"a": 1}, temperature=0, seed=3, parallel_tool_calls=True)
    assert drop_unsupported_fields(r) == {"temperature": 0, "seed": 3}
    assert drop_unsupported_fields(req(logprobs=True, top_logprobs=2)) == {
        "logprobs": 2,
        "return_tokens_as_token_ids": True,  # ids as logprob keys: exact bytes, no collisions
    }
    assert drop_unsupported_fields(req(logprobs=False, top_logprobs=2)) == {}


def test_cap_max_tokens() -> None:
    assert cap_max_tokens(None, 100, 1000) == 900
    assert cap_max_tokens(5000, 100, 1000) == 900  # capped, not an error
    assert cap_max_tokens(10, 100, 1000) == 10
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 1000 tokens") as info:
        cap_max_tokens(10, 1000, 1000)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"


def test_normalize_pipeline() -> None:
    b = body_of(
        messages=[
            {"role": "developer", "content": "s"},
            {"role": "user", "content": "u"},
            {
                "role": "assistant",
                "content": "",
                "reasoning": "r",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
        ],
        max_completion_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    n = normalize(parse_chat_request(b), b)
    assert [m["role"] for m in n.messages] == ["developer", "user", "assistant"]  # as sent: the renderer maps
    assert n.messages[2]["reasoning"] == "r"
    assert (n.max_tokens, n.stream, n.include_usage) == (7, True, True)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": "hi"},
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": "str"}}],
        },
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        {"messages": [{"role": "user", "content": "x"}], "n": 2},
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
    ],
)
def test_bad_requests_are_400(body) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequest) as info:
        validate_messages(parse_chat_request(body).messages)
    assert info.value.status == 400


def test_validate_messages_from_an_offset() -> None:
    msgs = [{"role": "wizard"}, {"role": "user", "content": "ok"}, {"role": "user", "content": 5}]
    with pytest.raises(InvalidRequest, match="messages.2.content"):
        validate_messages(msgs, 1)
