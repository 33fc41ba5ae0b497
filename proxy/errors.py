"""Errors the proxy answers with, all in OpenAI's JSON shape.

    ProxyError                       500 server_error
    ├── InvalidRequest               400 invalid_request_error   (bad JSON, wrong types, unknown roles)
    │   └── ContextLengthExceeded    400 code=context_length_exceeded ("maximum context length is N tokens")
    ├── AuthenticationFailed         401 code=invalid_api_key
    ├── NotFound                     404
    ├── PayloadTooLarge              413 (InvalidRequest: body over Settings.limits.max_body_bytes)
    ├── UnsupportedMediaType         415 (InvalidRequest: a body that is not JSON)
    └── UpstreamError                502 upstream_error (vLLM unreachable or answered garbage)

Harnesses start compaction on the text "maximum context length is N tokens", so only a real overflow
(prompt alone does not fit) may use it; a too-large max_tokens is capped, never reported that way.
"""

from __future__ import annotations

import json
from typing import Any


class ProxyError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None
    headers: dict[str, str] | None = None  # response headers it needs (Retry-After on a refusal)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, param=self.param, code=self.code)


class InvalidRequest(ProxyError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"

    def __init__(self, max_model_len: int, prompt_tokens: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, your messages"
            f" resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
            param="messages",
        )
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens


class AuthenticationFailed(ProxyError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(ProxyError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class PayloadTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class UnsupportedMediaType(InvalidRequest):
    status = 415
    code = "unsupported_media_type"


class UpstreamError(ProxyError):
    status = 502
    type = "upstream_error"


class UpstreamUnreachable(UpstreamError):
    """No connection was made: nothing reached the engine, so the turn may go to another one."""


def error_body(message: str, type_: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_bytes(exc: ProxyError) -> bytes:
    return json.dumps(exc.body()).encode()
