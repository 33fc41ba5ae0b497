"""The operator view's data: a bounded board of recent sessions and each engine's pool, queue and cache.

Fed by one call per finished turn (`Observer.turn_ended`, from proxy/turn.py) and by each engine's
/metrics text, which the scheduler already reads every second (`EngineSource.tap` keeps a copy; an
engine without a scheduler is read here when its copy is older than `max_age_s`). `state()` is the one
JSON document the dashboard page (proxy/dashboard/) and `hyperharness top` (backend/top.py) both show,
so the two print the same numbers. No FastAPI here.

Per turn, the prompt's tokens are split three ways:
    cached       the engine served them from its prefix cache (usage.prompt_tokens_details.cached_tokens)
    reprefilled  sent earlier in this session and computed again: tokens a divergence changed, plus
                 previously-sent tokens the engine did not find in its cache (eviction; on hybrid models
                 its checkpoint granularity)
    new          the rest: what the turn really adds
Session ids never leave this module: the board shows a short hash of the store key.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from proxy.admission import Priority
from proxy.metrics import Metrics
from proxy.plan import Plan
from proxy.reply import FinalEvent
from proxy.scheduler import PoolGeometry, Scheduler
from proxy.scheduler.pool import parse_prometheus
from proxy.sessions import SIDE_SUFFIX

log = logging.getLogger("proxy.observe")
GetText = Callable[[str], Awaitable[str]]

_ENGINE_READ = ("vllm:cache_config_info", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                "vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_hits_total", "vllm:spec_decode_num_drafts_total",
                "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")
# Other engineers' series (several engines per proxy), shown when the registry has them.
_ROUTING = {"hh_placements": "placements", "hh_session_moves": "moves",
            "hh_moved_reprefill_tokens": "moved_reprefill_tokens", "hh_engine_up": "up"}
_REASONING_KEYS = ("reasoning_content", "reasoning", "reasoning_text", "thinking")


def session_label(key: str) -> str:
    """A short stable hash of a session's store key (side requests keep a visible suffix)."""
    side = key.endswith(SIDE_SUFFIX)
    base = key.removesuffix(SIDE_SUFFIX)
    return hashlib.sha256(base.encode()).hexdigest()[:8] + ("/side" if side else "")


@dataclass(slots=True)
class TurnStat:
    n: int
    at: float
    prompt: int
    cached: int
    reprefilled: int
    new: int
    completion: int
    divergence: str | None
    restored: bool

    def view(self) -> dict[str, Any]:
        return {"turn": self.n, "at": round(self.at, 3), "prompt": self.prompt, "cached": self.cached,
                "reprefilled": self.reprefilled, "new": self.new, "completion": self.completion,
                "divergence": self.divergence, "restored_reasoning": self.restored}


@dataclass(slots=True)
class SessionStat:
    label: str
    harness: str
    engine: str
    priority: str
    first_seen: float
    last_seen: float = 0.0
    turns: int = 0
    cached: int = 0
    reprefilled: int = 0
    new: int = 0
    completion: int = 0
    restored: int = 0
    divergences: dict[str, int] = field(default_factory=dict)
    history: deque[TurnStat] = field(default_factory=deque)
    last_had_reasoning: bool = False

    def view(self, now: float) -> dict[str, Any]:
        return {"label": self.label, "harness": self.harness, "engine": self.engine, "priority": self.priority,
                "turns": self.turns, "last_seen": round(self.last_seen, 3), "idle_s": round(now - self.last_seen, 1),
                "cached": self.cached, "reprefilled": self.reprefilled, "new": self.new, "completion": self.completion,
                "cache_pct": _pct(self.cached, self.cached + self.reprefilled + self.new),
                "divergences": dict(self.divergences), "restored_reasoning": self.restored,
                "history": [t.view() for t in self.history]}


def _pct(a: float, b: float) -> float | None:
    """A percentage rounded to one decimal here, once: the page and `top` print it as given."""
    return round(100 * a / b, 1) if b > 0 else None


@dataclass(slots=True)
class EngineSource:
    """One engine as the operator view sees it: its name, URL, scheduler and last /metrics text."""

    name: str
    url: str
    get_text: GetText | None = None
    scheduler: Scheduler | None = None
    text: str = ""
    read_at: float = 0.0  # monotonic, last successful read
    tried_at: float = 0.0  # monotonic, last read of our own (not the scheduler's)
    error: str | None = None

    def tap(self, get_text: GetText) -> GetText:
        """`get_text` that also keeps the engine's /metrics text (hand it to the scheduler)."""
        self.get_text = self.get_text or get_text

        async def read(path: str) -> str:
            try:
                text = await get_text(path)
            except Exception as exc:
                if path == "/metrics":
                    self.error = str(exc) or type(exc).__name__
                raise
            if path == "/metrics":
                self.text, self.read_at, self.error = text, time.monotonic(), None
            return text
        return read

    async def refresh(self, max_age_s: float) -> None:
        """Read /metrics when the last read is older than `max_age_s`; a hung engine costs a page at most
        `max_age_s` (then it shows as down), and is tried again only after another `max_age_s`."""
        now = time.monotonic()
        if self.get_text is None or now - max(self.read_at, self.tried_at) < max_age_s:
            return
        self.tried_at = now
        try:
            await asyncio.wait_for(self.tap(self.get_text)("/metrics"), max_age_s)
        except TimeoutError:
            self.error = f"no /metrics answer within {max_age_s:.0f}s"
        except Exception:  # recorded in `error`; the view shows the engine as down
            return


