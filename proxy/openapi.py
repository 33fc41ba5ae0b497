"""The proxy's own OpenAPI document: the request bodies it accepts, from its pydantic protocol types.

Served behind the key at `/openapi.json` (a client or a fuzzer reads what this proxy takes, not what
OpenAI's or Anthropic's full APIs take), and what tests/proxy/test_schemathesis.py fuzzes. FastAPI's
generated document is off (`openapi_url=None`): the routes read raw bodies (proxy/http.py `read_json`),
so it would describe no request body at all.

Chat uses proxy/protocol.py's `ChatRequest` with `messages` typed as `Message`s; the Anthropic and
completions types below exist only for the document (those bodies are translated or relayed, and
checked by proxy/protocol.py `check_anthropic_request` / proxy/normalize.py `check_generation_fields`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from proxy.protocol import ChatRequest, Message


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatBody(ChatRequest):
    messages: list[Message] = Field(min_length=1)  # type: ignore[assignment]  # the checked shape


class CompletionBody(_Doc):
    model: str | None = None
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=None, ge=0)
    n: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None


class TextBlock(_Doc):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Doc):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Doc):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Doc):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicMessage(_Doc):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]


class AnthropicTool(_Doc):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class MessagesBody(_Doc):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop_sequences: list[str] | None = None


_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"]}}}


def _post(body: type[BaseModel], summary: str, error: dict[str, Any]) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "$ref": f"#/components/schemas/{body.__name__}"}}}},
        "responses": {"200": {"description": "the answer (JSON, or an SSE stream when `stream` is true)"},
                      "4XX": {"description": "refused", "content": {"application/json": {"schema": error}}}},
    }}


def openapi_document(title: str = "HyperHarness proxy") -> dict[str, Any]:
    """The OpenAPI 3.1 document of the proxy's chat, messages, completions and models routes."""
    bodies = (ChatBody, CompletionBody, MessagesBody)
    schemas: dict[str, Any] = {}
    for body in bodies:
        schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[body.__name__] = schema
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        },
        "security": [{"bearer": []}, {"x-api-key": []}],
        "paths": {
            "/v1/chat/completions": _post(ChatBody, "OpenAI chat completions (the proxy's own turn)", _ERROR),
            "/v1/completions": _post(CompletionBody, "OpenAI completions (relayed to the engine)", _ERROR),
            "/v1/messages": _post(MessagesBody, "Anthropic Messages (the proxy's own turn)", _ANTHROPIC_ERROR),
            "/v1/models": {"get": {"summary": "the one served model", "responses": {
                "200": {"description": "an OpenAI model list"},
                "4XX": {"description": "refused", "content": {"application/json": {"schema": _ERROR}}}}}},
        },
    }
