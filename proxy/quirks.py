"""Request quirks of the agent harnesses we serve (DeepSeek Harness, Pi, Hermes), each a named function.

Each function fixes or reads one habit seen on the wire (shared/research/harnesses.md, issue 5):

- `identify_harness`       which client sent the request (User-Agent, its own headers, our adapters' header)
- `session_ids`            session and parent-session ids from headers and the body (the session store key
                           itself stays proxy/sessions.py's `identify`; this adds the parent and the DSH log)
- `priority_class`         interactive / subagent / background, for the scheduler (issue 4): compaction,
                           summaries and titles are background work and must not delay a user's turn
- `thinking_switch`        `reasoning_effort`, `thinking.type`, `think:false`, `output_config.effort`,
                           `reasoning.effort` -> the template's `enable_thinking` (one switch per request)
- `drop_harness_payload`   DeepSeek Harness' `dsh_session_log` / `dsh_plugin_packages` (the whole session log
                           on every request: megabytes that nothing downstream reads)
- `whole_context_max_tokens`  Hermes asks `max_tokens` = the whole context (65,536); vLLM answers 400, and
                           Hermes then loops on "cannot compress further" (hermes-agent#49686, #102494)
- `files_refused`          `/v1/files` uploads (DeepSeek Harness route B images): a clear 400, so DSH falls
                           back to inline data URLs instead of retrying a 5xx five times
- `probe_answer`           Hermes' server probes (`/api/v1/models`, `/api/tags`, `/v1/props`, `/props`,
                           `/version`): answered locally so that it identifies a vLLM server

`prepare_chat` applies them to a `/v1/chat/completions` request before the chat pipeline sees it, and
records what it found in a bounded `QuirkLog` (tests and `/metrics` read it). No FastAPI here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter

from proxy.errors import InvalidRequest, NotFound
from proxy.normalize import tools_key
from proxy.sessions import BODY_FIELDS, SESSION_HEADERS, SessionIdentity, identify

log = logging.getLogger("proxy.quirks")

Priority = Literal["interactive", "subagent", "background"]

# Read by the scheduler (issue 4) from the headers `prepare_chat` hands to the chat pipeline; a client may
# also set it itself (a batch job marking its own work as background).
PRIORITY_HEADER = "x-hyperharness-priority"
# Our adapters add this static header to every request of the harness they configure.
HARNESS_HEADER = "x-harness"
KNOWN_HARNESSES = frozenset({"dsh", "pi", "hermes"})
PARENT_HEADERS = (
    "x-parent-session-id",  # ours and OpenCode's
    "x-deepseek-harness-parent-session-id",
    "x-dynamo-parent-session-id",
    "x-claude-code-parent-agent-id",
)
# DeepSeek Harness sends these on every request; they are its own bookkeeping, not model input.
DSH_PAYLOAD_FIELDS = ("dsh_session_log", "dsh_plugin_packages")
# Prefixes of system prompts of summary / title side requests (seen on the wire, see each harness below).
BACKGROUND_SYSTEM_PREFIXES = (
    "You are a context summarization assistant",  # Pi compaction and branch summaries
    "Summarize the conversation",  # generic compaction prompts
)
BACKGROUND_USER_MARKERS = (
    "<compacted-summary>",  # DeepSeek Harness compaction output, replayed after a compaction
)
SIDE_SUFFIX = "/side"
_OFF_EFFORTS = frozenset({"none", "minimal", "off", "disabled"})


@dataclass(frozen=True, slots=True)
class SessionIds:
    session: str | None  # an explicit id from a header or body field; None: the proxy fingerprints
    parent: str | None
    source: str  # header / field it came from, or "none"


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the quirks found out about one request (kept in `QuirkLog`)."""

    route: str
    harness: str
    session: SessionIdentity
    parent: str | None
    priority: Priority
    quirks: tuple[str, ...]
    at: float = field(default_factory=time.time)


class QuirkLog:
    """Bounded record of recent requests plus Prometheus counters in the app's registry."""

    def __init__(self, registry: CollectorRegistry | None = None, keep: int = 256) -> None:
        self.recent: deque[RequestInfo] = deque(maxlen=keep)
        self.requests = Counter(
            "hyperharness_proxy_harness_requests", "Requests by harness, session source and priority class",
            ["harness", "session_source", "priority"], registry=registry,
        )
        self.applied = Counter(
            "hyperharness_proxy_quirks_applied", "Request quirks handled, by name", ["quirk"], registry=registry
        )

    def add(self, info: RequestInfo) -> None:
        self.recent.append(info)
        self.requests.labels(info.harness, info.session.source, info.priority).inc()
        for name in info.quirks:
            self.applied.labels(name).inc()


