"""OpenAI chat completion output, built as bytes/dicts straight from the parser's deltas.

No pydantic per chunk (a measured CPU trap, proxy_anchors.md §7): each chunk is a precomputed
prefix + the delta's JSON + suffix. Deltas are encoded with msgspec: the same bytes as compact
`json.dumps(ensure_ascii=False)` (checked on 200K random strings), ~30x cheaper per chunk.
Reasoning goes out under both names, `reasoning_content` (DeepSeek Harness reads only that) and
`reasoning` (vLLM's own field).
"""

from __future__ import annotations

import json
import secrets
import string
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from proxy.format.base import Delta, DeltaKind, ParsedOutput

_ALPHABET = string.ascii_letters + string.digits


def tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def sse(data: Any) -> bytes:
    return b"data: " + _dumps(data).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(upstream: str | None, had_tool_calls: bool) -> str:
    """OpenAI's finish reasons from vLLM's: a turn that called tools ends with `tool_calls`."""
    if upstream == "length":
        return "length"
    return "tool_calls" if had_tool_calls else "stop"


class ChunkWriter:
    """Serializes one streamed response: role chunk, delta chunks, finish chunk, usage chunk."""

    def __init__(self, cid: str, model: str, created: int | None = None) -> None:
        created = int(time.time()) if created is None else created
        head = f'{{"id":{_dumps(cid)},"object":"chat.completion.chunk","created":{created},"model":{_dumps(model)},'
        self._prefix = (head + '"choices":[{"index":0,"delta":').encode()
        self._head = head.encode()
        self.tool_calls = 0

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: list[Any] | None = None) -> bytes:
        if logprobs is not None:
            return self._chunk_logprobs(delta, finish, logprobs)
        tail = ',"logprobs":null,"finish_reason":' + (_dumps(finish) if finish else "null") + "}]}\n\n"
        return b"data: " + self._prefix + msgspec.json.encode(delta) + tail.encode()

    def _chunk_logprobs(self, delta: dict[str, Any], finish: str | None, logprobs: list[Any]) -> bytes:
        lp = b',"logprobs":{"content":' + msgspec.json.encode(logprobs) + b"}"
        tail = ',"finish_reason":' + (_dumps(finish) if finish else "null") + "}]}\n\n"
        return b"data: " + self._prefix + msgspec.json.encode(delta) + lp + tail.encode()

    def role(self, prompt_ids: Sequence[int] | None = None) -> bytes:
        if prompt_ids is None:
            return self._chunk({"role": "assistant", "content": ""})
        # vLLM's return_token_ids extension: the prompt ids ride on the first chunk.
        head = self._head + b'"prompt_token_ids":[' + ",".join(map(str, prompt_ids)).encode() + b"],"
        return (
            b"data: " + head + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def deltas(self, deltas: list[Delta], logprobs: list[Any] | None = None) -> bytes:
        """One chunk per run of text deltas, one per tool-call event; b"" when nothing to send (iff
        `deltas` is empty). `logprobs` (chat `logprobs.content` entries) ride on the first chunk."""
        if logprobs is not None:
            return self._deltas_logprobs(deltas, logprobs)
        out: list[bytes] = []
        text: dict[str, str] = {}
        for d in deltas:
            if d.kind is DeltaKind.CONTENT:
                text["content"] = text.get("content", "") + d.text
            elif d.kind is DeltaKind.REASONING:
                text["reasoning_content"] = text.get("reasoning_content", "") + d.text
            else:
                if text:
                    out.append(self._text_chunk(text))
                    text = {}
                out.append(self._chunk({"tool_calls": [self._tool_delta(d)]}))
        if text:
            out.append(self._text_chunk(text))
        return b"".join(out)

    def _deltas_logprobs(self, deltas: list[Delta], logprobs: list[Any]) -> bytes:
        out = self.deltas(deltas)
        if not out:
            return out
        first = out.index(b"\n\n") + 2
        head = out[:first]
        cut = head.rindex(b',"logprobs":null,')
        lp = b',"logprobs":{"content":' + msgspec.json.encode(logprobs) + b"},"
        return head[:cut] + lp + head[cut + len(b',"logprobs":null,') :] + out[first:]

    def _text_chunk(self, text: dict[str, str]) -> bytes:
        if "reasoning_content" in text:
            text["reasoning"] = text["reasoning_content"]
        return self._chunk(text)

    def _tool_delta(self, d: Delta) -> dict[str, Any]:
        if d.kind is DeltaKind.TOOL_CALL:
            self.tool_calls += 1
            return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        return {"index": d.index, "function": {"arguments": d.text}}

    def finish(
        self, reason: str, token_ids: Sequence[int] | None = None, logprobs: list[Any] | None = None
    ) -> bytes:
        if token_ids is None:
            return self._chunk({}, reason, logprobs)
        lp = "null" if logprobs is None else '{"content":' + msgspec.json.encode(logprobs).decode() + "}"
        tail = f',"logprobs":{lp},"finish_reason":{_dumps(reason)},"token_ids":{_dumps(list(token_ids))}}}]}}\n\n'
        return b"data: " + self._prefix + b"{}" + tail.encode()

    def usage(self, usage: dict[str, Any]) -> bytes:
        return b"data: " + self._head + b'"choices":[],"usage":' + _dumps(usage).encode() + b"}\n\n"

    def error(self, message: str, type_: str = "upstream_error") -> bytes:
        return sse({"error": {"message": message, "type": type_, "param": None, "code": None}})


class ArgumentsGate:
    """Checks streamed tool-call argument fragments against the parser's final arguments.

    Fragments stream through as they come (incremental `tool_calls`); at the end, a call that got
    no fragment gets its final arguments, and a call whose concatenated fragments differ from the
    final (non-streaming) arguments is reported in `mismatches` (logged and counted by the caller).
    Why: a client that concatenates fragments must end with exactly the non-streaming arguments;
    an early parser once leaked XML markup into fragments, and that must not go unnoticed again.
    """

    def __init__(self) -> None:
        self._sent: dict[int, str] = {}
        self.mismatches: list[tuple[int, str, str]] = []

    def filter(self, deltas: list[Delta]) -> list[Delta]:
        for d in deltas:
            if d.kind is DeltaKind.ARGUMENTS:
                self._sent[d.index] = self._sent.get(d.index, "") + d.text
        return deltas

    def flush(self, parsed: ParsedOutput) -> list[Delta]:
        out = []
        for i, call in enumerate(parsed.tool_calls):
            sent = self._sent.get(i)
            if sent is None:
                out.append(Delta(DeltaKind.ARGUMENTS, call.arguments, index=i))
            elif not _same_json(sent, call.arguments or "{}"):
                self.mismatches.append((i, sent, call.arguments))
        return out


def _same_json(a: str, b: str) -> bool:
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


def assistant_message(parsed: ParsedOutput) -> dict[str, Any]:
    """The reply as an OpenAI message (non-streaming responses, and the transcript's reply key)."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        msg["reasoning_content"] = parsed.reasoning
        msg["reasoning"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    return msg


def completion_body(
    cid: str,
    model: str,
    message: dict[str, Any],
    finish: str,
    usage: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        "usage": usage,
    }
