"""Session identity: explicit headers and body fields first, else a fingerprint of the conversation's
start (system prompt + tools + first user message), which is stable across the turns of one agent.

Headers, in order (harnesses.md §4, proxy_anchors.md §3): our own `x-session-id` (also OpenCode), DeepSeek
Harness route B, Codex `session_id`, Hermes' affinity header, Dynamo, Claude Code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SESSION_HEADERS = (
    "x-session-id",
    "x-deepseek-harness-session-id",
    "session_id",
    "session-id",
    "x-session-affinity",
    "x-dynamo-session-id",
    "x-claude-code-session-id",
)
BODY_FIELDS = ("prompt_cache_key", "user")


@dataclass(frozen=True, slots=True)
class SessionIdentity:
    key: str  # the store key
    source: str  # which header/field, or "fingerprint"


def identify(
    headers: Mapping[str, str], body: Mapping[str, Any], messages: list[dict[str, Any]], tools_key: str
) -> SessionIdentity:
    """`headers` must be case-insensitive (Starlette's are) or lower-cased."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return SessionIdentity(key=f"h:{value.strip()}", source=name)
    for name in BODY_FIELDS:
        value = body.get(name)
        if isinstance(value, str) and value:
            return SessionIdentity(key=f"b:{value}", source=name)
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("session_id"), str):
        return SessionIdentity(key=f"b:{metadata['session_id']}", source="metadata.session_id")
    return SessionIdentity(key="f:" + fingerprint(messages, tools_key), source="fingerprint")


def fingerprint(messages: list[dict[str, Any]], tools_key: str) -> str:
    """Hash of the system messages before the first user message, the tools, and that user message."""
    h = hashlib.blake2b(digest_size=16)
    h.update(tools_key.encode())
    for msg in messages:
        h.update(b"\x00" + str(msg.get("role")).encode() + b"\x00")
        h.update(json.dumps(msg.get("content"), sort_keys=True, ensure_ascii=False).encode())
        if msg.get("role") == "user":
            break
    return h.hexdigest()


# Priority hints for admission (issue 4): an explicit header wins; a harness' compaction flag means
# background work; a parent-session header means a subagent.
PRIORITY_HEADER = "x-hyperharness-priority"
PRIORITIES = ("interactive", "subagent", "background")
BACKGROUND_HEADERS = ("x-deepseek-harness-compact",)
PARENT_HEADERS = ("x-parent-session-id", "x-dynamo-parent-session-id", "x-claude-code-parent-agent-id")


def priority(headers: Mapping[str, str]) -> str:
    explicit = (headers.get(PRIORITY_HEADER) or "").strip().lower()
    if explicit in PRIORITIES:
        return explicit
    if any((headers.get(h) or "").strip() in ("1", "true") for h in BACKGROUND_HEADERS):
        return "background"
    if any(headers.get(h) for h in PARENT_HEADERS):
        return "subagent"
    return "interactive"
