"""Anthropic Messages (`POST /v1/messages`) on the proxy's own token-exact chat path.

DeepSeek Harness' native route posts Anthropic Messages (issue 5): top-level `system`, tools in Anthropic
form, `thinking: {type: enabled}` without a budget (vLLM's own /v1/messages answers that with a 400),
`output_config.effort`. Rather than relaying to vLLM, a request is translated to an OpenAI chat request and
served by `ChatService` like any other, so Anthropic sessions get the same transcripts and cache hits;
the answer (or its stream) is translated back.

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
from collections.abc import AsyncIterator, Iterable
from typing import Any

from proxy.errors import InvalidRequest, ProxyError

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


def usage_of(usage: dict[str, Any] | None) -> dict[str, int]:
    """OpenAI usage -> Anthropic usage: cached prompt tokens are reported apart from `input_tokens`."""
    u = usage or {}
    prompt = int(u.get("prompt_tokens") or 0)
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": int(u.get("completion_tokens") or 0)}


def to_message(completion: dict[str, Any], model: str) -> dict[str, Any]:
    """A non-streamed OpenAI chat completion as an Anthropic message."""
    choice = completion["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _arguments(call["function"].get("arguments"))})
    return {"id": message_id(), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": _stop_reason(choice.get("finish_reason"), bool(msg.get("tool_calls"))),
            "stop_sequence": None, "usage": usage_of(completion.get("usage"))}


def _stop_reason(finish: str | None, called: bool) -> str:
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


def chat_events(chunks: Iterable[bytes]) -> Iterable[dict[str, Any]]:
    """The JSON objects of OpenAI SSE bytes (a chunk from the chat pipeline holds one or more events)."""
    for chunk in chunks:
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: {"):
                yield json.loads(line[6:])


class MessageStream:
    """Turns the chat pipeline's OpenAI stream into Anthropic stream events: message_start, one
    content block per kind run (thinking / text / each tool_use), message_delta with the stop reason
    and usage, message_stop. Blocks are closed as soon as another kind starts, as Anthropic does."""

    def __init__(self, model: str, input_tokens: int) -> None:
        self.model = model
        self.input_tokens = input_tokens
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool:<n>"
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.called = False

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

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        if chunk.get("error"):
            err = chunk["error"]
            error = {"type": "api_error", "message": err.get("message", "")}
            return [event("error", {"type": "error", "error": error})]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self.open != "text":
                    out += self._switch("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                key = f"tool:{call.get('index', 0)}"
                if call.get("id") and self.open != key:
                    block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                    out += self._switch(key, block)
                    self.called = True
                args = (call.get("function") or {}).get("arguments")
                if args and self.open == key:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> list[bytes]:
        out = self._close()
        usage = usage_of(self.usage)
        out.append(event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": _stop_reason(self.finish, self.called), "stop_sequence": None},
            "usage": usage,
        }))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out


async def translate_stream(chunks: AsyncIterator[bytes], model: str, input_tokens: int) -> AsyncIterator[bytes]:
    """Anthropic SSE bytes from the chat pipeline's OpenAI SSE bytes."""
    stream = MessageStream(model, input_tokens)
    yield stream.start()
    failed = False
    async for chunk in chunks:
        for obj in chat_events([chunk]):
            for out in stream.feed(obj):
                failed = failed or out.startswith(b"event: error")
                yield out
    if not failed:
        for out in stream.end():
            yield out


__all__ = ["MessageStream", "anthropic_error", "to_chat_request", "to_message", "translate_stream", "usage_of"]
