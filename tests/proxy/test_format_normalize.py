"""The format's normalization helpers, each reproducing one step of vLLM 0.32's chat
preprocessing (renderers/chat_utils.py, renderers/hf.py, chat_completion/protocol.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.format import FormatError
from proxy.format.normalize import (
    canonical_arguments,
    canonical_tool,
    canonical_tool_calls,
    canonical_tools,
    content_parts,
    developer_to_system,
    strip_billing_header,
    text_of,
    tool_properties,
    tool_result_parts,
    unify_reasoning,
)

pytestmark = pytest.mark.unit


def test_developer_to_system_merges_all_system_messages() -> None:
    msgs = [
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "u"},
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "system", "content": ""},
    ]
    out = developer_to_system(msgs)
    assert out[0] == (0, {"role": "system", "content": "D\n\na\nb"})
    assert out[1] == (1, msgs[1]) and len(out) == 2


def test_developer_to_system_leaves_chats_without_developer_alone() -> None:
    msgs = [{"role": "user", "content": "u"}, {"role": "system", "content": "late"}]
    assert developer_to_system(msgs) == [(0, msgs[0]), (1, msgs[1])]


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"reasoning_content": "r"}, "r"),
        ({"reasoning": "r"}, "r"),
        ({"reasoning": "a", "reasoning_content": "b"}, "a"),
        ({"reasoning": None, "reasoning_content": "b"}, "b"),
        ({"reasoning_content": ""}, ""),
        ({}, None),
    ],
)
def test_unify_reasoning(message: dict[str, Any], expected: str | None) -> None:
    assert unify_reasoning(message) == expected


def test_unify_reasoning_rejects_non_strings() -> None:
    with pytest.raises(FormatError):
        unify_reasoning({"reasoning": ["x"]})


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ({"a": 1}, {"a": 1}),
        ("", {}),
        (None, {}),
        ("not json", {}),
        ("[1, 2]", {}),
        ("42", {}),
    ],
)
def test_canonical_arguments(arguments: Any, expected: dict[str, Any]) -> None:
    assert canonical_arguments(arguments) == expected


def test_canonical_tool_calls() -> None:
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    assert canonical_tool_calls(calls) == [{"id": "1", "name": "f", "arguments": {"x": 1}}]
    assert canonical_tool_calls([]) == [] and canonical_tool_calls(None) == []
    with pytest.raises(FormatError, match="type 'function'"):
        canonical_tool_calls([{"type": "custom", "function": {"name": "f"}}])
    with pytest.raises(FormatError, match="must be objects"):
        canonical_tool_calls(["x"])


def test_canonical_tool_matches_vllm_model_dump() -> None:
    raw = {"function": {"parameters": {"type": "object", "properties": {"b": {}, "a": {}}}, "name": "f",
                        "extra": 1}, "type": "function", "other": 2}  # fmt: skip
    dumped = canonical_tool(raw)
    assert json.dumps(dumped, ensure_ascii=False) == (
        '{"type": "function", "function": {"name": "f", "description": null, '
        '"parameters": {"type": "object", "properties": {"b": {}, "a": {}}}}}'
    )
    strict = canonical_tool({"type": "function", "function": {"name": "g", "strict": True}, "defer_loading": True})
    assert strict == {
        "type": "function",
        "function": {"name": "g", "description": None, "parameters": None, "strict": True, "defer_loading": True},
        "defer_loading": True,
    }


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "function", "function": {"name": "f", "parameters": "x"}},
        {"type": "function", "function": {"name": ""}},
        {"type": "function"},
        {"type": "retrieval", "function": {"name": "f"}},
        "f",
    ],
)
def test_canonical_tool_rejects_bad_definitions(tool: Any) -> None:
    with pytest.raises(FormatError):
        canonical_tool(tool)


def test_canonical_tools() -> None:
    assert canonical_tools(None) is None and canonical_tools([]) == []
    with pytest.raises(FormatError):
        canonical_tools({"name": "f"})  # type: ignore[arg-type]


def test_content_parts() -> None:
    assert content_parts("x") == [{"type": "text", "text": "x"}]
    assert content_parts(None) == []
    parts = content_parts(
        [
            "s",
            {"type": "input_text", "text": "i"},
            {"type": "refusal", "refusal": "no"},
            {"type": "text", "text": None},
            {"type": "image_url", "image_url": {"url": "data:"}},
            {"image_url": {"url": "data:"}},
            {"type": "video_url", "video_url": {"url": "v"}},
        ]
    )
    assert parts == [
        {"type": "text", "text": "s"},
        {"type": "text", "text": "i"},
        {"type": "text", "text": "no"},
        {"type": "image"},
        {"type": "image"},
        {"type": "video"},
    ]
    assert text_of(parts) == "sino" and text_of(parts, "\n") == "s\ni\nno"
    with pytest.raises(FormatError, match="unsupported"):
        content_parts([{"type": "hologram"}])
    with pytest.raises(FormatError):
        content_parts(42)


def test_tool_result_parts_joins_text_with_newline() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tool_result_parts(parts) == [{"type": "text", "text": "a\nb"}]
    mixed = [{"type": "text", "text": "a"}, {"type": "image"}]
    assert tool_result_parts(mixed) == mixed


def test_strip_billing_header() -> None:
    parts = [
        {"type": "text", "text": "x-anthropic-billing-header: cc=1\nYou are Claude."},
        {"type": "text", "text": "y"},
    ]
    assert strip_billing_header(parts) == [{"type": "text", "text": "You are Claude."}, {"type": "text", "text": "y"}]
    assert strip_billing_header([{"type": "text", "text": "x-anthropic-billing-header: 1"}]) == []


def test_tool_properties() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}}}]
    assert tool_properties(tools, "f") == {"a": {"type": "integer"}}
    assert tool_properties(tools, "g") == {} and tool_properties(None, "f") == {}
