"""Session identity and the parent link, read from the wire in one place.

Explicit ids first, then a fingerprint of the conversation's start (system prompt + tools + first user
message), which is stable across the turns of one agent. Header lists (harnesses.md §4,
proxy_anchors.md §3) are kept here only; proxy/ingress.py calls these functions once per request.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Our own `x-session-id` (also OpenCode), DeepSeek Harness route B, Codex `session_id`, Hermes' affinity
# header, Dynamo, Claude Code.
SESSION_HEADERS = (
    "x-session-id",
    "x-deepseek-harness-session-id",
    "session_id",
    "session-id",
    "x-session-affinity",
    "x-dynamo-session-id",
    "x-claude-code-session-id",
)
PARENT_HEADERS = (
    "x-parent-session-id",  # ours and OpenCode's
    "x-deepseek-harness-parent-session-id",
    "x-dynamo-parent-session-id",
    "x-claude-code-parent-agent-id",
)
BODY_FIELDS = ("prompt_cache_key", "user")
SIDE_SUFFIX = "/side"


@dataclass(frozen=True, slots=True)
class SessionIdentity:
    key: str  # the store key
    source: str  # which header / field it came from, or "fingerprint"

    @property
    def explicit(self) -> bool:
        return self.source != "fingerprint"

    def side(self) -> SessionIdentity:
        """The transcript of a side request (summary, title) sent under this session's id."""
        return SessionIdentity(self.key + SIDE_SUFFIX, self.source)


@dataclass(frozen=True, slots=True)
class LogIds:
    """Session and parent ids carried in DeepSeek Harness' `dsh_session_log` body field."""

    session: str | None = None
    parent: str | None = None


def dsh_log_ids(log_field: Any) -> LogIds:
    """Ids from a `dsh_session_log` (0.2.1: `{session: {id, parentId, ...}, events}`). Its Anthropic route
    sends only the session header; the parent link lives in the log."""
    if not isinstance(log_field, dict):
        return LogIds()
    inner = log_field.get("session")
    session: dict[str, Any] = inner if isinstance(inner, dict) else log_field
    sid = session.get("id") or session.get("sessionId") or session.get("session_id")
    parent = (session.get("parentId") or session.get("parentSessionId") or session.get("parent_session_id")
              or session.get("parentSession"))  # 0.2.1rc2 names it parentSession
    if isinstance(session.get("parent"), dict):
        parent = parent or session["parent"].get("id")
    return LogIds(sid if isinstance(sid, str) and sid else None, parent if isinstance(parent, str) and parent else None)


def identify(headers: Mapping[str, str], body: Mapping[str, Any], messages: list[dict[str, Any]], tools_key: str,
             log: LogIds | None = None) -> SessionIdentity:
    """`headers` must be case-insensitive (Starlette's are) or lower-cased. Order: session headers, body
    fields, the DSH log, `metadata.session_id`, the fingerprint."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value and value.strip():
            return SessionIdentity(key=f"h:{value.strip()}", source=name)
    for name in BODY_FIELDS:
        value = body.get(name)
        if isinstance(value, str) and value:
            return SessionIdentity(key=f"b:{value}", source=name)
    if log is not None and log.session:
        # The same key as DSH's session header, so both of its routes share one transcript.
        return SessionIdentity(key=f"h:{log.session}", source="dsh_session_log")
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("session_id"), str) and metadata["session_id"]:
        return SessionIdentity(key=f"b:{metadata['session_id']}", source="metadata.session_id")
    return SessionIdentity(key="f:" + fingerprint(messages, tools_key), source="fingerprint")


def parent_of(headers: Mapping[str, str], log: LogIds | None = None) -> str | None:
    """The parent session's id: a parent header, else the DSH log's parent."""
    for name in PARENT_HEADERS:
        value = headers.get(name)
        if value and value.strip():
            return value.strip()
    return log.parent if log is not None else None


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
