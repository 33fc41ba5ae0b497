"""A toy ChatML-like `ChatFormat` for pipeline tests without a tokenizer: one id per character
(`ord`), specials above 2**21. A generation "CALL name {json}" parses as one tool call."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from proxy.format.base import ChatFormat, Delta, DeltaKind, OutputParser, ParsedOutput, Rendered, Span, ToolCall

IM_START, IM_END = 2**21 + 1, 2**21 + 2


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def dec(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids if i < 2**21)


def _content(m: Any) -> str:
    c = m.get("content")
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c)
    if m.get("tool_calls"):
        call = m["tool_calls"][0]["function"]
        args = call["arguments"] if isinstance(call["arguments"], str) else json.dumps(call["arguments"])
        return f"CALL {call['name']} {json.dumps(json.loads(args or '{}'))}"
    return (c or "").strip()


def _msg(m: Any) -> list[int]:
    role = "system" if m["role"] == "developer" else m["role"]
    return [IM_START] + enc(f"{role}\n{_content(m)}") + [IM_END] + enc("\n")


class ToyParser(OutputParser):
    def __init__(self, new_id: Callable[[], str]) -> None:
        self.ids: list[int] = []
        self.sent = 0
        self.new_id = new_id
        self.call: ToolCall | None = None

    def feed(self, token_ids: Sequence[int]) -> list[Delta]:
        self.ids.extend(i for i in token_ids if i != IM_END)
        text = dec(self.ids)
        if text.startswith("CALL") or "CALL".startswith(text):
            return []  # hold back: maybe a tool call
        out = [Delta(DeltaKind.CONTENT, text[self.sent :])] if len(text) > self.sent else []
        self.sent = len(text)
        return out

    def finish(self) -> list[Delta]:
        text = dec(self.ids)
        if text.startswith("CALL "):
            _, name, args = text.split(" ", 2)
            self.call = ToolCall(self.new_id(), name, args)
            return [
                Delta(DeltaKind.TOOL_CALL, index=0, id=self.call.id, name=name),
                Delta(DeltaKind.ARGUMENTS, args, index=0),
            ]
        out = [Delta(DeltaKind.CONTENT, text[self.sent :])] if len(text) > self.sent else []
        self.sent = len(text)
        return out

    def result(self) -> ParsedOutput:
        if self.call:
            return ParsedOutput(content=None, reasoning=None, tool_calls=(self.call,))
        return ParsedOutput(content=dec(self.ids), reasoning=None)


class ToyFormat(ChatFormat):
    name = "toy"
    tokenizer = None  # type: ignore[assignment]

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset((IM_END,))

    def render(
        self,
        messages,
        tools=None,
        *,
        add_generation_prompt=True,
        enable_thinking=True,  # type: ignore[no-untyped-def,override]
        continue_final_message=False,
        **template_kwargs,
    ) -> Rendered:
        for m in messages:
            if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"bad role {m['role']}")
        ids: list[int] = []
        spans = []
        for i, m in enumerate(messages):
            start = len(ids)
            ids += _msg(m)
            spans.append(Span(start, len(ids), i))
        gen = None
        if add_generation_prompt:
            gen = Span(len(ids), len(ids) + 11, None)
            ids += [IM_START] + enc("assistant\n")
        return Rendered(ids=ids, spans=tuple(spans), generation=gen)

    def render_continuation(
        self,
        messages,
        tools=None,
        *,
        add_generation_prompt=True,
        enable_thinking=True,  # type: ignore[no-untyped-def,override]
        after_stop=True,
    ) -> list[int]:
        ids = enc("\n") if after_stop else [IM_END] + enc("\n")
        for m in messages:
            ids += _msg(m)
        return ids + [IM_START] + enc("assistant\n")

    def parser(self, *, enable_thinking=True, tools=None, tool_call_id=None, tool_calls=True) -> OutputParser:  # type: ignore[no-untyped-def,override]
        return ToyParser(tool_call_id or (lambda: "call_x"))
