"""Ingress: either wire's request in, one frozen `TurnRequest` out, every fact about it decided here once.

The harness, the session and its parent, the priority class, the thinking switch and the normalized
chat are read from the body and headers in this module only; everything downstream (the turn, the
scheduler, the transcripts, the writers) reads them from the `TurnRequest` and never from headers.

    OpenAI chat/completions ──┐
                              ├─ quirks ─ validate ─ normalize ─ session / parent / priority ─ TurnRequest
    Anthropic messages ───────┘  (translated to the chat shape first: proxy/wire/anthropic.py)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy import quirks
from proxy.admission import Priority
from proxy.errors import NotFound
from proxy.normalize import NormalizedChat, ToolsSeen, normalize
from proxy.protocol import check_anthropic_request, parse_chat_request
from proxy.sessions import SessionIdentity, dsh_log_ids, identify, parent_of
from proxy.wire.anthropic import to_chat_request

# A per-request override of the next-turn warm-up (the replay benchmark measures both in one run).
WARMUP_HEADER = "x-hyperharness-warmup"

Wire = Literal["openai", "anthropic"]


@dataclass(frozen=True, slots=True)
class TurnRequest:
    wire: Wire
    route: str  # metrics label: chat | messages | count_tokens
    harness: str  # dsh | pi | hermes | other | unknown
    session: SessionIdentity
    parent: str | None
    priority: Priority
    thinking: bool
    chat: NormalizedChat
    tools_key: str  # canonical tool definitions (transcript context, session fingerprint)
    warmup: bool | None = None  # None: the proxy's default
    quirks: tuple[str, ...] = ()
    received: float = field(default_factory=time.perf_counter)


class Ingress:
    """Turns wire requests into `TurnRequest`s and records what it found in the `QuirkLog`."""

    def __init__(self, quirk_log: quirks.QuirkLog, *, default_thinking: bool = True, model: str | None = None) -> None:
        self.quirk_log = quirk_log
        self.default_thinking = default_thinking
        self.model = model  # the only model name accepted (Settings.limits.strict_model); None: any
        self.tools_seen = ToolsSeen()

    def openai(self, body: dict[str, Any], headers: Mapping[str, str], *, max_model_len: int,
               route: str = "chat") -> TurnRequest:
        """A `/v1/chat/completions` body (changed in place: harness payload dropped). Raises the 400s."""
        return self._ingest(body, headers, "openai", route, max_model_len, applied=[])

    def anthropic(self, body: dict[str, Any], headers: Mapping[str, str], *, max_model_len: int,
                  route: str = "messages") -> TurnRequest:
        """A `/v1/messages` body, translated to the chat shape and then read like any other."""
        check_anthropic_request(body)
        return self._ingest(to_chat_request(body), headers, "anthropic", route, max_model_len,
                            applied=["anthropic_messages"])

    def _ingest(self, body: dict[str, Any], headers: Mapping[str, str], wire: Wire, route: str,
                max_model_len: int, applied: list[str]) -> TurnRequest:
        started = time.perf_counter()
        if self.model is not None and body.get("model") not in (None, self.model):
            raise NotFound(f"The model {str(body.get('model'))[:256]!r} does not exist (this server serves"
                           f" {self.model!r})", param="model", code="model_not_found")
        hdrs = {k.lower(): v for k, v in headers.items()}
        harness = quirks.identify_harness(hdrs)
        log_ids = dsh_log_ids(body.get("dsh_session_log"))  # read before the payload is dropped
        switch = quirks.thinking_switch(body)
        if switch is not None:
            applied.append("thinking_switch")
        if quirks.drop_harness_payload(body):
            applied.append("dsh_payload")
        if quirks.whole_context_max_tokens(body, max_model_len):
            applied.append("whole_context_max_tokens")
        req = parse_chat_request(body)
        chat = normalize(req, body, self.tools_seen)
        if any(isinstance(m, dict) and m.get("role") == "developer" for m in chat.messages):
            applied.append("developer_role")  # folded into system by the renderer (proxy/format/normalize.py)
        tkey = chat.tools_key
        session = identify(hdrs, body, chat.messages, tkey, log_ids)
        summary = quirks.is_summary_request(body)
        if session.explicit and summary:
            # DSH sends its title request under the session's own prompt_cache_key, Pi its summary under
            # the session headers; they share no prefix with the session, so their transcripts go apart.
            session = session.side()
            applied.append("side_session")
        parent = parent_of(hdrs, log_ids)
        priority = quirks.priority_class(hdrs, body, parent, summary=summary)
        flag = hdrs.get(WARMUP_HEADER)
        warmup = None if flag is None else flag.strip().lower() in ("1", "true", "yes")
        turn = TurnRequest(wire=wire, route=route, harness=harness, session=session, parent=parent,
                           priority=priority, thinking=self.default_thinking if switch is None else switch,
                           chat=chat, tools_key=tkey, warmup=warmup, quirks=tuple(applied), received=started)
        self.quirk_log.add(quirks.RequestInfo(route, harness, session, parent, priority, turn.quirks))
        return turn
