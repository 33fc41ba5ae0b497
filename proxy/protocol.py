"""OpenAI chat request types (pydantic): validation of what harnesses send, nothing more.

Requests are validated here and then handled as plain dicts: the models accept unknown fields
(`extra="allow"`, logged at debug) so a new client field never breaks a harness. Responses and
stream chunks are built as dicts in proxy/chat_output.py, because pydantic per SSE chunk is a known
CPU trap (proxy_anchors.md §7).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from proxy.errors import InvalidRequest

log = logging.getLogger("proxy.protocol")

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None


class ContentPart(_Open):
    type: str
    text: str | None = None


class Message(_Open):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _object_schema(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"function parameters must be a JSON-schema object, got {type(value).__name__}")
        return value


class ToolDef(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Open):
    include_usage: bool | None = None


INT64 = 2**63 - 1
# Template kwargs a client may set: the switches our formats document (proxy/format/qwen3x.py, the
# quirks' thinking switch). Any other kwarg, or a template of the client's own, would run arbitrary
# Jinja in the proxy's renderer (vLLM's chat_template / chat_template_kwargs advisories).
TEMPLATE_KWARGS = frozenset({"enable_thinking", "preserve_thinking", "add_vision_id"})
REFUSED_FIELDS = ("chat_template", "mm_processor_kwargs")


class ChatRequest(_Open):
    # One model is served: any name maps to it (DeepSeek Harness sends its own "flash" name for side
    # requests); unless Settings.strict_model, only the type and length are checked.
    model: str | None = Field(default=None, max_length=256)
    # Shallow here; `validate_messages` checks the messages a request actually renders (on a splice,
    # only the new ones: the rest are byte-for-byte what an earlier request sent and had checked).
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None  # checked by proxy.constraints (its own 400s)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=-INT64 - 1, le=INT64)
    stop: str | list[str] | None = Field(default=None, max_length=64)
    n: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    user: str | None = None
    prompt_cache_key: str | None = None


_MESSAGES = TypeAdapter(list[Message])


def validate_messages(messages: list[dict[str, Any]], start: int = 0) -> None:
    """Validate `messages[start:]`; a failure is a 400 naming the message index and field."""
    try:
        _MESSAGES.validate_python(messages[start:])
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = list(first["loc"])
        if loc and isinstance(loc[0], int):
            loc[0] += start
        where = "messages." + ".".join(str(p) for p in loc)
        raise InvalidRequest(f"invalid request: {where}: {first['msg']}", param=where) from exc


def check_template_fields(body: dict[str, Any], req: ChatRequest) -> None:
    """Client-supplied templates are refused; template kwargs only the documented boolean switches."""
    for name in REFUSED_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequest(f"{name} is not accepted: the server renders with the model's own template",
                                 param=name)
    for key, value in (req.chat_template_kwargs or {}).items():
        if key not in TEMPLATE_KWARGS:
            raise InvalidRequest(f"chat_template_kwargs.{key} is not accepted (allowed: "
                                 f"{', '.join(sorted(TEMPLATE_KWARGS))})", param=f"chat_template_kwargs.{key}")
        if not isinstance(value, bool):
            raise InvalidRequest(f"chat_template_kwargs.{key} must be true or false",
                                 param=f"chat_template_kwargs.{key}")


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Validate a chat request; every failure is an OpenAI 400 naming the offending field."""
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"invalid request: {where}: {first['msg']}", param=where or None) from exc
    if req.n not in (None, 1):
        raise InvalidRequest(f"n={req.n} is not supported (only 1)", param="n")
    check_template_fields(body, req)
    if req.model_extra:
        log.debug("ignoring unknown request fields: %s", sorted(req.model_extra))
    return req


# -- Anthropic Messages: the block types each place may hold -------------------------------------
# (translation to the chat shape is proxy/wire/anthropic.py's; it skips what it cannot use, so a block
# in the wrong place is refused here rather than silently dropped from the prompt)

USER_BLOCKS = frozenset({"text", "image", "document", "tool_result", "search_result"})
ASSISTANT_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_use", "server_tool_use",
                              "web_search_tool_result"})
_TOOL_RESULT_BLOCKS = frozenset({"text", "image", "document", "search_result"})
_STR_FIELDS = {"text": "text", "thinking": "thinking", "tool_use": "name"}


def check_anthropic_request(body: dict[str, Any]) -> None:
    """Block types and the fields the translation reads; each failure an Anthropic-shaped 400."""
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks(system, "system", frozenset({"text"}))
    messages = body.get("messages")
    if not isinstance(messages, list):
        return  # the translation's own 400
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or isinstance(msg.get("content"), str | None):
            continue
        role = msg.get("role")
        allowed = USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS
        _check_blocks(msg["content"], f"messages.{i}.content", allowed)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("tools: expected a list", param="tools")
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools.{i}: expected an object", param=f"tools.{i}")
        if "input_schema" in tool and (not isinstance(tool["input_schema"], dict)
                                       or not isinstance(tool.get("name"), str) or not tool["name"]):
            raise InvalidRequest(f"tools.{i}: a tool needs a name and an input_schema object", param=f"tools.{i}")


def _check_blocks(blocks: Any, where: str, allowed: frozenset[str]) -> None:
    if not isinstance(blocks, list):
        raise InvalidRequest(f"{where}: expected a string or a list of blocks", param=where)
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str) or kind not in allowed:
            raise InvalidRequest(f"{at}: block type {kind!r} is not allowed here (allowed: "
                                 f"{', '.join(sorted(allowed))})", param=at)
        field = _STR_FIELDS.get(kind)
        if field is not None and not isinstance(block.get(field), str):
            raise InvalidRequest(f"{at}.{field}: expected a string", param=f"{at}.{field}")
        if kind == "tool_use" and not isinstance(block.get("input", {}), dict):
            raise InvalidRequest(f"{at}.input: expected an object", param=f"{at}.input")
        if kind == "tool_result" and not isinstance(block.get("content"), str | None):
            _check_blocks(block["content"], f"{at}.content", _TOOL_RESULT_BLOCKS)
