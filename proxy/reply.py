"""The assistant's reply in the proxy's own terms, shared by the turn and both wire writers.

Inside the proxy a conversation is held in OpenAI chat message shape (the Anthropic wire translates
into it), so the reply kept in a transcript is an OpenAI assistant message; each wire writer turns the
typed events of proxy/turn.py into its own bytes.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any

from proxy.format.base import Delta, ParsedOutput

_ALPHABET = string.ascii_letters + string.digits


def tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the engine served from its prefix cache


@dataclass(frozen=True, slots=True)
class DeltaEvent:
    """Parser deltas of one upstream read, with the logprobs entries of the tokens read so far."""

    deltas: list[Delta]
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class FinalEvent:
    """The end of a turn that finished normally (its transcript snapshot is already saved)."""

    finish: str  # OpenAI's: stop | length | tool_calls
    reply: dict[str, Any]  # the assistant message (OpenAI shape), as the transcript keeps it
    parsed: ParsedOutput
    tail: list[Delta]  # argument deltas of tool calls whose arguments were not streamed
    generated: list[int]
    usage: Usage
    logprobs: list[dict[str, Any]] | None = None  # entries not yet carried by a DeltaEvent

    @property
    def called(self) -> bool:
        return bool(self.parsed.tool_calls)


TurnEvent = DeltaEvent | FinalEvent


def finish_reason(upstream: str | None, had_tool_calls: bool) -> str:
    """OpenAI's finish reasons from vLLM's: a turn that called tools ends with `tool_calls`."""
    if upstream == "length":
        return "length"
    return "tool_calls" if had_tool_calls else "stop"


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
