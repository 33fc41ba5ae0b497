"""Recorded harness requests -> (a) a compact shape log (what each request looked like on the wire) and
(b) a trace in the replay tool's format (backend/tools/replay.py: start / turn / side events), so a real
session's prompts (system prompt, tools, user turns) can be replayed with `hyperharness replay`.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.wire.anthropic import to_chat_request
from proxy.quirks import is_summary_request
from tests.harness.rig import Exchange

# Body fields whose values are worth showing as they are (small, and what quirks key on).
SHOWN_FIELDS = ("model", "stream", "max_tokens", "max_completion_tokens", "reasoning_effort", "thinking", "think",
                "output_config", "chat_template_kwargs", "store", "stream_options", "tool_choice",
                "prompt_cache_key", "prompt_cache_retention", "temperature", "top_p")
SESSION_HEADERS = ("x-session-id", "session_id", "x-session-affinity", "x-deepseek-harness-session-id")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _content_kind(content: Any) -> str:
    if isinstance(content, list):
        return "parts[" + ",".join(sorted({str(p.get("type")) for p in content if isinstance(p, dict)})) + "]"
    return type(content).__name__


def shape(ex: Exchange) -> dict[str, Any]:
    body = ex.body if isinstance(ex.body, dict) else {}
    out: dict[str, Any] = {"method": ex.method, "path": ex.path, "status": ex.status, "headers": ex.headers}
    if not body:
        return out
    out["fields"] = sorted(body)
    out["shown"] = {k: body[k] for k in SHOWN_FIELDS if k in body}
    for big in ("dsh_session_log", "dsh_plugin_packages"):
        if big in body:
            out.setdefault("sizes", {})[big] = len(json.dumps(body[big]))
    messages = body.get("messages") or []
    out["messages"] = [f"{m.get('role')}:{_content_kind(m.get('content'))}"
                       + ("+reasoning_content" if m.get("reasoning_content") else "")
                       + ("+reasoning" if m.get("reasoning") else "")
                       + (f"+tool_calls{len(m['tool_calls'])}" if m.get("tool_calls") else "")
                       for m in messages if isinstance(m, dict)]
    if "system" in body:
        out["system_chars"] = len(_text(body["system"]))
    tools = body.get("tools") or []
    out["tools"] = [t.get("name") or (t.get("function") or {}).get("name") or t.get("type") for t in tools
                    if isinstance(t, dict)]
    out["usage"] = ex.usage
    out["engine_prefix_cache"] = {"queried": ex.engine_queries, "hits": ex.engine_hits}
    return out


def shapes(exchanges: list[Exchange], turn2_from: int) -> list[dict[str, Any]]:
    """Shapes of what the harness sent (the test's own /metrics reads left out)."""
    return [{"turn": 1 if i < turn2_from else 2, **shape(ex)} for i, ex in enumerate(exchanges)
            if ex.path != "/metrics"]


def as_chat(ex: Exchange) -> dict[str, Any]:
    body = ex.body if isinstance(ex.body, dict) else {}
    return to_chat_request(dict(body)) if ex.path == "/v1/messages" else body


def _client_kind(requests: list[dict[str, Any]]) -> str:
    """How the harness echoes its previous replies: with `reasoning_content`, renamed, or stripped."""
    for req in requests:
        for m in req.get("messages") or ():
            if m.get("role") == "assistant":
                if m.get("reasoning_content"):
                    return "faithful"
                if m.get("reasoning"):
                    return "renamed"
    return "stripped"


def to_replay_trace(session: str, exchanges: list[Exchange]) -> str:
    """JSONL for backend/tools/replay.py. The first main request opens the session; each later main request is
    a turn (its new tool results and user message); summaries and titles are side requests."""
    calls = [(ex, as_chat(ex)) for ex in exchanges if ex.method == "POST" and ex.path in
             ("/v1/chat/completions", "/v1/messages") and isinstance(ex.body, dict)]
    main = [(ex, req) for ex, req in calls if not is_summary_request(req)]
    if not main:
        return ""
    events: list[dict[str, Any]] = []
    first_ex, first = main[0]
    msgs = first["messages"]
    system = next((m for m in msgs if m.get("role") in ("system", "developer")), {"role": "system", "content": ""})
    # DSH sends the task and a "runtime context" snapshot as two user messages: keep both, as one.
    users = [m for m in msgs if m.get("role") == "user"]
    events.append({"session": session, "start": {
        "system": _text(system.get("content")), "system_role": system.get("role", "system"),
        "tools": first.get("tools") or [], "user": "\n\n".join(_text(u.get("content")) for u in users),
        "thinking": bool((first.get("chat_template_kwargs") or {}).get("enable_thinking", True)),
        "client": _client_kind([req for _, req in main]),
        "headers": {k: v for k, v in first_ex.headers.items() if k in SESSION_HEADERS or k == "x-harness"},
        "max_tokens": first.get("max_tokens") or first.get("max_completion_tokens") or 48,
    }})
    seen = len(msgs)
    for _, req in calls[calls.index((first_ex, first)) + 1:]:
        messages = req.get("messages") or []
        if is_summary_request(req):
            events.append({"session": session, "side": {"user": _text(messages[-1].get("content")) if messages else "",
                                                       "max_tokens": req.get("max_tokens") or 48}})
            continue
        new = messages[seen + 1:] if len(messages) > seen else messages[-1:]  # skip the echoed reply
        seen = len(messages)
        turn: dict[str, Any] = {"max_tokens": req.get("max_tokens") or req.get("max_completion_tokens") or 48}
        results = [_text(m.get("content")) for m in new if m.get("role") == "tool"]
        if results:
            turn["tool_results"] = results
        user = [m for m in new if m.get("role") == "user"]
        if user:
            turn["user"] = _text(user[-1].get("content"))
        events.append({"session": session, "turn": turn})
    return "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in events)
