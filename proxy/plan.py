"""Planning a turn: a `TurnRequest` in, the exact prompt ids out, spliced onto the session's transcript
where the conversation extends it, rendered fresh otherwise. No I/O but the store lookup and the
engine's model info; no FastAPI.

A splice keeps the previous turn's ids byte for byte (prompt + the ids the engine generated), so the
engine's prefix cache serves them and nothing is prefilled again; the new messages are rendered as a
continuation. A fresh render of a known session is a divergence: counted, with the tokens it will
prefill again.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from proxy.constraints import json_tool_outputs
from proxy.errors import InvalidRequest
from proxy.format.base import ChatFormat, FormatError, Rendered
from proxy.format.template import TemplateError
from proxy.idstext import IdsText
from proxy.ingress import TurnRequest
from proxy.metrics import Metrics
from proxy.normalize import CACHED_TOOLS_CHARS, NormalizedChat, cap_max_tokens
from proxy.protocol import validate_messages
from proxy.store import SessionStore
from proxy.transcripts import Match, MessageKeys, Snapshot, common_prefix_len, context_key, match
from proxy.upstream import Upstream

log = logging.getLogger("proxy.plan")
T = TypeVar("T")

# A render with more new text than this runs in a worker thread (the tokenizers release the GIL while
# they encode): tokenizing 1 MB takes ~1.3 s with SmolLM2's tokenizer, which on the event loop would
# stall every other stream for as long. Smaller ones stay on the loop, where a thread hop would cost
# more than the render.
OFF_LOOP_CHARS = 256 * 1024
# Transcript contexts kept (a few tool sets per harness, times the template switches they use).
CONTEXTS_KEPT = 32


def new_text_chars(messages: list[dict[str, Any]]) -> int:
    """About how much text rendering `messages` tokenizes (string contents, text parts, reasoning and
    tool-call arguments); a bound for choosing where to render, not a count of anything exact."""
    n = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        for key in ("reasoning_content", "reasoning"):
            if isinstance(m.get(key), str):
                n += len(m[key])
        for call in m.get("tool_calls") or ():
            args = (call.get("function") or {}).get("arguments") if isinstance(call, dict) else None
            n += len(args) if isinstance(args, str) else 0
    return n


async def _render(messages: list[dict[str, Any]], fn: partial[T]) -> T:
    """`fn()` (a render of `messages`) on a worker thread when their text is big, else here."""
    return await asyncio.to_thread(fn) if new_text_chars(messages) > OFF_LOOP_CHARS else fn()



@dataclass(slots=True)
class Plan:
    """A rendered request, before the upstream call."""

    request: TurnRequest
    prompt: array[int]  # array('I')
    prompt_text: str  # the ids as JSON array body ("1,2,3"), built incrementally from the parent's
    parent: Snapshot | None  # the snapshot this prompt extends (spliced), if any
    msg_keys: list[str]
    msg_ends: list[int]
    context: str
    max_tokens: int
    # structured_outputs that force the tool_choice (None: not forced), and whether they force JSON
    # (a format without its own tool-call syntax) that `JsonToolCallParser` turns into calls.
    forced_outputs: dict[str, Any] | None = None
    json_tools: bool = False
    divergence: Divergence | None = None  # a fresh render of a known session (the operator view shows it)


@dataclass(frozen=True, slots=True)
class Divergence:
    reason: str
    kept_tokens: int  # of the closest snapshot's ids, those this prompt still starts with
    lost_tokens: int  # previously-sent tokens this prompt changed: the engine prefills them again


class Planner:
    """Owns the per-process caches that make planning cheap: message keys and the prompt's JSON text."""

    def __init__(self, fmt: ChatFormat, upstream: Upstream, store: SessionStore, metrics: Metrics) -> None:
        self.fmt = fmt
        self.upstream = upstream
        self.store = store
        self.metrics = metrics
        self.ids_text = IdsText()
        self.message_keys = MessageKeys()
        self._contexts: OrderedDict[tuple[str, tuple[tuple[str, Any], ...]], str] = OrderedDict()

    async def plan(self, req: TurnRequest) -> Plan:
        chat = req.chat
        kwargs = dict(chat.template_kwargs)
        # The transcript's context: tools and template switches; a change of either renders afresh.
        ctx = self._context(req.tools_key, {**kwargs, "enable_thinking": req.thinking})
        try:
            keys = self.message_keys.keys(chat.messages)
        except (AttributeError, TypeError, ValueError):
            validate_messages(chat.messages)  # raises the proper 400 for what broke the keying
            raise
        found = match(await self.store.load(req.session.key), chat.messages, ctx, keys=keys)
        spliced = found.snapshot is not None and found.reason is None
        validate_messages(chat.messages, found.new_from if spliced else 0)
        divergence: Divergence | None = None
        try:
            if found.snapshot is not None and spliced:
                prompt, text, ends = await self._splice(found, chat, req.thinking)
                parent: Snapshot | None = found.snapshot
                self.metrics.child(self.metrics.transcript_lookups, "hit").inc()
                self.metrics.spliced_tokens.inc(len(found.snapshot.ids))
            else:
                rendered = await _render(chat.messages, partial(self.fmt.render, chat.messages, chat.tools,
                                                                enable_thinking=req.thinking, **kwargs))
                prompt, text, ends = array("I", rendered.ids), "", _message_ends(rendered, len(chat.messages))
                parent = None
                divergence = self._account_fresh(req, found, prompt)
        except (FormatError, TemplateError) as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        info = await self.upstream.model()
        max_tokens = cap_max_tokens(chat.max_tokens, len(prompt), info.max_model_len)
        if not text:
            text = self.ids_text.encode(prompt)
        forced, json_tools = self._forced_outputs(chat)
        return Plan(request=req, prompt=prompt, prompt_text=text, parent=parent, msg_keys=keys, msg_ends=ends,
                    context=ctx, max_tokens=max_tokens, forced_outputs=forced, json_tools=json_tools,
                    divergence=divergence)

    def _context(self, tools: str, kwargs: dict[str, Any]) -> str:
        """`context_key`, kept per (tools, template switches): it hashes the whole tools text, ~80 us a
        turn for a coding harness's 30 KB, and a session sends the same every turn."""
        if len(tools) > CACHED_TOOLS_CHARS:
            return context_key(tools, kwargs)
        key = (tools, tuple(sorted(kwargs.items())))  # template switches are booleans (protocol.py checks)
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = self._contexts[key] = context_key(tools, kwargs)
            if len(self._contexts) > CONTEXTS_KEPT:
                self._contexts.popitem(last=False)
        else:
            self._contexts.move_to_end(key)
        return ctx

    def _forced_outputs(self, chat: NormalizedChat) -> tuple[dict[str, Any] | None, bool]:
        choice = chat.tool_choice
        if not choice.forced or not chat.tools:
            return None, False
        outputs = self.fmt.forced_tool_outputs(chat.tools, choice.name, parallel=chat.parallel_tool_calls)
        if outputs is not None:
            return outputs, False
        return json_tool_outputs(chat.tools, choice, parallel=chat.parallel_tool_calls), True

    async def _splice(self, found: Match, chat: NormalizedChat, thinking: bool) -> tuple[array[int], str, list[int]]:
        snap = found.snapshot
        if snap is None:
            raise RuntimeError("splice without a snapshot")  # a caller's bug, never a client's
        after_stop = len(snap.ids) > 0 and snap.ids[-1] in self.fmt.stop_token_ids
        new = chat.messages[found.new_from :]
        cont = await _render(new, partial(
            self.fmt.render_continuation, new, chat.tools, enable_thinking=thinking, after_stop=after_stop))
        prompt = array("I", snap.ids)
        prompt.extend(cont)
        text = self.ids_text.extend(snap.snapshot_id, snap.ids, cont)
        # Ends of the new messages are not split out by the continuation render; they share the
        # prompt's end, which only coarsens divergence accounting for a later edit of them.
        ends = snap.msg_ends[: len(snap.msg_keys)] + [len(snap.ids)] + [len(prompt)] * len(new)
        return prompt, text, ends

    def _account_fresh(self, req: TurnRequest, found: Match, prompt: array[int]) -> Divergence | None:
        if found.snapshot is None:
            self.metrics.child(self.metrics.transcript_lookups, "miss").inc()
            return None
        self.metrics.transcript_lookups.labels("diverged").inc()
        self.metrics.divergences.labels(found.reason or "unknown").inc()
        kept = common_prefix_len(found.snapshot.ids, prompt)
        lost = max(0, found.shared_tokens - kept)
        self.metrics.reprefilled_tokens.inc(lost)
        log.info("session %s (%s) diverged: %s; %d previously-sent tokens will be prefilled again",
                 req.session.key, req.session.source, found.reason, lost)
        return Divergence(found.reason or "unknown", kept, lost)


def _message_ends(rendered: Rendered, n: int) -> list[int]:
    by_msg = {s.message: s.end for s in rendered.spans if s.message is not None}
    ends, last = [], 0
    for i in range(n):
        last = by_msg.get(i, last)
        ends.append(last)
    return ends
