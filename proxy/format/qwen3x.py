"""The Qwen3.x (3.5/3.6) conversation format, rendered in Python with per-message token spans.

Byte-for-byte the same text as backend/models/templates/qwen3x.jinja (and the official 3.6
template) after vLLM's preprocessing; ../shared/research/qwen-chat-format.md is the spec and
tests/proxy/test_format_spec.py checks both against its examples. Rendering in Python instead
of Jinja lets us cache each message's ids (see cache.py) and know which ids belong to which
message, which the transcripts need.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxy.format import normalize
from proxy.format.base import (
    ChatFormat,
    FormatError,
    Message,
    OutputParser,
    Rendered,
    Tool,
    ToolCallIdFactory,
    assemble,
)
from proxy.format.cache import ChunkCache
from proxy.format.qwen3x_parser import Qwen3xParser
from proxy.format.tokenizer import Tokenizer

ToolCallStyle = Literal["xml", "json"]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
XML_INSTRUCTIONS = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is no "
    "function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>"
)
# The JSON (Hermes-style) option, for engines run with `--tool-call-parser hermes`: same
# system layout, the instruction block of the Qwen3 (2025) templates.
JSON_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

GENERATION_THINKING = IM_START + "assistant\n<think>\n"
GENERATION_NO_THINKING = IM_START + "assistant\n<think>\n\n</think>\n\n"


def _dumps(value: Any) -> str:
    # transformers' tojson: received key order, non-ASCII kept, ", " / ": " separators.
    return json.dumps(value, ensure_ascii=False)


@dataclass(slots=True)
class _Vision:
    """Image/video counters for `add_vision_id` ("Picture N: "), counted across the chat."""

    add_ids: bool
    images: int = 0
    videos: int = 0

    def render(self, parts: str | Sequence[Mapping[str, Any]], *, count: bool, in_system: bool = False) -> str:
        if isinstance(parts, str):
            return parts  # the common case: plain string content, no copy
        if len(parts) == 1 and parts[0].get("type") == "text":
            return str(parts[0]["text"])
        out: list[str] = []
        for part in parts:
            kind = part.get("type")
            if kind == "text":
                out.append(str(part["text"]))
            elif kind in ("image", "video"):
                if in_system:
                    raise FormatError(f"System message cannot contain {kind}s.")
                if kind == "image":
                    self.images += count
                    if self.add_ids:
                        out.append(f"Picture {self.images}: ")
                    out.append("<|vision_start|><|image_pad|><|vision_end|>")
                else:
                    self.videos += count
                    if self.add_ids:
                        out.append(f"Video {self.videos}: ")
                    out.append("<|vision_start|><|video_pad|><|vision_end|>")
            else:
                raise FormatError("Unexpected item type in content.")
        return "".join(out)


@dataclass(slots=True)
class _Msg:
    index: int
    role: str
    parts: str | list[dict[str, Any]]
    """Plain string content as is (the hot path), else vLLM's "openai" parts."""
    source: Message


def _prepare(messages: Sequence[Message]) -> list[_Msg]:
    """vLLM's preprocessing, in its order: content to parts (billing line dropped from
    system, text-only tool results joined), then developer → system consolidation."""
    if not isinstance(messages, list | tuple):
        raise FormatError("messages must be a list")
    pairs = normalize.developer_to_system(
        [m if isinstance(m, (dict, Mapping)) else _not_object(m) for m in messages]
    )
    prepared: list[_Msg] = []
    for index, m in pairs:
        role = m.get("role")
        if not isinstance(role, str):
            raise FormatError(f"message {index}: role must be a string")
        content = m.get("content")
        parts: str | list[dict[str, Any]]
        if isinstance(content, str) and not (role == "system" and content.startswith(normalize.BILLING_HEADER)):
            parts = content
        else:
            parts = normalize.content_parts(content)
            if role == "system":
                parts = normalize.strip_billing_header(parts)
            elif role == "tool":
                parts = normalize.tool_result_parts(parts)
        prepared.append(_Msg(index, role, parts, m))
    return prepared


def _not_object(m: object) -> Message:
    raise FormatError(f"each message must be an object, not {type(m).__name__}")


def _last_query(msgs: Sequence[_Msg], vision: _Vision) -> int:
    for pos in range(len(msgs) - 1, -1, -1):
        m = msgs[pos]
        if m.role != "user":
            continue
        text = vision.render(m.parts, count=False).strip()
        if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
            return pos
    raise FormatError("No user query found in messages.")


def split_reasoning(message: Message, text: str) -> tuple[str, str]:
    """(reasoning, content) of an assistant message, as the 3.5/3.6 templates derive them:
    the reasoning field if it is a string, else a `<think>…</think>` prefix of the content."""
    reasoning = normalize.unify_reasoning(message)
    if reasoning is None:
        reasoning = ""
        if "</think>" in text:
            head, _, _ = text.partition("</think>")
            reasoning = head.rstrip("\n").split("<think>")[-1].lstrip("\n")
            text = text.split("</think>")[-1].lstrip("\n")
    return reasoning.strip(), text


