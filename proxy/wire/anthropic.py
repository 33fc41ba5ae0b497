"""Anthropic Messages (`POST /v1/messages`) on the wire, served by the proxy's own token-exact turn.

DeepSeek Harness' native route posts Anthropic Messages (issue 5): top-level `system`, tools in Anthropic
form, `thinking: {type: enabled}` without a budget (vLLM's own /v1/messages answers that with a 400),
`output_config.effort`. Rather than relaying to vLLM, a request is translated to an OpenAI chat request (the proxy's
internal shape) and served as a turn like any other, so Anthropic sessions get the same transcripts,
admission and cache hits; the turn's typed events are written out as Anthropic events.

Translation is ours, not litellm's: it is ~250 lines, and litellm's adapter pulls its whole dependency
tree into the proxy process and was measured as a 10 ms / 550 µs-per-event relay (proxy_anchors.md §8).

Mapping (request): `system` -> a system message; user `tool_result` blocks -> `tool` messages (before the
user's own text, in order); assistant `thinking` -> `reasoning_content`, `tool_use` -> `tool_calls` with
JSON arguments; tools `input_schema` -> function `parameters` (server tools such as web search are
dropped: nothing here can run them); `tool_choice` any/tool/none -> required/function/none (enforced
by the chat path with structured outputs; `disable_parallel_tool_use` -> `parallel_tool_calls: false`);
`stop_sequences` -> `stop`. Response: `reasoning_content` -> a `thinking` block, `tool_calls` ->
`tool_use` blocks; finish reasons stop/length/tool_calls -> end_turn/max_tokens/tool_use (and tool_use
whenever a tool was called: a forced named call finishes with "stop" on the OpenAI side); cached prompt
tokens are reported as `cache_read_input_tokens` (and left out of `input_tokens`, as Anthropic counts).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from proxy.errors import InvalidRequest, ProxyError
from proxy.format.base import Delta, DeltaKind
from proxy.reply import DeltaEvent, FinalEvent, Usage
from proxy.wire import LastChunk, Opening

if TYPE_CHECKING:
    from proxy.normalize import NormalizedChat
    from proxy.turn import Turn

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop_sequences": "stop"}
# Fields that are not sampling or content: carried over for the quirks (thinking switch, session ids).
# vLLM's own extensions (structured outputs, ...) ride along as on the chat route.
_CARRIED = ("thinking", "output_config", "metadata", "dsh_session_log", "dsh_plugin_packages",
            "structured_outputs", "min_tokens", "ignore_eos")


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def anthropic_error(exc: ProxyError) -> dict[str, Any]:
    """Anthropic's error body; its `type` names follow the HTTP status as Anthropic's own API does."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 415: "invalid_request_error",
             429: "rate_limit_error", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kinds.get(exc.status, "api_error"), "message": exc.message}}


def _text_of(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if blocks is None:
        return ""
    if not isinstance(blocks, list):
        raise InvalidRequest(f"{where}: expected a string or a list of blocks", param=where)
    out = []
    for block in blocks:
        if isinstance(block, dict) and block.get("type") == "text":
            out.append(str(block.get("text", "")))
    return "".join(out)


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content")
    text = _text_of(content, where + ".content") if not isinstance(content, str) else content
    if block.get("is_error"):
        text = "Error: " + text
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequest(f"{where}: tool_result needs a tool_use_id", param=where)
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content: expected a string or a list of blocks", param=where)
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise InvalidRequest(f"{where}.content.{i}: expected an object", param=where)
        kind = block.get("type")
        if kind == "tool_result":
            tools.append(_tool_result(block, f"{where}.content.{i}"))
        elif kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind in ("image", "document"):
            source = block.get("source") or {}
            if source.get("type") == "base64":
                url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
            else:
                url = str(source.get("url", ""))
            parts.append({"type": "image_url", "image_url": {"url": url}})
    out = list(tools)
    if parts:
        # One plain string when the message is only text: the same prompt as an OpenAI client's.
        texts = [p["text"] for p in parts if p["type"] == "text"]
        out.append({"role": "user", "content": "".join(texts) if len(texts) == len(parts) else parts})
    return out


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content: expected a string or a list of blocks", param=where)
    text, reasoning, calls = [], [], []
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "thinking":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "tool_use":
            args = block.get("input") if isinstance(block.get("input"), dict) else {}
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": str(block.get("name", "")),
                                       "arguments": json.dumps(args, ensure_ascii=False)}})
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        # Server tools (web_search_20250305, code_execution, ...) have a versioned `type` and no schema.
        if not isinstance(tool, dict) or "input_schema" not in tool:
            continue
        fn: dict[str, Any] = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return kind if kind in ("auto", "none") else None


