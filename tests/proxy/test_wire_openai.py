"""Output assembly: chunk bytes are valid OpenAI chunks; the arguments gate never lets a client
concatenate broken JSON."""

from __future__ import annotations

import json

import pytest

from proxy.reply import finish_reason
from proxy.turn import ArgumentsGate
from proxy.wire.openai import ChunkWriter
from proxy.format.base import Delta, DeltaKind, ParsedOutput, ToolCall

pytestmark = pytest.mark.unit


def _events(raw: bytes) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]


def test_chunks_parse_and_merge_text() -> None:
    w = ChunkWriter("chatcmpl-1", "m", created=5)
    (role,) = _events(w.role())
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    out = _events(
        w.deltas(
            [
                Delta(DeltaKind.REASONING, "a"),
                Delta(DeltaKind.REASONING, "b"),
                Delta(DeltaKind.CONTENT, "c"),
                Delta(DeltaKind.TOOL_CALL, index=0, id="call_1", name="f"),
                Delta(DeltaKind.ARGUMENTS, "{}", index=0),
            ]
        )
    )
    assert out[0]["choices"][0]["delta"] == {"reasoning_content": "ab", "content": "c", "reasoning": "ab"}
    assert out[1]["choices"][0]["delta"]["tool_calls"][0] == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert out[2]["choices"][0]["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": "{}"}}
    (fin,) = _events(w.finish("tool_calls"))
    assert fin["choices"][0]["finish_reason"] == "tool_calls" and fin["object"] == "chat.completion.chunk"
    (usage,) = _events(w.usage({"prompt_tokens": 1}))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 1}
    assert w.deltas([]) == b""


def test_finish_reason() -> None:
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("stop", False) == "stop"
    assert finish_reason("length", True) == "length"


def test_gate_streams_fragments_and_reports_mismatches() -> None:
    gate = ArgumentsGate()
    good = [Delta(DeltaKind.ARGUMENTS, t, index=0) for t in ('{"a": ', "1", "}")]
    assert [d.text for part in good for d in gate.filter([part])] == ['{"a": ', "1", "}"]  # incremental
    broken = [Delta(DeltaKind.ARGUMENTS, t, index=1) for t in ('{"p": "', "x", "\\n</parameter")]
    for part in broken:
        gate.filter([part])
    final = ParsedOutput(
        None,
        None,
        (ToolCall("call_0", "f", '{"a": 1}'), ToolCall("call_1", "g", '{"p": "x"}'), ToolCall("call_2", "h", "{}")),
    )
    assert [(d.index, d.text) for d in gate.flush(final)] == [(2, "{}")]  # a call with no fragment
    assert [m[0] for m in gate.mismatches] == [1]
