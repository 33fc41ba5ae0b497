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


class ChatRequest(_Open):
    model: str | None = None
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
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
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
    if req.model_extra:
        log.debug("ignoring unknown request fields: %s", sorted(req.model_extra))
    return req