def to_chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as an OpenAI chat request (validation of the result is the chat
    pipeline's; here only what the translation itself needs)."""
    messages: list[dict[str, Any]] = []
    system = _text_of(body.get("system"), "system")
    if system:
        messages.append({"role": "system", "content": system})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages: expected a non-empty list", param="messages")
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise InvalidRequest(f"messages.{i}.role: expected 'user' or 'assistant'", param=f"messages.{i}")
        if msg["role"] == "user":
            messages.extend(_user_messages(msg.get("content"), f"messages.{i}"))
        else:
            messages.append(_assistant_message(msg.get("content"), f"messages.{i}"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": bool(body.get("stream")),
                            "stream_options": {"include_usage": True}}
    if isinstance(body.get("max_tokens"), int):
        chat["max_tokens"] = body["max_tokens"]
    for src, dst in _SAMPLING.items():
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        if isinstance(body.get("tool_choice"), dict) and body["tool_choice"].get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    for name in _CARRIED:
        if name in body:
            chat[name] = body[name]
    return chat


def usage_of(usage: Usage) -> dict[str, int]:
    """Anthropic usage: cached prompt tokens are reported apart from `input_tokens`."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens, "output_tokens": usage.completion_tokens}


def to_message(final: FinalEvent, model: str) -> dict[str, Any]:
    """A finished turn as one Anthropic message."""
    parsed = final.parsed
    content: list[dict[str, Any]] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _arguments(call.arguments)})
    return {"id": message_id(), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(final.finish, final.called), "stop_sequence": None,
            "usage": usage_of(final.usage)}


def stop_reason(finish: str | None, called: bool) -> str:
    """A forced call to a named function finishes with "stop" on the OpenAI side; Anthropic says
    tool_use whenever the answer calls a tool."""
    if called and finish in (None, "stop"):
        return "tool_use"
    return STOP_REASONS.get(finish or "stop", "end_turn")


def _arguments(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def event(name: str, data: dict[str, Any]) -> bytes:
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {payload}\n\n".encode()


def error_event(exc: ProxyError) -> bytes:
    return event("error", anthropic_error(exc))


class MessageStream:
    """A turn's deltas as Anthropic stream events: message_start, one content block per kind run
    (thinking / text / each tool_use), message_delta with the stop reason and usage, message_stop.
    Blocks are closed as soon as another kind starts, as Anthropic does."""

    def __init__(self, model: str, input_tokens: int) -> None:
        self.model = model
        self.input_tokens = input_tokens
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool:<n>"

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": message_id(), "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return event("message_start", {"type": "message_start", "message": message})

    def _switch(self, key: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = key
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block}))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def deltas(self, deltas: list[Delta]) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            if d.kind is DeltaKind.REASONING:
                if not d.text:
                    continue
                if self.open != "thinking":
                    out += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": d.text}))
            elif d.kind is DeltaKind.CONTENT:
                if not d.text:
                    continue
                if self.open != "text":
                    out += self._switch("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d.text}))
            elif d.kind is DeltaKind.TOOL_CALL:
                out += self._switch(f"tool:{d.index}", {"type": "tool_use", "id": d.id, "name": d.name, "input": {}})
            elif d.text and self.open == f"tool:{d.index}":  # arguments of the open tool_use block
                out.append(self._delta({"type": "input_json_delta", "partial_json": d.text}))
        return out

    def end(self, final: FinalEvent) -> list[bytes]:
        out = self.deltas(final.tail)
        out += self._close()
        out.append(event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(final.finish, final.called), "stop_sequence": None},
            "usage": usage_of(final.usage),
        }))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out


class AnthropicWire:
    """`Wire` for /v1/messages."""

    route = "messages"

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def opening(self, chat: NormalizedChat, prompt: Sequence[int]) -> Opening[MessageStream]:
        stream = MessageStream(self.model_name, len(prompt))
        return Opening(stream.start(), stream)

    async def stream(self, turn: Turn, opening: Opening[MessageStream] | None = None) -> AsyncIterator[bytes]:
        if opening is None:
            opening = self.opening(turn.request.chat, turn.prompt)
        stream = opening.writer
        try:
            if not opening.sent:
                yield opening.chunk
            last = b""
            async for ev in turn.events():
                if isinstance(ev, DeltaEvent):
                    # One write per upstream read: its events joined, not one ASGI send per event.
                    out = b"".join(stream.deltas(ev.deltas))
                    if out:
                        yield out
                else:  # the end leaves in one write with the response's end, after the events ended
                    last = b"".join(stream.end(ev))
            yield LastChunk(last)
        except ProxyError as exc:
            yield LastChunk(error_event(exc))
        finally:
            turn.close()  # also when the client left before the first event

    async def complete(self, turn: Turn) -> dict[str, Any]:
        return to_message(await turn.collect(), self.model_name)

    def error_body(self, exc: ProxyError) -> dict[str, Any]:
        return anthropic_error(exc)

    def error_event(self, exc: ProxyError) -> bytes:
        return error_event(exc)


__all__ = ["AnthropicWire", "MessageStream", "anthropic_error", "error_event", "to_chat_request", "to_message",
           "usage_of"]