class Observer:
    def __init__(self, metrics: Metrics, *, keep_sessions: int = 64, keep_turns: int = 40,
                 max_age_s: float = 2.0) -> None:
        self.metrics = metrics
        self.keep_sessions = keep_sessions
        self.keep_turns = keep_turns
        self.max_age_s = max_age_s
        self.engines: dict[str, EngineSource] = {}
        self.sessions: OrderedDict[str, SessionStat] = OrderedDict()  # least recently seen first
        self.started = time.time()
        self._board: dict[str, int] = {}  # harness -> sessions on the board (`hh_active_sessions`)
        metrics.engines(self.texts)

    # -- inputs ---------------------------------------------------------------------------------

    def engine(self, name: str, url: str, *, get_text: GetText | None = None,
               scheduler: Scheduler | None = None) -> EngineSource:
        """Register (or update) an engine; returns its source, whose `tap` feeds the scheduler."""
        src = self.engines.get(name) or EngineSource(name, url)
        self.engines[name] = src
        src.url = url
        src.get_text = get_text or src.get_text
        src.scheduler = scheduler or src.scheduler
        return src

    def turn_ended(self, plan: Plan, final: FinalEvent, engine: str | None = None) -> None:
        """One finished turn: the session board and the aggregated `hh_session_*` series. Never raises:
        the turn's answer is already decided, and the view must not be able to fail it."""
        try:
            self._turn_ended(plan, final, engine)
        except Exception:
            log.exception("operator view: could not record a turn")

    def _turn_ended(self, plan: Plan, final: FinalEvent, engine: str | None) -> None:
        req, usage = plan.request, final.usage
        eng = engine or next(iter(self.engines), "engine-0")
        now = time.time()
        label = session_label(req.session.key)
        s = self.sessions.pop(label, None)
        if s is None:
            s = SessionStat(label, req.harness, eng, req.priority.label, now)
            self._on_board(req.harness, 1)
        elif s.harness != req.harness:
            self._on_board(s.harness, -1)
            self._on_board(req.harness, 1)
        self.sessions[label] = s
        while len(self.sessions) > self.keep_sessions:
            self._on_board(self.sessions.popitem(last=False)[1].harness, -1)
        prompt, cached = usage.prompt_tokens, min(usage.cached_tokens, usage.prompt_tokens)
        div = plan.divergence
        seen = len(plan.parent.ids) if plan.parent is not None else (div.kept_tokens if div else 0)
        reprefilled = min(prompt - cached, (div.lost_tokens if div else 0) + max(0, seen - cached))
        new = prompt - cached - reprefilled
        restored = plan.parent is not None and s.last_had_reasoning and not _has_reasoning(
            req.chat.messages, len(plan.parent.msg_keys))
        s.harness, s.engine, s.last_seen, s.turns = req.harness, eng, now, s.turns + 1
        s.cached, s.reprefilled, s.new = s.cached + cached, s.reprefilled + reprefilled, s.new + new
        s.completion += usage.completion_tokens
        s.restored += restored
        if div is not None:
            s.divergences[div.reason] = s.divergences.get(div.reason, 0) + 1
        s.last_had_reasoning = bool(final.parsed.reasoning)
        s.history.append(TurnStat(s.turns, now, prompt, cached, reprefilled, new, usage.completion_tokens,
                                  div.reason if div else None, restored))
        while len(s.history) > self.keep_turns:
            s.history.popleft()
        m = self.metrics
        for source, n in (("cached", cached), ("reprefilled", reprefilled), ("new", new)):
            m.child(m.session_tokens, eng, req.harness, source).inc(n)
        m.child(m.turns, eng, req.harness).inc()
        if restored:
            m.reasoning_restored.labels(req.harness).inc()

    def _on_board(self, harness: str, delta: int) -> None:
        """Sessions on the board per harness, kept as they come and go (a harness whose sessions all
        left reads 0); counting the whole board on every turn cost 0.1 ms per request."""
        n = self._board.get(harness, 0) + delta
        self._board[harness] = n
        self.metrics.child(self.metrics.active_sessions, harness).set(n)

    async def refresh(self) -> None:
        """Re-read the /metrics of engines whose copy is stale (none while their scheduler polls)."""
        for src in self.engines.values():
            await src.refresh(self.max_age_s)

    def texts(self) -> Iterator[tuple[str, str]]:
        return ((s.name, s.text) for s in self.engines.values() if s.text)

    # -- the view -------------------------------------------------------------------------------

    def state(self, model: str = "") -> dict[str, Any]:
        now = time.time()
        sessions = [s.view(now) for s in reversed(self.sessions.values())]
        totals = {k: sum(s[k] for s in sessions) for k in ("turns", "cached", "reprefilled", "new",
                                                           "completion", "restored_reasoning")}
        divergences: dict[str, int] = {}
        for s in sessions:
            for reason, n in s["divergences"].items():
                divergences[reason] = divergences.get(reason, 0) + n
        totals["sessions"] = len(sessions)
        totals["divergences"] = divergences
        totals["cache_pct"] = _pct(totals["cached"], totals["cached"] + totals["reprefilled"] + totals["new"])
        return {"model": model, "now": round(now, 3), "uptime_s": round(now - self.started, 1),
                "engines": [engine_view(src) for src in self.engines.values()],
                "routing": self._routing(), "totals": totals, "sessions": sessions}

    def _routing(self) -> dict[str, Any]:
        """Placement series other parts of the proxy register (absent with one engine)."""
        out: dict[str, Any] = {}
        for fam in self.metrics.registry.collect():
            key = _ROUTING.get(fam.name)
            if key is None:
                continue
            rows = [{**s.labels, "value": s.value} for s in fam.samples
                    if not s.name.endswith("_created")]
            out[key] = rows
        return out