def render_tool_call_xml(name: str, arguments: Mapping[str, Any]) -> str:
    out = ["<tool_call>\n<function=", name, ">\n"]
    for key, value in arguments.items():
        out += ["<parameter=", str(key), ">\n", value if isinstance(value, str) else _dumps(value), "\n</parameter>\n"]
    out.append("</function>\n</tool_call>")
    return "".join(out)


def render_tool_call_json(name: str, arguments: Mapping[str, Any]) -> str:
    return "<tool_call>\n" + _dumps({"name": name, "arguments": dict(arguments)}) + "\n</tool_call>"


@functools.lru_cache(maxsize=8192)
def _call_text_cached(style: str, name: str, arguments: str | Mapping[str, Any]) -> str:
    args = normalize.canonical_arguments(arguments)
    return render_tool_call_xml(name, args) if style == "xml" else render_tool_call_json(name, args)


class Qwen3xFormat(ChatFormat):
    """Qwen3.5/3.6: system + tools block, trimmed bodies, `<think>` blocks, XML tool calls."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        name: str = "qwen3x",
        tool_call_style: ToolCallStyle = "xml",
        stop_ids: frozenset[int] | None = None,
        drop_ids: frozenset[int] | None = None,
        cache_tokens: int = 4_000_000,
    ) -> None:
        """`stop_ids`: what the engine stops on (default `<|im_end|>`). `drop_ids`: special
        ids the output parser drops, transformers' `all_special_ids` (default: every added
        token marked special)."""
        if tool_call_style not in ("xml", "json"):
            raise ValueError(f"tool_call_style must be 'xml' or 'json', got {tool_call_style!r}")
        self.name = name
        self.tokenizer = tokenizer
        self.tool_call_style: ToolCallStyle = tool_call_style
        self.cache = ChunkCache(tokenizer.encode, cache_tokens)
        self._stop = stop_ids or frozenset((tokenizer.token_id(IM_END),))
        self._drop = tokenizer.special_ids if drop_ids is None else drop_ids
        for marker in ("<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
            tokenizer.token_id(marker)  # fail at load time, not on the first request

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop

    # -- chunks -------------------------------------------------------------------------

    def _system_chunk(self, tools: list[dict[str, Any]] | None, system_text: str | None) -> str | None:
        if tools:
            instructions = XML_INSTRUCTIONS if self.tool_call_style == "xml" else JSON_INSTRUCTIONS
            body = TOOLS_HEADER + "".join("\n" + _dumps(t) for t in tools) + instructions
            if system_text:
                body += "\n\n" + system_text
            return IM_START + "system\n" + body + IM_END + "\n"
        if system_text is not None:
            return IM_START + "system\n" + system_text + IM_END + "\n"
        return None

    def _assistant_chunk(self, m: _Msg, text: str, think: bool, *, close: bool = True) -> str:
        reasoning, text = split_reasoning(m.source, text)
        head = IM_START + "assistant\n"
        if think:
            head += "<think>\n" + reasoning + "\n</think>\n\n"
        if not close:
            return head + text
        calls = m.source.get("tool_calls")
        if not calls:
            if calls is not None and not isinstance(calls, list):
                normalize.canonical_tool_calls(calls)  # raises the right error
            return head + text + IM_END + "\n"
        out = [head, text]
        for j, call in enumerate(calls):
            if j:
                out.append("\n")
            elif text.strip():
                out.append("\n\n")
            out.append(self._call_text(call))
        out.append(IM_END + "\n")
        return "".join(out)

    def _call_text(self, call: Any) -> str:
        """One call's text; memoized on the wire form (name, JSON string), so a long history
        does not re-parse every call's arguments on every request."""
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            name, args = function.get("name"), function.get("arguments")
            if isinstance(name, str) and isinstance(args, str) and call.get("type", "function") == "function":
                return _call_text_cached(self.tool_call_style, name, args)
        (checked,) = normalize.canonical_tool_calls([call])
        return _call_text_cached.__wrapped__(self.tool_call_style, checked["name"], checked["arguments"])

    def _body_chunks(
        self,
        msgs: Sequence[_Msg],
        vision: _Vision,
        *,
        think_from: int,
        preserve_thinking: bool,
        continue_final: bool,
    ) -> list[tuple[int | None, str]]:
        """(message index, chunk text) for every non-system message, in order."""
        chunks: list[tuple[int | None, str]] = []
        last = len(msgs) - 1
        for pos, m in enumerate(msgs):
            role = m.role
            if role == "system":
                raise FormatError("System message must be at the beginning.")
            text = vision.render(m.parts, count=True).strip()
            if role == "user":
                chunks.append((m.index, IM_START + "user\n" + text + IM_END + "\n"))
            elif role == "assistant":
                think = preserve_thinking or pos > think_from
                closing = not (continue_final and pos == last)
                chunks.append((m.index, self._assistant_chunk(m, text, think, close=closing)))
            elif role == "tool":
                opener = IM_START + "user" if pos == 0 or msgs[pos - 1].role != "tool" else ""
                closer = IM_END + "\n" if pos == last or msgs[pos + 1].role != "tool" else ""
                chunks.append((m.index, opener + "\n<tool_response>\n" + text + "\n</tool_response>" + closer))
            else:
                raise FormatError("Unexpected message role.")
        return chunks

    def _assemble(self, chunks: Sequence[tuple[int | None, str]], generation: str | None) -> Rendered:
        return assemble(self.cache.ids, chunks, generation)

    # -- API ----------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> Rendered:
        msgs = _prepare(messages)
        if not msgs:
            raise FormatError("No messages provided.")
        if continue_final_message and (add_generation_prompt or msgs[-1].role != "assistant"):
            raise FormatError("continue_final_message needs a final assistant message and no generation prompt")
        vision = _Vision(add_ids=template_kwargs.get("add_vision_id") is True)
        canon_tools = normalize.canonical_tools(tools)
        chunks: list[tuple[int | None, str]] = []
        body = msgs
        system_text: str | None = None
        if msgs[0].role == "system":
            system_text = vision.render(msgs[0].parts, count=False, in_system=True).strip()
            body = msgs[1:]
        system = self._system_chunk(canon_tools, system_text)
        if system is not None:
            chunks.append((msgs[0].index if system_text is not None else None, system))
        think_from = _last_query(msgs, vision) - (len(msgs) - len(body))
        chunks += self._body_chunks(
            body,
            vision,
            think_from=think_from,
            preserve_thinking=template_kwargs.get("preserve_thinking") is True,
            continue_final=continue_final_message,
        )
        generation = None
        if add_generation_prompt:
            generation = GENERATION_NO_THINKING if enable_thinking is False else GENERATION_THINKING
        return self._assemble(chunks, generation)

    def render_continuation(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        after_stop: bool = True,
    ) -> list[int]:
        # Appended messages render as they would in place in a full render with
        # preserve_thinking (assistant turns keep their think block): the transcript is
        # append-only, so nothing earlier is re-rendered. `tools` cannot change mid-transcript
        # (it lives in the first turn) and is accepted only for interface symmetry.
        del tools
        msgs = _prepare(messages)
        chunks: list[tuple[int | None, str]] = [(None, "\n" if after_stop else IM_END + "\n")]
        chunks += self._body_chunks(
            msgs, _Vision(add_ids=False), think_from=-1, preserve_thinking=True, continue_final=False
        )
        generation = None
        if add_generation_prompt:
            generation = GENERATION_NO_THINKING if enable_thinking is False else GENERATION_THINKING
        return self._assemble(chunks, generation).ids

    def parser(
        self,
        *,
        enable_thinking: bool = True,
        tools: Sequence[Tool] | None = None,
        tool_call_id: ToolCallIdFactory | None = None,
        tool_calls: bool = True,
    ) -> OutputParser:
        return Qwen3xParser(
            self.tokenizer,
            enable_thinking=enable_thinking,
            tools=normalize.canonical_tools(tools),
            style=self.tool_call_style,
            tool_call_id=tool_call_id,
            drop_ids=self._drop | self._stop,
            tool_calls=tool_calls,
        )

    def forced_tool_outputs(
        self, tools: Sequence[Tool], name: str | None, *, parallel: bool = True
    ) -> dict[str, Any] | None:
        """An xgrammar structural tag in the template's call syntax, as vLLM builds for its
        `qwen3_coder` (xgrammar's builtin `qwen_3_coder`) and `hermes` tool parsers. It starts
        where reasoning ends (the engine's reasoning parser gates it), like vLLM's chat endpoint."""
        chosen = [t for t in tools if name is None or (t.get("function") or {}).get("name") == name]
        if self.tool_call_style == "xml":
            tags = [
                {
                    "type": "tag",
                    "begin": f"<tool_call>\n<function={t['function']['name']}>\n",
                    "content": {"type": "json_schema", "json_schema": _parameters(t), "style": "qwen_xml"},
                    "end": "\n</function>\n</tool_call>",
                }
                for t in chosen
            ]
            if name is not None:
                fmt: dict[str, Any] = tags[0]
            else:
                fmt = {
                    "type": "triggered_tags",
                    "triggers": ["<tool_call>\n<function="],
                    "tags": tags,
                    "at_least_one": True,
                    "stop_after_first": not parallel,
                    "excludes": ["<think>", "</think>"],
                }
        else:
            tags = [
                {
                    "type": "tag",
                    "begin": '<tool_call>\n{"name": "' + t["function"]["name"] + '", "arguments": ',
                    "content": {"type": "json_schema", "json_schema": _parameters(t)},
                    "end": "}\n</tool_call>",
                }
                for t in chosen
            ]
            fmt = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": "\n",
                "at_least_one": True,
                "stop_after_first": name is not None or not parallel,
            }
        return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)}


def _parameters(tool: Mapping[str, Any]) -> Any:
    params = (tool.get("function") or {}).get("parameters")
    return params if params else {"type": "object", "properties": {}}
