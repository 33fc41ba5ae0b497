"""`hyperharness bench fanout`: a subagent fan-out on a deliberately small KV pool, (a) directly at vLLM
and (b) through the proxy's admission scheduler, in one run against one engine.

Load, per mode: eight long-context subagent requests at once (a shared system prompt, a
distinct task, `ignore_eos` so each generates exactly `--sub-tokens`), plus a main agent that keeps
sending short requests one after another, `--main-gap` seconds apart, until the subagents are done.
The pool (configs/cpu-fanout.yaml: 40 blocks x 32 tokens) holds about four subagents' worst case, so
vLLM alone admits all eight prompts, runs out of blocks while decoding, and preempts.

Printed per mode: upstream preemptions (delta of `vllm:num_preemptions_total`), makespan of the burst,
p50/p95 subagent latency, main-agent time to first token during the burst vs idle (median and p95
over the requests of each phase). Each mode gets its own nonce at the start of every prompt, so the
two modes never share cached blocks. Goals (issue 4): 0 preemptions through the proxy, makespan no
worse than direct, burst TTFT at most 2x idle.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend import geometry
from backend.launcher import ManagedProcess, engine_argv, engine_env, free_port, wait_healthy
from backend.models import prepare_model
from backend.profiles import load_profile
from backend.runtime import proxy_argv, proxy_settings

_PREEMPT = re.compile(r"^vllm:num_preemptions_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split(" ")


def _text(seed: int, words: int) -> str:
    # Deterministic filler: word salad with numbers, roughly 1.3 tokens per word for SmolLM2.
    out, x = [], seed * 2654435761 % 2**32
    for i in range(words):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(_WORDS[x % len(_WORDS)] if i % 7 else str(x % 1000))
    return " ".join(out)


@dataclass
class Result:
    kind: str  # sub | main-idle | main-burst
    started: float
    ttft: float | None = None
    latency: float = 0.0
    tokens: int = 0
    status: int = 0
    error: str = ""


@dataclass
class ModeReport:
    mode: str
    preemptions: int = 0
    makespan: float = 0.0
    results: list[Result] = field(default_factory=list)
    peak_waiting: int = 0
    peak_kv_usage: float = 0.0

    def lat(self, kind: str) -> list[float]:
        return [r.latency for r in self.results if r.kind == kind and not r.error]

    def ttft(self, kind: str) -> list[float]:
        return [r.ttft for r in self.results if r.kind == kind and r.ttft is not None and not r.error]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def _stream(client: Any, url: str, body: dict[str, Any], headers: dict[str, str], kind: str) -> Result:
    """One streamed chat completion; TTFT = first content/reasoning delta (keep-alive comments don't count)."""
    res = Result(kind, time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:200]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event and not event.get("choices"):
                    res.error = str(event["error"])[:200]
                    break
                for ch in event.get("choices") or ():
                    d = ch.get("delta") or {}
                    if d.get("content") or d.get("reasoning_content") or d.get("reasoning"):
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - res.started
                        res.tokens += 1
    except Exception as exc:  # a broken run is reported, not raised: the other mode still runs
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency = time.perf_counter() - res.started
    return res


async def _engine_metrics(client: Any, engine: str) -> str:
    return str((await client.get(engine + "/metrics")).text)


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)", text, re.M)
    return float(m.group(1)) if m else 0.0


@dataclass(frozen=True)
class Load:
    model: str
    subagents: int = 8
    sub_words: int = 32  # distinct task text per subagent: ~155-token prompts, 5 blocks
    system_words: int = 20  # shared by every subagent of one mode
    sub_tokens: int = 128
    main_words: int = 25
    main_tokens: int = 16
    main_gap: float = 1.0
    idle_mains: int = 5


def _sub_body(load: Load, nonce: str, i: int) -> dict[str, Any]:
    system = f"[{nonce}] You are a subagent of a coding agent. Context follows. " + _text(1, load.system_words)
    return {
        "model": load.model, "stream": True, "max_tokens": load.sub_tokens, "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": f"Task {i}: " + _text(100 + i, load.sub_words)}],
    }


def _main_body(load: Load, nonce: str, i: int) -> dict[str, Any]:
    return {
        "model": load.model, "stream": True, "max_tokens": load.main_tokens, "temperature": 0,
        "messages": [{"role": "system", "content": f"[{nonce}] You are the main agent."},
                     {"role": "user", "content": f"Turn {i}: " + _text(1000 + i, load.main_words)}],
    }


async def run_mode(mode: str, url: str, engine: str, load: Load) -> ModeReport:
    import httpx

    rep = ModeReport(mode)
    nonce = f"{mode}-{secrets.token_hex(4)}"
    # keepalive_expiry below vLLM's 5 s keep-alive: the engine never closes a connection we are reusing
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=3.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as c:
        # Idle main-agent TTFT first (each a fresh prompt: no cache hit from a previous request).
        for i in range(load.idle_mains):
            rep.results.append(await _stream(c, url, _main_body(load, nonce + "-idle", i),
                                             {"x-session-id": f"{nonce}-main"}, "main-idle"))
        before = _gauge(await _engine_metrics(c, engine), "vllm:num_preemptions_total")
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                text = await _engine_metrics(c, engine)
                rep.peak_waiting = max(rep.peak_waiting, int(_gauge(text, "vllm:num_requests_waiting")))
                rep.peak_kv_usage = max(rep.peak_kv_usage, _gauge(text, "vllm:kv_cache_usage_perc"))
                await asyncio.sleep(0.25)

        async def mains() -> None:
            i = 0
            while not done.is_set():
                await asyncio.sleep(load.main_gap)
                if done.is_set():
                    break
                r = await _stream(c, url, _main_body(load, nonce, i), {"x-session-id": f"{nonce}-main"},
                                  "main-burst")
                if not done.is_set():  # only requests that ran inside the burst count
                    rep.results.append(r)
                i += 1

        start = time.perf_counter()
        watcher, trickle = asyncio.ensure_future(watch()), asyncio.ensure_future(mains())
        subs = await asyncio.gather(*(
            _stream(c, url, _sub_body(load, nonce, i),
                    {"x-session-id": f"{nonce}-sub{i}", "x-parent-session-id": f"{nonce}-main"}, "sub")
            for i in range(load.subagents)))
        rep.makespan = time.perf_counter() - start
        done.set()
        await asyncio.gather(watcher, trickle)
        rep.results.extend(subs)
        rep.preemptions = int(_gauge(await _engine_metrics(c, engine), "vllm:num_preemptions_total") - before)
    return rep


