"""The chat path: normalize → session → transcript splice or fresh render → vLLM /v1/completions with a
token-id prompt → parsed OpenAI chat output → new transcript snapshot. No FastAPI here.

`ChatService.prepare()` does everything that can fail with a 4xx before a byte is sent, including
opening the upstream stream (vLLM validates before it streams); the returned `ChatTurn` then streams
(`sse()`) or collects (`complete()`). Only a turn that ends normally writes a snapshot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from array import array
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.admission import Admission, NoAdmission, Ticket
from proxy.chat_output import (
    DONE,
    ArgumentsGate,
    ChunkWriter,
    assistant_message,
    completion_body,
    completion_id,
    finish_reason,
    tool_call_id,
    usage_dict,
)
from proxy.constraints import JsonToolCallParser, json_tool_outputs
from proxy.errors import InvalidRequest, ProxyError, UpstreamError
from proxy.format.base import ChatFormat, FormatError, OutputParser, ParsedOutput, Rendered
from proxy.format.template import TemplateError
from proxy.idstext import IdsText
from proxy.logprobs import LogprobsBuilder
from proxy.metrics import Metrics
from proxy.normalize import NormalizedChat, cap_max_tokens, normalize, tools_key
from proxy.protocol import parse_chat_request, validate_messages
from proxy.scheduler.footprint import PromptFootprint
from proxy.sessions import SessionIdentity, identify, priority
from proxy.store import SessionStore
from proxy.transcripts import Match, MessageKeys, Snapshot, common_prefix_len, context_key, match, message_key
from proxy.upstream import EventStream, Upstream

log = logging.getLogger("proxy.chat")

# Per-request override of --warmup (the replay benchmark measures both in one run).
WARMUP_HEADER = "x-hyperharness-warmup"


@dataclass(slots=True)
class Plan:
    """A rendered request, before the upstream call."""

    session: SessionIdentity
    norm: NormalizedChat
    prompt: array[int]  # array('I')
    prompt_text: str  # the ids as JSON array body ("1,2,3"), built incrementally from the parent's
    parent: Snapshot | None  # the snapshot this prompt extends (spliced), if any
    msg_keys: list[str]
    msg_ends: list[int]
    context: str
    enable_thinking: bool
    max_tokens: int
    warmup: bool
    # structured_outputs that force the tool_choice (None: not forced), and whether they force JSON
    # (a format without its own tool-call syntax) that `JsonToolCallParser` turns into calls.
    forced_outputs: dict[str, Any] | None = None
    json_tools: bool = False


class ChatService:
    def __init__(
        self,
        *,
        fmt: ChatFormat,
        upstream: Upstream,
        store: SessionStore,
        metrics: Metrics,
        model_name: str,
        admission: Admission | None = None,
        warmup: bool = False,
        default_thinking: bool = True,
    ) -> None:
        self.fmt = fmt
        self.upstream = upstream
        self.store = store
        self.metrics = metrics
        self.model_name = model_name
        self.admission = admission or NoAdmission()
        self.warmup = warmup
        self.default_thinking = default_thinking
        self.ids_text = IdsText()
        self.message_keys = MessageKeys()
        self._background: set[asyncio.Task[None]] = set()

    async def prepare(self, body: dict[str, Any], headers: Mapping[str, str]) -> ChatTurn:
        started = time.perf_counter()
        plan = await self.plan(body, headers)
        self.metrics.render_seconds.observe(time.perf_counter() - started)
        foot = PromptFootprint(
            session=plan.session.key,
            prompt_tokens=len(plan.prompt),
            max_tokens=plan.max_tokens,
            reused_tokens=len(plan.parent.ids) if plan.parent else 0,
            priority=priority(headers),
            prompt=plan.prompt,  # the scheduler counts a prefix shared by running requests once
        )
        ticket = await self.admission.acquire(foot)
        try:
            stream = await self.upstream.open_events("/v1/completions", await self._payload(plan))
        except BaseException:
            ticket.release()
            raise
        return ChatTurn(self, plan, stream, ticket, started)

    async def plan(self, body: dict[str, Any], headers: Mapping[str, str]) -> Plan:
        req = parse_chat_request(body)
        norm = normalize(req, body, {"enable_thinking": self.default_thinking})
        kwargs = dict(norm.template_kwargs)
        enable_thinking = bool(kwargs.pop("enable_thinking", self.default_thinking))
        tkey = tools_key(norm.tools)
        ctx = context_key(tkey, norm.template_kwargs)
        session = identify(headers, body, norm.messages, tkey)
        try:
            keys = self.message_keys.keys(norm.messages)
        except (AttributeError, TypeError, ValueError):
            validate_messages(norm.messages)  # raises the proper 400 for what broke the keying
            raise
        found = match(await self.store.load(session.key), norm.messages, ctx, keys=keys)
        spliced = found.snapshot is not None and found.reason is None
        validate_messages(norm.messages, found.new_from if spliced else 0)
        try:
            if found.snapshot is not None and spliced:
                prompt, text, ends = self._splice(found, norm, enable_thinking)
                parent: Snapshot | None = found.snapshot
                self.metrics.transcript_lookups.labels("hit").inc()
                self.metrics.spliced_tokens.inc(len(found.snapshot.ids))
            else:
                rendered = self.fmt.render(norm.messages, norm.tools, enable_thinking=enable_thinking, **kwargs)
                prompt, text, ends = array("I", rendered.ids), "", _message_ends(rendered, len(norm.messages))
                parent = None
                self._account_fresh(session, found, prompt)
        except (FormatError, TemplateError) as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        info = await self.upstream.model()
        max_tokens = cap_max_tokens(norm.max_tokens, len(prompt), info.max_model_len)
        if not text:
            text = self.ids_text.encode(prompt)
        flag = headers.get(WARMUP_HEADER)
        warmup = self.warmup if flag is None else flag.strip() in ("1", "true", "yes")
        forced, json_tools = self._forced_outputs(norm)
        return Plan(
            forced_outputs=forced,
            json_tools=json_tools,
            session=session,
            norm=norm,
            prompt=prompt,
            prompt_text=text,
            parent=parent,
            msg_keys=keys,
            msg_ends=ends,
            context=ctx,
            enable_thinking=enable_thinking,
            max_tokens=max_tokens,
            warmup=warmup,
        )

    def _forced_outputs(self, norm: NormalizedChat) -> tuple[dict[str, Any] | None, bool]:
        choice = norm.tool_choice
        if not choice.forced or not norm.tools:
            return None, False
        outputs = self.fmt.forced_tool_outputs(norm.tools, choice.name, parallel=norm.parallel_tool_calls)
        if outputs is not None:
            return outputs, False
        return json_tool_outputs(norm.tools, choice, parallel=norm.parallel_tool_calls), True

    def _splice(self, found: Match, norm: NormalizedChat, enable_thinking: bool) -> tuple[array[int], str, list[int]]:
        snap = found.snapshot
        assert snap is not None  # invariant: called only on a hit
        after_stop = len(snap.ids) > 0 and snap.ids[-1] in self.fmt.stop_token_ids
        new = norm.messages[found.new_from :]
        cont = self.fmt.render_continuation(new, norm.tools, enable_thinking=enable_thinking, after_stop=after_stop)
        prompt = array("I", snap.ids)
        prompt.extend(cont)
        text = self.ids_text.extend(snap.snapshot_id, snap.ids, cont)
        # Ends of the new messages are not split out by the continuation render; they share the
        # prompt's end, which only coarsens divergence accounting for a later edit of them.
        ends = snap.msg_ends[: len(snap.msg_keys)] + [len(snap.ids)] + [len(prompt)] * len(new)
        return prompt, text, ends

    def _account_fresh(self, session: SessionIdentity, found: Match, prompt: array[int]) -> None:
        if found.snapshot is None:
            self.metrics.transcript_lookups.labels("miss").inc()
            return
        self.metrics.transcript_lookups.labels("diverged").inc()
        self.metrics.divergences.labels(found.reason or "unknown").inc()
        lost = max(0, found.shared_tokens - common_prefix_len(found.snapshot.ids, prompt))
        self.metrics.reprefilled_tokens.inc(lost)
        log.info(
            "session %s (%s) diverged: %s; %d previously-sent tokens will be prefilled again",
            session.key,
            session.source,
            found.reason,
            lost,
        )

    async def _payload(self, plan: Plan) -> bytes:
        info = await self.upstream.model()
        body: dict[str, Any] = {
            **plan.norm.sampling,
            "model": info.upstream_id,
            "max_tokens": plan.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "stop_token_ids": sorted(self.fmt.stop_token_ids),
            "skip_special_tokens": False,
        }
        if plan.forced_outputs is not None:
            given = body.get("structured_outputs")
            body["structured_outputs"] = {**(given if isinstance(given, dict) else {}), **plan.forced_outputs}
        head = json.dumps(body, separators=(",", ":"))
        # The prompt is spliced in as text kept from the previous turn, so a 100K-token session
        # does not re-serialize 100K ids per request.
        return (head[:-1] + ',"prompt":[' + plan.prompt_text + "]}").encode()

    def parser(self, plan: Plan) -> OutputParser:
        choice = plan.norm.tool_choice
        if choice.mode == "none":
            return self.fmt.parser(
                enable_thinking=plan.enable_thinking, tools=plan.norm.tools, tool_call_id=tool_call_id, tool_calls=False
            )
        parser = self.fmt.parser(enable_thinking=plan.enable_thinking, tools=plan.norm.tools, tool_call_id=tool_call_id)
        if plan.json_tools:
            return JsonToolCallParser(parser, choice, tool_call_id)
        return parser

    async def remember(self, plan: Plan, generated: list[int], finish: str, reply: dict[str, Any]) -> None:
        ids = array("I", plan.prompt)
        ids.extend(generated)
        snap = Snapshot(
            ids=ids,
            prompt_len=len(plan.prompt),
            msg_keys=plan.msg_keys,
            msg_ends=plan.msg_ends,
            reply_key=message_key(reply),
            context=plan.context,
            finish_reason=finish,
            parent_id=plan.parent.snapshot_id if plan.parent else None,
        )
        self.ids_text.put(snap.snapshot_id, plan.prompt_text, generated, snap.parent_id)
        await self.store.save(plan.session.key, snap)
        if plan.warmup:
            self._spawn(self._warm(snap))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _warm(self, snap: Snapshot) -> None:
        """Prefill prompt+output while the harness runs its tools, so the next turn's prefix (and, on
        hybrid models, a recurrent-state checkpoint near its end) is cached before it arrives."""
        info = await self.upstream.model()
        text = self.ids_text.get(snap.snapshot_id) or self.ids_text.encode(snap.ids)
        body = json.dumps({"model": info.upstream_id, "max_tokens": 1, "temperature": 0}, separators=(",", ":"))
        try:
            await self.upstream.post_raw("/v1/completions", (body[:-1] + ',"prompt":[' + text + "]}").encode())
            self.metrics.warmups.labels("ok").inc()
        except ProxyError as exc:
            self.metrics.warmups.labels("failed").inc()
            log.warning("warm-up failed: %s", exc.message)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def _message_ends(rendered: Rendered, n: int) -> list[int]:
    by_msg = {s.message: s.end for s in rendered.spans if s.message is not None}
    ends, last = [], 0
    for i in range(n):
        last = by_msg.get(i, last)
        ends.append(last)
    return ends


class ChatTurn:
    """One response in flight: stream it (`sse`) or collect it (`complete`), exactly once."""

    def __init__(self, service: ChatService, plan: Plan, stream: EventStream, ticket: Ticket, started: float) -> None:
        self.service = service
        self.plan = plan
        self.stream = stream
        self.ticket = ticket
        self.started = started
        self.id = completion_id()
        self.generated: list[int] = []
        self.upstream_finish: str | None = None
        self.usage: dict[str, Any] | None = None
        top = plan.norm.logprobs
        self.logprobs = None if top is None else LogprobsBuilder(service.fmt.tokenizer, top)

    async def _events(self, parser: OutputParser) -> AsyncIterator[list[Any]]:
        """Parser deltas per upstream read (one or more events); records generated ids, finish reason
        and usage."""
        first = True
        prefilled = getattr(self.ticket, "prefilled", None)  # the scheduler: this prompt is now computed
        lp = self.logprobs
        async for batch in self.stream.batches():
            if prefilled is not None:
                prefilled()
                prefilled = None
            new: list[int] = []
            for event in batch:
                if "error" in event and not event.get("choices"):
                    raise UpstreamError(f"engine error mid-stream: {event['error']}")
                if event.get("usage"):
                    self.usage = event["usage"]
                for choice in event.get("choices") or ():
                    new.extend(choice.get("token_ids") or ())
                    if lp is not None:
                        lp.add(choice.get("logprobs"), choice.get("token_ids") or [])
                    if choice.get("finish_reason"):
                        self.upstream_finish = choice["finish_reason"]
            if not new:
                continue
            self.generated.extend(new)
            deltas = parser.feed(new)
            if deltas:
                if first:
                    self.service.metrics.ttfb.labels("chat").observe(time.perf_counter() - self.started)
                    first = False
                yield deltas
        yield parser.finish()

    def _usage(self) -> dict[str, Any]:
        u = self.usage or {}
        cached = int(((u.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        prompt = int(u.get("prompt_tokens") or len(self.plan.prompt))
        m = self.service.metrics
        m.prompt_tokens.inc(prompt)
        m.completion_tokens.inc(len(self.generated))
        m.cached_tokens.inc(cached)
        return usage_dict(prompt, len(self.generated), cached)

    async def _finish(self, parser: OutputParser) -> tuple[ParsedOutput, dict[str, Any], str]:
        if self.upstream_finish not in ("stop", "length"):
            raise UpstreamError(f"generation ended with finish_reason={self.upstream_finish!r}")
        parsed = parser.result()
        reply = assistant_message(parsed)
        # A named tool_choice ends with "stop" (OpenAI's and vLLM's rule), required/auto with "tool_calls".
        called = bool(reply.get("tool_calls")) and self.plan.norm.tool_choice.mode != "named"
        finish = finish_reason(self.upstream_finish, called)
        await self.service.remember(self.plan, self.generated, finish, reply)
        return parsed, reply, finish

    async def sse(self) -> AsyncIterator[bytes]:
        svc = self.service
        writer = ChunkWriter(self.id, svc.model_name)
        parser = svc.parser(self.plan)
        gate = ArgumentsGate()
        try:
            ids_out = self.plan.norm.return_token_ids
            # Early: harness watchdogs count the time to the first byte.
            yield writer.role(self.plan.prompt if ids_out else None)
            lp = self.logprobs
            async for deltas in self._events(parser):
                if lp is None:
                    chunk = writer.deltas(gate.filter(deltas))
                else:  # the ids read so far ride on the next chunk that goes out
                    chunk = writer.deltas(gate.filter(deltas), (lp.take() or None) if deltas else None)
                if chunk:
                    yield chunk
            parsed, _, finish = await self._finish(parser)
            rest = gate.flush(parsed)
            if rest:
                yield writer.deltas(rest)
            for index, sent, final in gate.mismatches:
                svc.metrics.argument_mismatches.inc()
                log.error("tool call %d: streamed arguments %r differ from parsed %r", index, sent, final)
            rest_lp = (lp.take() or None) if lp is not None else None
            yield writer.finish(finish, self.generated if ids_out else None, rest_lp)
            if self.plan.norm.include_usage:
                yield writer.usage(self._usage())
            else:
                self._usage()
            yield DONE
            svc.metrics.requests.labels("chat", "200").inc()
        except ProxyError as exc:
            log.warning("chat stream failed: %s", exc.message)
            svc.metrics.requests.labels("chat", str(exc.status)).inc()
            yield writer.error(exc.message, exc.type)
            yield DONE
        finally:
            self._close()

    async def complete(self) -> dict[str, Any]:
        svc = self.service
        parser = svc.parser(self.plan)
        try:
            async for _ in self._events(parser):
                pass
            _, reply, finish = await self._finish(parser)
            svc.metrics.requests.labels("chat", "200").inc()
            lp = self.logprobs.body() if self.logprobs is not None else None
            body = completion_body(self.id, svc.model_name, reply, finish, self._usage(), lp)
            if self.plan.norm.return_token_ids:
                body["prompt_token_ids"] = self.plan.prompt.tolist()
                body["choices"][0]["token_ids"] = list(self.generated)
            return body
        finally:
            self._close()

    def _close(self) -> None:
        self.stream.close()
        self.ticket.release()
        self.service.metrics.latency.labels("chat").observe(time.perf_counter() - self.started)