def _has_reasoning(messages: list[dict[str, Any]], index: int) -> bool:
    """Whether the client sent the assistant reply at `index` back with its reasoning."""
    if index >= len(messages):
        return False
    msg = messages[index]
    if any(msg.get(k) for k in _REASONING_KEYS):
        return True
    content = msg.get("content")
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") in ("thinking", "reasoning") for p in content)


def engine_view(src: EngineSource) -> dict[str, Any]:
    """Pool geometry and occupancy, queue, engine gauges and cache/spec-decode rates of one engine."""
    samples = parse_prometheus(src.text, _ENGINE_READ) if src.text else {}

    def total(name: str) -> float:
        return sum(v for _, v in samples.get(name, ()))

    sched = src.scheduler
    geom: PoolGeometry | None = sched.geometry if sched is not None else None
    info = samples.get("vllm:cache_config_info")
    if geom is None and info:
        try:
            geom = PoolGeometry.from_cache_config(info[0][0])
        except ValueError:
            geom = None
    running = int(total("vllm:num_requests_running"))
    kv_usage = max((v for _, v in samples.get("vllm:kv_cache_usage_perc", ())), default=0.0)
    seats = sched.engine.seats if sched is not None else None
    pool: dict[str, Any] = {"seats": seats, "seats_used": running}
    if geom is not None:
        state_pages = geom.state_blocks_per_seat
        pool.update(block_size=geom.block_size, pool_blocks=geom.num_blocks, kv_tokens=geom.pool_tokens,
                    kv_tokens_used=round(kv_usage * geom.pool_tokens), kv_usage_pct=round(100 * kv_usage, 1),
                    state_pages_per_seat=state_pages, state_pages=state_pages * (seats or 0),
                    state_pages_used=state_pages * running, mamba_cache_mode=geom.mamba_cache_mode,
                    prefix_match_unit=geom.prefix_match_unit)
    queue = {p.label: 0 for p in Priority}
    admitted = {p.label: 0 for p in Priority}
    if sched is not None:
        snap = sched.snapshot()
        queue = {p.label: sched.queue.depth(p) for p in Priority}
        admitted = dict(snap["by_class"]) if isinstance(snap["by_class"], dict) else admitted
        pool.update(admitted_blocks=sched.used_blocks)
    queries, hits = total("vllm:prefix_cache_queries_total"), total("vllm:prefix_cache_hits_total")
    drafts = total("vllm:spec_decode_num_drafts_total")
    drafted = total("vllm:spec_decode_num_draft_tokens_total")
    accepted = total("vllm:spec_decode_num_accepted_tokens_total")
    return {
        "name": src.name, "url": src.url, "up": bool(src.text) and src.error is None,
        "error": src.error, "metrics_age_s": round(time.monotonic() - src.read_at, 1) if src.read_at else None,
        "pool": pool, "queue": queue, "admitted": admitted,
        "engine": {"running": running, "waiting": int(total("vllm:num_requests_waiting")),
                   "preemptions": int(total("vllm:num_preemptions_total"))},
        "prefix_cache": {"queries": int(queries), "hits": int(hits), "hit_pct": _pct(hits, queries)},
        "spec_decode": {"drafts": int(drafts), "draft_tokens": int(drafted), "accepted_tokens": int(accepted),
                        "acceptance_pct": _pct(accepted, drafted),
                        "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else None},
    }
