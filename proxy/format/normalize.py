"""Request normalization that belongs to the format: each function reproduces one step of
vLLM 0.32's chat preprocessing (`renderers/chat_utils.py`, `renderers/hf.py`, the chat request
validators), so that our prompt ids equal the engine's and stay stable across clients that
spell the same conversation differently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.format.base import FormatError, Message, Tool

# vLLM's TEXT_PART_TYPES and the field each one carries its text in.
_TEXT_PART_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image_pil", "image_embeds", "image"})
_VIDEO_PART_TYPES = frozenset({"video_url", "video_embeds", "video"})
_AUDIO_PART_TYPES = frozenset({"audio_url", "input_audio", "audio_embeds", "audio"})

# Claude Code puts a per-request billing line first in its system prompt; vLLM drops it
# (chat_utils._strip_claude_code_billing_header) because it changes on every request.
BILLING_HEADER = "x-anthropic-billing-header"


def content_parts(content: Any) -> list[dict[str, Any]]:
    """Content as vLLM's "openai" format hands it to a template: a list of `{"type": "text",
    "text"}` / `{"type": "image"}` / `{"type": "video"}` / `{"type": "audio"}` parts.

    A string becomes one text part, None no parts; text parts whose text is None are skipped.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise FormatError(f"message content must be a string, a list or null, not {type(content).__name__}")
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, Mapping):
            raise FormatError(f"content part must be an object or a string, not {type(part).__name__}")
        kind = part.get("type")
        if kind is None:  # vLLM accepts a bare {"image_url": ...}
            kind = next((k for k in ("image_url", "image_pil", "audio_url", "video_url") if k in part), None)
        if kind in _TEXT_PART_FIELDS:
            text = part.get(_TEXT_PART_FIELDS[kind])
            if text is not None:
                parts.append({"type": "text", "text": str(text)})
        elif kind in _IMAGE_PART_TYPES:
            parts.append({"type": "image"})
        elif kind in _VIDEO_PART_TYPES:
            parts.append({"type": "video"})
        elif kind in _AUDIO_PART_TYPES:
            parts.append({"type": "audio"})
        else:
            raise FormatError(f"unsupported chat content part type: {kind!r}")
    return parts


def text_of(parts: Sequence[Mapping[str, Any]], sep: str = "") -> str:
    """Join the text parts (Qwen templates concatenate; vLLM's "string" format joins with "\\n")."""
    return sep.join(p["text"] for p in parts if p.get("type") == "text")


def strip_billing_header(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop Claude Code's volatile `x-anthropic-billing-header` line from system text parts."""
    out: list[dict[str, Any]] = []
    for part in parts:
        text = part.get("text") if part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append({**part, "text": rest})
    return out


def tool_result_parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM joins an all-text tool result with "\\n" (Claude Code / Cursor send text parts)."""
    if len(parts) <= 1 or any(p.get("type") != "text" for p in parts):
        return parts
    return [{"type": "text", "text": "\n".join(p["text"] for p in parts)}]


def developer_to_system(messages: Sequence[Message]) -> list[tuple[int, Message]]:
    """`developer` → `system`, as vLLM does for templates without a developer role.

    Only when a developer message is present, vLLM also merges every system message into one
    at position 0 (texts joined with "\\n\\n", list parts with "\\n", empty ones dropped).
    Returns (original index, message) pairs; a merged message keeps the first one's index.
    """
    if not any(m.get("role") == "developer" for m in messages):
        return list(enumerate(messages))
    first_system: int | None = None
    texts: list[str] = []
    rest: list[tuple[int, Message]] = []
    for i, m in enumerate(messages):
        if m.get("role") not in ("system", "developer"):
            rest.append((i, m))
            continue
        if first_system is None:
            first_system = i
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(
                p if isinstance(p, str) else str(p["text"])
                for p in content
                if isinstance(p, str) or (isinstance(p, Mapping) and "text" in p)
            )
        if content:
            texts.append(content)
    if first_system is None:  # unreachable: a developer message exists
        return rest
    merged: Message = {"role": "system", "content": "\n\n".join(texts)}
    return [(first_system, merged), *rest]


def unify_reasoning(message: Message) -> str | None:
    """The message's reasoning, whichever field the client used.

    vLLM renames `reasoning_content` to `reasoning` unless `reasoning` is set, and templates
    then see it as `reasoning_content`. Only a non-null value counts (an empty string does).
    """
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if reasoning is None:
        return None
    if not isinstance(reasoning, str):
        raise FormatError(f"reasoning must be a string, not {type(reasoning).__name__}")
    return reasoning


def canonical_arguments(arguments: Any) -> dict[str, Any]:
    """Tool-call arguments as the object templates iterate over.

    OpenAI sends a JSON string; vLLM parses it, and turns null, "", invalid JSON and
    non-object JSON into `{}` so a bad turn in history cannot fail every later request.
    """
    if not arguments:
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def canonical_tool_calls(tool_calls: Any) -> list[dict[str, Any]]:
    """Assistant `tool_calls` checked as vLLM does: objects of type function (an empty list
    means none). Returns `[{"id", "name", "arguments": dict}]`."""
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, list):
        raise FormatError("assistant tool_calls must be a list")
    calls: list[dict[str, Any]] = []
    for item in tool_calls:
        if not isinstance(item, Mapping):
            raise FormatError("assistant tool_calls entries must be objects.")
        function = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise FormatError("chat completions only support assistant tool_calls of type 'function'.")
        name = function.get("name")
        if not isinstance(name, str):
            raise FormatError("assistant tool call function.name must be a string")
        calls.append({"id": item.get("id"), "name": name, "arguments": canonical_arguments(function.get("arguments"))})
    return calls


def canonical_tool(tool: Tool) -> dict[str, Any]:
    """A tool definition exactly as vLLM's `ChatCompletionToolsParam.model_dump()` gives it to
    the template: `{"type", "function": {"name", "description", "parameters"[, "strict"]
    [, "defer_loading"]}[, "defer_loading"]}` with missing description/parameters as null and
    unknown keys dropped. The system turn embeds `json.dumps` of this, so two clients that
    send the same tool with other key orders or extra keys get the same prompt."""
    if not isinstance(tool, Mapping):
        raise FormatError(f"tool must be an object, not {type(tool).__name__}")
    if tool.get("type", "function") != "function":
        raise FormatError(f"unsupported tool type: {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise FormatError("tool.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise FormatError("tool.function.name must be a non-empty string")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise FormatError(f"tool {name!r}: description must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise FormatError(f"tool {name!r}: parameters must be a JSON Schema object, not {type(parameters).__name__}")
    defer = tool.get("defer_loading")
    fn_defer = function.get("defer_loading")
    if fn_defer is None:
        fn_defer = defer  # vLLM propagates the tool-level flag into the function
    dumped_fn: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if function.get("strict") is not None:
        dumped_fn["strict"] = function["strict"]
    if fn_defer is not None:
        dumped_fn["defer_loading"] = fn_defer
    dumped: dict[str, Any] = {"type": "function", "function": dumped_fn}
    if defer is not None:
        dumped["defer_loading"] = defer
    return dumped


def canonical_tools(tools: Sequence[Tool] | None) -> list[dict[str, Any]] | None:
    """`canonical_tool` over a request's tools; None stays None (no tools block)."""
    if tools is None:
        return None
    if not isinstance(tools, list | tuple):
        raise FormatError("tools must be a list")
    return [canonical_tool(t) for t in tools]


def tool_properties(tools: Sequence[Mapping[str, Any]] | None, name: str) -> dict[str, Any]:
    """`parameters.properties` of the named tool, or {} (vLLM's find_tool_properties)."""
    for tool in tools or ():
        function = tool.get("function")
        if isinstance(function, Mapping) and function.get("name") == name:
            params = function.get("parameters") or {}
            props = params.get("properties", {}) if isinstance(params, Mapping) else {}
            return props if isinstance(props, dict) else {}
    return {}