def identify_harness(headers: Mapping[str, str]) -> str:
    """`dsh`, `pi`, `hermes`, `other` (an unknown `x-harness`) or `unknown`. Our adapters' `x-harness` header wins; DeepSeek Harness also
    names itself in its User-Agent and its own headers. Pi (OpenAI JS SDK) and Hermes (OpenAI Python SDK)
    are only recognisable by the header the adapters add."""
    named = (headers.get(HARNESS_HEADER) or "").strip().lower()
    if named:
        # A metric label: only known names, so a client cannot grow the series without bound.
        return named if named in KNOWN_HARNESSES else "other"
    agent = (headers.get("user-agent") or "").lower()
    if agent.startswith("deepseek-harness") or headers.get("x-deepseek-harness-session-id"):
        return "dsh"
    if "hermes" in agent:
        return "hermes"
    if agent.startswith("pi/") or "pi-coding-agent" in agent:
        return "pi"
    return "unknown"


def session_ids(headers: Mapping[str, str], body: Mapping[str, Any]) -> SessionIds:
    """Explicit session and parent ids. DeepSeek Harness' session log carries both when its headers do
    not (its Anthropic route sends only the session header; the parent link lives in the log)."""
    session, source = None, "none"
    for name in SESSION_HEADERS:
        if headers.get(name):
            session, source = headers[name].strip(), name
            break
    else:
        for name in BODY_FIELDS:
            if isinstance(body.get(name), str) and body[name]:
                session, source = body[name], name
                break
    parent = next((headers[h].strip() for h in PARENT_HEADERS if headers.get(h)), None)
    dsh_session, dsh_parent = _dsh_log_ids(body.get("dsh_session_log"))
    if session is None and dsh_session:
        session, source = dsh_session, "dsh_session_log"
    return SessionIds(session=session, parent=parent or dsh_parent, source=source)


def _dsh_log_ids(log_field: Any) -> tuple[str | None, str | None]:
    """(session id, parent session id) from a `dsh_session_log` (0.2.1: `{session: {id, ...}, events}`)."""
    if not isinstance(log_field, dict):
        return None, None
    inner = log_field.get("session")
    session: dict[str, Any] = inner if isinstance(inner, dict) else log_field
    sid = session.get("id") or session.get("sessionId") or session.get("session_id")
    parent = session.get("parentId") or session.get("parentSessionId") or session.get("parent_session_id")
    if isinstance(session.get("parent"), dict):
        parent = parent or session["parent"].get("id")
    return (sid if isinstance(sid, str) else None), (parent if isinstance(parent, str) else None)


def priority_class(headers: Mapping[str, str], body: Mapping[str, Any], parent: str | None) -> Priority:
    """Background: compaction (DSH's `x-deepseek-harness-compact: 1`, Pi's summarization prompt), titles
    (DSH's small thinking-off title request) and anything the client marks so; subagent: has a parent."""
    explicit = (headers.get(PRIORITY_HEADER) or "").strip().lower()
    if explicit in ("interactive", "subagent", "background"):
        return explicit  # type: ignore[return-value]
    if headers.get("x-deepseek-harness-compact") == "1" or is_summary_request(body):
        return "background"
    return "subagent" if parent else "interactive"


def is_summary_request(body: Mapping[str, Any]) -> bool:
    """A compaction / summary / title side request, recognised by its system prompt."""
    text = _system_text(body)
    if any(text.startswith(p) for p in BACKGROUND_SYSTEM_PREFIXES):
        return True
    # Titles: DSH's "Create a concise title for an AI coding-assistant session ...", and the like.
    first_line = text.split("\n", 1)[0].lower()
    return "title" in first_line.split() or " title " in f" {first_line} "


def _system_text(body: Mapping[str, Any]) -> str:
    system = body.get("system")  # Anthropic shape
    if system is None:
        for msg in body.get("messages") or ():
            if isinstance(msg, dict) and msg.get("role") in ("system", "developer"):
                system = msg.get("content")
                break
    if isinstance(system, list):
        return "".join(p.get("text", "") for p in system if isinstance(p, dict))
    return system.strip() if isinstance(system, str) else ""


def thinking_switch(body: Mapping[str, Any]) -> bool | None:
    """The request's thinking switch, or None when it does not say. Explicit template kwargs win, then
    Ollama's `think`, then `thinking.type` (DSH, Anthropic), then the effort fields (`reasoning_effort`
    from Pi and Hermes, `output_config.effort` from DSH, OpenRouter's `reasoning.effort`)."""
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and isinstance(kwargs.get("enable_thinking"), bool):
        return bool(kwargs["enable_thinking"])
    if isinstance(body.get("think"), bool):
        return bool(body["think"])
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled", "adaptive"):
        return bool(thinking["type"] != "disabled")
    for effort in (body.get("reasoning_effort"), _nested(body, "output_config", "effort"),
                   _nested(body, "reasoning", "effort")):
        if isinstance(effort, str) and effort:
            return effort.lower() not in _OFF_EFFORTS
    return None


def _nested(body: Mapping[str, Any], outer: str, inner: str) -> Any:
    value = body.get(outer)
    return value.get(inner) if isinstance(value, dict) else None


def apply_thinking_switch(body: dict[str, Any]) -> bool:
    """Write the switch into `chat_template_kwargs.enable_thinking` (what the renderer reads) and drop
    the fields that said it, so no later step reads them differently. True when it changed the body."""
    switch = thinking_switch(body)
    if switch is None:
        return False
    kwargs = dict(body.get("chat_template_kwargs") or {})
    changed = kwargs.get("enable_thinking") is not switch
    kwargs["enable_thinking"] = switch
    body["chat_template_kwargs"] = kwargs
    for name in ("think", "thinking", "output_config", "reasoning"):
        if name in body and not isinstance(body[name], str):
            del body[name]
            changed = True
    return changed


