"""A turn: plan → admission → vLLM /v1/completions with the token-id prompt → typed events → a new
transcript snapshot. Both wires are served by this one path; no FastAPI here.

`TurnService.open(request)` does everything that can fail with a 4xx before a byte is sent, including
the admission wait and opening the upstream stream (vLLM validates before it streams); the route holds
the client while it waits (proxy/scheduler/hold.py). The returned `Turn` then yields `DeltaEvent`s and
one `FinalEvent` (`events()`), or collects them (`collect()`), exactly once; a wire writer encodes them.
Only a turn that ends normally writes a snapshot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from array import array
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import msgspec

from proxy.admission import Admission, Footprint, NoAdmission, Ticket
from proxy.constraints import JsonToolCallParser
from proxy.errors import ProxyError, UpstreamError, UpstreamUnreachable
from proxy.format.base import ChatFormat, Delta, DeltaKind, OutputParser, ParsedOutput
from proxy.ingress import TurnRequest
from proxy.logprobs import LogprobsBuilder
from proxy.metrics import Metrics
from proxy.observe import Observer
from proxy.plan import Plan, Planner
from proxy.reply import DeltaEvent, FinalEvent, TurnEvent, Usage, assistant_message, finish_reason, tool_call_id
from proxy.routing import Placement, Router
from proxy.store import SessionStore
from proxy.transcripts import Snapshot, message_key
from proxy.upstream import Event, EventStream, Upstream

log = logging.getLogger("proxy.turn")


class TurnService:
    observer: Observer | None = None  # the operator view (proxy/observe.py), set by the app

    def __init__(self, *, fmt: ChatFormat, upstream: Upstream, store: SessionStore, metrics: Metrics,
                 admission: Admission | None = None, warmup: bool = False, router: Router | None = None) -> None:
        self.fmt = fmt
        self.upstream = upstream
        self.store = store
        self.metrics = metrics
        self.admission: Admission = admission or NoAdmission()
        self.warmup = warmup
        self.router = router  # several engines: which one serves a turn (its upstream, its admission)
        self.planner = Planner(fmt, upstream, store, metrics)
        self._background: set[asyncio.Task[None]] = set()

    async def plan(self, req: TurnRequest) -> Plan:
        started = time.perf_counter()
        plan = await self.planner.plan(req)
        self.metrics.render_seconds.observe(time.perf_counter() - started)
        return plan

    async def prepare(self, req: TurnRequest) -> tuple[Plan, Placement | None]:
        """Plan the turn and place it on an engine (once per turn; the route names the engine in its
        response headers before the turn may wait for admission)."""
        plan = await self.plan(req)
        placement = (await self.router.place(req, plan.prompt, plan.max_tokens)
                     if self.router is not None else None)
        return plan, placement

    def admit_now(self, req: TurnRequest, prepared: tuple[Plan, Placement | None]) -> Ticket | None:
        """The turn's seat at once if its engine has room and nobody waits (the common case: `open` it
        with this ticket, inline); None: `open` waits for one."""
        plan, placement = prepared
        admission = placement.engine.admission if placement is not None else self.admission
        return admission.try_acquire(_footprint(req, plan))

    async def open(self, req: TurnRequest, prepared: tuple[Plan, Placement | None] | None = None, *,
                   ticket: Ticket | None = None, replaced: bool = False,
                   on_head: Callable[[], None] | None = None) -> Turn:
        """Admission (unless `ticket` is the seat `admit_now` gave), then the engine's stream. `on_head`:
        called the moment the engine placed first answers 200 (never for a turn placed again)."""
        plan, placement = prepared or await self.prepare(req)
        upstream = placement.engine.upstream if placement is not None else self.upstream
        admission = placement.engine.admission if placement is not None else self.admission
        if placement is not None:
            placement.placed()
        if ticket is None:
            ticket = await admission.acquire(_footprint(req, plan))
        try:
            stream = await upstream.open_events("/v1/completions", await self._payload(plan, upstream),
                                                on_head=on_head)
        except BaseException as exc:
            ticket.release()
            self.engine_failed(placement, exc)
            if not isinstance(exc, UpstreamUnreachable) or self.router is None or placement is None or replaced:
                raise
            # Nothing reached that engine (another replica saw it die first): place the turn once more;
            # the router checks the failed engine now and moves the session if it is down.
            again = await self.router.place(req, plan.prompt, plan.max_tokens)
            if again.engine is placement.engine:
                raise
            return await self.open(req, (plan, again), replaced=True)
        return Turn(self, plan, stream, ticket, placement)

    def engine_failed(self, placement: Placement | None, exc: BaseException) -> None:
        if self.router is not None and placement is not None and isinstance(exc, UpstreamError):
            self.router.failed(placement.engine)

    async def _payload(self, plan: Plan, upstream: Upstream) -> bytes:
        info = await upstream.model()
        body: dict[str, Any] = {
            **plan.request.chat.sampling,
            "model": info.upstream_id,
            "max_tokens": plan.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        # The format's end-of-turn ids stop the turn, except for a client that asked for `ignore_eos`
        # (run to max_tokens, as benchmarks and load tests do): vLLM honours stop ids even then.
        if not plan.request.chat.sampling.get("ignore_eos"):
            body["stop_token_ids"] = sorted(self.fmt.stop_token_ids)
        if plan.forced_outputs is not None:
            given = body.get("structured_outputs")
            body["structured_outputs"] = {**(given if isinstance(given, dict) else {}), **plan.forced_outputs}
        # msgspec, not json.dumps: 0.6 against 6.8 us for this body (json.dumps builds an encoder per
        # call with non-default separators), on every turn's way to the engine.
        head = msgspec.json.encode(body)
        # The prompt is spliced in as text kept from the previous turn, so a 100K-token session
        # does not re-serialize 100K ids per request.
        return head[:-1] + b',"prompt":[' + plan.prompt_text.encode() + b"]}"

    def parser(self, plan: Plan) -> OutputParser:
        chat, thinking = plan.request.chat, plan.request.thinking
        if chat.tool_choice.mode == "none":
            return self.fmt.parser(enable_thinking=thinking, tools=chat.tools, tool_call_id=tool_call_id,
                                   tool_calls=False)
        parser = self.fmt.parser(enable_thinking=thinking, tools=chat.tools, tool_call_id=tool_call_id)
        if plan.json_tools:
            return JsonToolCallParser(parser, chat.tool_choice, tool_call_id)
        return parser

    async def remember(self, plan: Plan, generated: list[int], finish: str, reply: dict[str, Any],
                       placement: Placement | None = None) -> None:
        ids = array("I", plan.prompt)
        ids.extend(generated)
        snap = Snapshot(ids=ids, prompt_len=len(plan.prompt), msg_keys=plan.msg_keys, msg_ends=plan.msg_ends,
                        reply_key=message_key(reply), context=plan.context, finish_reason=finish,
                        parent_id=plan.parent.snapshot_id if plan.parent else None)
        self.planner.ids_text.put(snap.snapshot_id, plan.prompt_text, generated, snap.parent_id)
        await self.store.save(plan.request.session.key, snap)
        if self.router is not None and placement is not None:
            await self.router.sent(plan.request.session.key, placement, ids)
        warmup = self.warmup if plan.request.warmup is None else plan.request.warmup
        if warmup:
            self._spawn(self._warm(snap, placement.engine.upstream if placement is not None else self.upstream))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _warm(self, snap: Snapshot, upstream: Upstream) -> None:
        """Prefill prompt+output while the harness runs its tools, so the next turn's prefix (and, on
        hybrid models, a recurrent-state checkpoint near its end) is cached before it arrives."""
        info = await upstream.model()
        text = self.planner.ids_text.get(snap.snapshot_id) or self.planner.ids_text.encode(snap.ids)
        body = json.dumps({"model": info.upstream_id, "max_tokens": 1, "temperature": 0}, separators=(",", ":"))
        try:
            await upstream.post_raw("/v1/completions", (body[:-1] + ',"prompt":[' + text + "]}").encode())
            self.metrics.warmups.labels("ok").inc()
        except ProxyError as exc:
            self.metrics.warmups.labels("failed").inc()
            log.warning("warm-up failed: %s", exc.message)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def _footprint(req: TurnRequest, plan: Plan) -> Footprint:
    return Footprint(session=req.session.key, prompt_tokens=len(plan.prompt), max_tokens=plan.max_tokens,
                     reused_tokens=len(plan.parent.ids) if plan.parent else 0, priority=req.priority,
                     prompt=plan.prompt)


class ArgumentsGate:
    """Checks streamed tool-call argument fragments against the parser's final arguments.

    Fragments stream through as they come; at the end, a call that got no fragment gets its final
    arguments (`tail`), and a call whose concatenated fragments differ from the final (non-streaming)
    arguments is reported in `mismatches` (logged and counted). Why: a client that concatenates
    fragments must end with exactly the non-streaming arguments; an early parser once leaked XML
    markup into fragments, and that must not go unnoticed again.
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


