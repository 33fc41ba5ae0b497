"""Request quirks of the agent harnesses we serve (DeepSeek Harness, Pi, Hermes), each a named function.

Each function fixes or reads one habit seen on the wire (shared/research/harnesses.md, issue 5):

- `identify_harness`       which client sent the request (User-Agent, its own headers, our adapters' header)
- `priority_class`         interactive / subagent / background, for admission: compaction, summaries and
                           titles are background work and must not delay a user's turn
- `thinking_switch`        `chat_template_kwargs.enable_thinking`, `think`, `thinking.type`, `reasoning_effort`,
                           `output_config.effort`, `reasoning.effort` -> one switch per request
- `drop_harness_payload`   DeepSeek Harness' `dsh_session_log` / `dsh_plugin_packages` (the whole session log
                           on every request: megabytes that nothing downstream reads)
- `whole_context_max_tokens`  Hermes asks `max_tokens` = the whole context (65,536); vLLM answers 400, and
                           Hermes then loops on "cannot compress further" (hermes-agent#49686, #102494)
- `files_refused`          `/v1/files` uploads (DeepSeek Harness route B images): a clear 400, so DSH falls
                           back to inline data URLs instead of retrying a 5xx five times
- `probe_answer`           Hermes' server probes (`/api/v1/models`, `/api/tags`, `/v1/props`, `/props`,
                           `/version`): answered locally so that it identifies a vLLM server

proxy/ingress.py applies them once per request, to either wire, and records what it found in the
bounded `QuirkLog` (tests and `/metrics` read it). Session and parent ids are proxy/sessions.py's.
No FastAPI here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from proxy.admission import Priority
from proxy.errors import InvalidRequest, NotFound
from proxy.metrics import Children
from proxy.sessions import SessionIdentity

# A client may mark its own work (a batch job as background); harness signals are read otherwise.
PRIORITY_HEADER = "x-hyperharness-priority"
# Our adapters add this static header to every request of the harness they configure.
HARNESS_HEADER = "x-harness"
KNOWN_HARNESSES = frozenset({"dsh", "pi", "hermes"})
# DeepSeek Harness sends these on every request; they are its own bookkeeping, not model input.
DSH_PAYLOAD_FIELDS = ("dsh_session_log", "dsh_plugin_packages")
# DeepSeek Harness marks its compaction requests with this header.
COMPACT_HEADER = "x-deepseek-harness-compact"
# Prefixes of system prompts of summary / title side requests (seen on the wire, see each harness below).
BACKGROUND_SYSTEM_PREFIXES = (
    "You are a context summarization assistant",  # Pi compaction and branch summaries
    "Summarize the conversation",  # generic compaction prompts
)
# Fields that say the thinking switch (besides reasoning_effort, which the chat request itself has).
THINKING_FIELDS = ("think", "thinking", "output_config", "reasoning")
_OFF_EFFORTS = frozenset({"none", "minimal", "off", "disabled"})


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What ingress found out about one request (kept in `QuirkLog`)."""

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
            "hh_harness_requests", "Requests by harness, session source and priority class",
            ["harness", "session_source", "priority"], registry=registry,
        )
        self.applied = Counter(
            "hh_quirks_applied", "Request quirks handled, by name", ["quirk"], registry=registry
        )
        self._child = Children()  # every request asks for two or more

    def add(self, info: RequestInfo) -> None:
        self.recent.append(info)
        self._child(self.requests, info.harness, info.session.source, info.priority.label).inc()
        for name in info.quirks:
            self._child(self.applied, name).inc()


def identify_harness(headers: Mapping[str, str]) -> str:
    """`dsh`, `pi`, `hermes`, `other` (an unknown `x-harness`) or `unknown`. Our adapters' `x-harness`
    header wins; DeepSeek Harness also names itself in its User-Agent and its own headers. Pi (OpenAI JS
    SDK) and Hermes (OpenAI Python SDK) are only recognisable by the header the adapters add."""
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


def priority_class(headers: Mapping[str, str], body: Mapping[str, Any], parent: str | None, *,
                   summary: bool | None = None) -> Priority:
    """Background: compaction (DSH's `x-deepseek-harness-compact: 1`, Pi's summarization prompt), titles
    (DSH's small thinking-off title request) and anything the client marks so; subagent: has a parent.
    `headers` lower-cased or case-insensitive; `summary`: `is_summary_request(body)` if the caller has it."""
    explicit = Priority.parse(headers.get(PRIORITY_HEADER))
    if explicit is not None:
        return explicit
    if (headers.get(COMPACT_HEADER) or "").strip() in ("1", "true") or (
            is_summary_request(body) if summary is None else summary):
        return Priority.BACKGROUND
    return Priority.SUBAGENT if parent else Priority.INTERACTIVE


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
    messages = body.get("messages")
    if system is None and isinstance(messages, list):  # read before validation: any shape may come
        for msg in messages:
            if isinstance(msg, dict) and msg.get("role") in ("system", "developer"):
                system = msg.get("content")
                break
    if isinstance(system, list):
        return "".join(p["text"] for p in system if isinstance(p, dict) and isinstance(p.get("text"), str))
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