def drop_harness_payload(body: dict[str, Any]) -> bool:
    """Remove DeepSeek Harness' bookkeeping fields; True when there were any."""
    found = [name for name in DSH_PAYLOAD_FIELDS if name in body]
    for name in found:
        del body[name]
    return bool(found)


def whole_context_max_tokens(body: dict[str, Any], max_model_len: int) -> bool:
    """A `max_tokens` of the whole context (or more) means "as much as fits": drop it so the pipeline
    uses the room left after the prompt. True when it did."""
    changed = False
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= max_model_len:
            del body[name]
            changed = True
    return changed


def files_refused() -> InvalidRequest:
    """The error for `/v1/files`: 400 (not retried by DSH, unlike a 5xx), saying what to do instead."""
    return InvalidRequest(
        "This server does not store files: /v1/files is not supported. Send images inline"
        " (data: URLs in image_url parts).",
        code="files_not_supported",
    )


def probe_answer(path: str, version: str) -> tuple[int, dict[str, Any]]:
    """(status, body) for the server-identification probes Hermes sends before its first request
    (hermes-agent 0.19 `agent/model_metadata.py: detect_local_server_type`). It tries, in order, LM
    Studio's `/api/v1/models` (any 200 means "LM Studio", whose model list it then parses for the
    window), Ollama's `/api/tags`, llama.cpp's `/v1/props` and `/props`, and vLLM's `/version`. We are
    vLLM on the wire, so the first four get a fast local 404 (never relayed: the engine's own 404 would
    take a round trip and vLLM has no such routes) and `/version` answers like vLLM's own; Hermes then
    reads the window from `/v1/models` (`max_model_len`, `context_length`)."""
    if path == "/version":
        return 200, {"version": version}
    kind = {"/api/v1/models": "an LM Studio", "/api/tags": "an Ollama", "/props": "a llama.cpp",
            "/v1/props": "a llama.cpp"}.get(path, "a")
    return 404, NotFound(f"no route GET {path}: this is a vLLM-compatible server, not {kind} server").body()


PROBE_PATHS = ("/version", "/props", "/v1/props", "/api/v1/models", "/api/tags")


def prepare_chat(body: dict[str, Any], headers: Mapping[str, str], *, max_model_len: int,
                 quirk_log: QuirkLog | None = None, route: str = "chat") -> tuple[dict[str, Any], dict[str, str]]:
    """Apply the request quirks to a chat request; returns the body (changed in place) and lower-cased
    headers carrying the priority class for the scheduler. Never raises for an odd body: validation
    is the pipeline's job and gives the proper 400."""
    hdrs = {k.lower(): v for k, v in headers.items()}
    harness = identify_harness(hdrs)
    ids = session_ids(hdrs, body)
    priority = priority_class(hdrs, body, ids.parent)
    applied: list[str] = []
    if drop_harness_payload(body):
        applied.append("dsh_payload")
    if apply_thinking_switch(body):
        applied.append("thinking_switch")
    if whole_context_max_tokens(body, max_model_len):
        applied.append("whole_context_max_tokens")
    if any(isinstance(m, dict) and m.get("role") == "developer" for m in body.get("messages") or ()):
        applied.append("developer_role")  # folded into system by the renderer (proxy/format/normalize.py)
    if ids.session is not None and ids.source == "dsh_session_log":
        hdrs["x-session-id"] = ids.session  # so sessions.identify keys the store by it
    if ids.session is not None and is_summary_request(body):
        # DSH sends its title request under the session's own prompt_cache_key, Pi its summary under
        # the session headers; they share no prefix with the session, so their transcripts go apart.
        hdrs["x-session-id"] = ids.session + SIDE_SUFFIX
        applied.append("side_session")
    hdrs[PRIORITY_HEADER] = priority
    if quirk_log is not None:
        raw_messages, raw_tools = body.get("messages"), body.get("tools")
        messages: list[dict[str, Any]] = raw_messages if isinstance(raw_messages, list) else []
        tools: list[dict[str, Any]] | None = raw_tools if isinstance(raw_tools, list) else None
        try:
            session = identify(hdrs, body, messages, tools_key(tools))
        except (TypeError, ValueError):
            session = SessionIdentity(key="invalid", source="invalid")
        info = RequestInfo(route, harness, session, ids.parent, priority, tuple(applied))
        quirk_log.add(info)
        log.debug("%s request from %s: session %s (%s), priority %s, quirks %s", route, harness, session.key,
                  session.source, priority, ",".join(applied) or "-")
    return body, hdrs


def quirk_log_of(extras: dict[str, Any], registry: CollectorRegistry | None) -> QuirkLog:
    """The app's one QuirkLog, created on first use in `Services.extras`."""
    existing = extras.get("quirks")
    if isinstance(existing, QuirkLog):
        return existing
    created = QuirkLog(registry)
    extras["quirks"] = created
    return created