def _ratio(r: ModeReport) -> float:
    return _pct(r.ttft("main-burst"), 0.5) / _pct(r.ttft("main-idle"), 0.5)


def format_reports(reports: list[ModeReport], load: Load) -> str:
    def ms(x: float) -> str:
        return f"{x * 1000:,.0f} ms"

    def s(x: float) -> str:
        return f"{x:,.2f} s"

    rows: list[tuple[str, Callable[[ModeReport], str]]] = [
        ("upstream preemptions", lambda r: str(r.preemptions)),
        ("makespan (8 subagents)", lambda r: s(r.makespan)),
        ("subagent latency p50", lambda r: s(_pct(r.lat("sub"), 0.5))),
        ("subagent latency p95", lambda r: s(_pct(r.lat("sub"), 0.95))),
        ("main TTFT idle p50", lambda r: ms(_pct(r.ttft("main-idle"), 0.5))),
        ("main TTFT burst p50", lambda r: ms(_pct(r.ttft("main-burst"), 0.5))),
        ("main TTFT burst p95", lambda r: ms(_pct(r.ttft("main-burst"), 0.95))),
        ("burst / idle TTFT (p50)", lambda r: f"{_ratio(r):.2f}x"),
        ("main requests in burst", lambda r: str(len(r.ttft("main-burst")))),
        ("peak engine waiting queue", lambda r: str(r.peak_waiting)),
        ("peak engine KV usage", lambda r: f"{r.peak_kv_usage:.0%}"),
        ("errors", lambda r: str(sum(1 for x in r.results if x.error))),
    ]
    width = max(len(name) for name, _ in rows)
    head = f"{'':{width}}  " + "  ".join(f"{r.mode:>14}" for r in reports)
    lines = [f"fan-out: {load.subagents} subagents x (~{load.system_words + load.sub_words} words prompt, "
             f"{load.sub_tokens} tokens out), main agent {load.main_tokens} tokens every {load.main_gap:g}s", head]
    for name, fn in rows:
        lines.append(f"{name:{width}}  " + "  ".join(f"{fn(r):>14}" for r in reports))
    for r in reports:
        for x in r.results:
            if x.error:
                lines.append(f"  {r.mode} {x.kind} error (status {x.status}): {x.error}")
                break
    return "\n".join(lines)


async def _wait_health(url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as c:
        while True:
            try:
                if (await c.get(url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not healthy after {timeout:.0f}s")
            await asyncio.sleep(0.5)


async def fanout(profile_name: str, engine_url: str | None, log_dir: Path, load_kw: dict[str, Any]) -> str:
    profile = load_profile(profile_name)
    model_dir = prepare_model(profile.model.embedded) if profile.model.embedded else Path(str(profile.model.path))
    engine_proc = None
    if engine_url is None:
        port = free_port()
        engine_proc = ManagedProcess("engine", engine_argv(profile, model_dir, port), engine_env(profile),
                                     log_dir / f"fanout-engine-{port}.log")
        engine_proc.start()
        engine_url = f"http://127.0.0.1:{port}"
    pport = free_port()
    # The proxy gets the runtime config `serve` would give it for this profile (seats, state pages).
    geom = geometry.compute(profile, geometry.ModelShape.from_model_dir(model_dir))
    config = log_dir / f"fanout-proxy-{pport}.json"
    proxy_settings(profile, geom, model_path=model_dir, host="127.0.0.1", port=pport, engine_url=engine_url,
                   api_key_file=None, engine_key_file=None, log_level="warning").dump(config)
    proxy_proc = ManagedProcess("proxy", proxy_argv(config), dict(os.environ), log_dir / f"fanout-proxy-{pport}.log")
    proxy_proc.start()
    proxy_url = f"http://127.0.0.1:{pport}"
    try:
        if engine_proc is not None:
            await wait_healthy(engine_url + "/health", engine_proc, 600)
        await _wait_health(proxy_url, 120)
        load = Load(model=profile.model.served_name, **load_kw)
        # Warm the engine's kernels once (not measured).
        await run_mode("warmup", engine_url, engine_url, Load(load.model, subagents=2, sub_tokens=8, idle_mains=1,
                                                              main_gap=60))
        reports = [await run_mode("direct", engine_url, engine_url, load),
                   await run_mode("proxy", proxy_url, engine_url, load)]
        import httpx

        async with httpx.AsyncClient() as c:
            sched = [ln for ln in (await c.get(proxy_url + "/metrics")).text.splitlines()
                     if ln.startswith(("hh_scheduler_admitted_total", "hh_scheduler_pool_blocks",
                                       "hh_scheduler_wait_seconds_sum",
                                       "hh_scheduler_wait_seconds_count"))]
        return format_reports(reports, load) + "\nproxy scheduler: " + "; ".join(sched)
    finally:
        proxy_proc.stop()
        if engine_proc is not None:
            engine_proc.stop()