class Turn:
    """One response in flight. Iterate `events()` (or await `collect()`) once; `close()` is idempotent and
    runs when the events end, fail or are abandoned (the upstream stream is dropped, the seat freed)."""

    def __init__(self, service: TurnService, plan: Plan, stream: EventStream, ticket: Ticket,
                 placement: Placement | None = None) -> None:
        self.service = service
        self.placement = placement  # the engine serving it (None: the single upstream)
        self.plan = plan
        self.request = plan.request
        self.stream = stream
        self.ticket = ticket
        self.generated: list[int] = []
        self.upstream_finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.closed = False
        top = plan.request.chat.logprobs
        self.logprobs = None if top is None else LogprobsBuilder(service.fmt.tokenizer, top)

    @property
    def prompt(self) -> array[int]:
        return self.plan.prompt

    async def events(self) -> AsyncIterator[TurnEvent]:
        svc, route = self.service, self.request.route
        parser = svc.parser(self.plan)
        gate = ArgumentsGate()
        lp = self.logprobs
        try:
            # One loop from the upstream read to the wire's chunk: no generator layer in between
            # (each costs a hop per read), and the per-event work is only what the transcript needs.
            read, first = self.stream.read_batch, True
            batch = await read()
            if batch is not None:
                self.ticket.prefilled()  # the ticket learns once that this prompt is computed
            while batch is not None:
                new = self._take(batch)
                if new:
                    self.generated.extend(new)
                    self.ticket.progress(len(self.generated))
                    deltas = parser.feed(new)
                    if deltas:
                        if first:
                            m = svc.metrics
                            m.child(m.ttfb, route).observe(time.perf_counter() - self.request.received)
                            first = False
                        yield DeltaEvent(gate.filter(deltas), (lp.take() or None) if lp is not None else None)
                batch = await read()
            rest = parser.finish()
            if rest:
                yield DeltaEvent(gate.filter(rest), (lp.take() or None) if lp is not None else None)
            yield await self._finish(parser, gate)
            svc.metrics.child(svc.metrics.requests, route, "200").inc()
        except ProxyError as exc:
            log.warning("%s turn failed: %s", route, exc.message)
            svc.engine_failed(self.placement, exc)
            svc.metrics.requests.labels(route, str(exc.status)).inc()
            raise
        finally:
            self.close()

    async def collect(self) -> FinalEvent:
        final: FinalEvent | None = None
        async for event in self.events():
            if isinstance(event, FinalEvent):
                final = event
        if final is None:
            raise UpstreamError("the turn ended without a result")
        return final

    def logprobs_body(self) -> dict[str, Any] | None:
        return self.logprobs.body() if self.logprobs is not None else None

    def _take(self, batch: list[Event]) -> list[int]:
        """The generated ids of one read's events; records finish reason, usage and logprobs."""
        lp = self.logprobs
        if len(batch) == 1 and lp is None:  # the common case: one event, one choice
            event = batch[0]
            choices = event.choices
            if choices and len(choices) == 1 and event.error is None:
                choice = choices[0]
                if event.usage:
                    self.usage = event.usage
                if choice.finish_reason:
                    self.upstream_finish = choice.finish_reason
                return choice.token_ids or []
        new: list[int] = []
        for event in batch:
            if event.error is not None and not event.choices:
                raise UpstreamError(f"engine error mid-stream: {event.error}")
            if event.usage:
                self.usage = event.usage
            for choice in event.choices or ():
                new.extend(choice.token_ids or ())
                if lp is not None:
                    lp.add(choice.logprobs, choice.token_ids or [])
                if choice.finish_reason:
                    self.upstream_finish = choice.finish_reason
        return new

    def _usage(self) -> Usage:
        u = self.usage or {}
        cached = int(((u.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        usage = Usage(int(u.get("prompt_tokens") or len(self.plan.prompt)), len(self.generated), cached)
        m = self.service.metrics
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.completion_tokens.inc(usage.completion_tokens)
        m.cached_tokens.inc(usage.cached_tokens)
        return usage

    async def _finish(self, parser: OutputParser, gate: ArgumentsGate) -> FinalEvent:
        if self.upstream_finish not in ("stop", "length"):
            raise UpstreamError(f"generation ended with finish_reason={self.upstream_finish!r}")
        parsed = parser.result()
        reply = assistant_message(parsed)
        # A named tool_choice ends with "stop" (OpenAI's and vLLM's rule), required/auto with "tool_calls".
        called = bool(reply.get("tool_calls")) and self.request.chat.tool_choice.mode != "named"
        finish = finish_reason(self.upstream_finish, called)
        await self.service.remember(self.plan, self.generated, finish, reply, self.placement)
        tail = gate.flush(parsed)
        for index, sent, final in gate.mismatches:
            self.service.metrics.argument_mismatches.inc()
            log.error("tool call %d: streamed arguments %r differ from parsed %r", index, sent, final)
        rest = (self.logprobs.take() or None) if self.logprobs is not None else None
        event = FinalEvent(finish=finish, reply=reply, parsed=parsed, tail=tail, generated=self.generated,
                           usage=self._usage(), logprobs=rest)
        if self.service.observer is not None:
            engine = self.placement.engine.name if self.placement is not None else None
            self.service.observer.turn_ended(self.plan, event, engine)
        return event

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stream.close()
        self.ticket.release()
        m = self.service.metrics
        m.child(m.latency, self.request.route).observe(time.perf_counter() - self.request.received)
