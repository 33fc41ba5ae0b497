"""`hyperharness bench fanout`: a subagent fan-out on a deliberately small KV pool, (a) directly at vLLM
and (b) through the proxy's admission scheduler, side by side against one engine per regime.

Two regimes (`--mode short|long|both`):
- short (configs/cpu-fanout.yaml, 40 blocks x 32 tokens): eight subagents with ~150-token prompts (a
  shared system prompt, a distinct task) and `--sub-tokens` out each; the pool holds about four worst
  cases, so vLLM alone admits all eight prompts, runs out of blocks while decoding, and preempts; a
  preemption costs little to recompute.
- long (configs/cpu-fanout-long.yaml): subagents that share a long parent context (the main agent's
  conversation, which it sent before spawning them) and carry a long task context of their own, sized
  from the engine's pool (`vllm:cache_config_info`): the parent a quarter of the pool, the prompts
  together 90% of it, the worst cases 130%; so vLLM admits every prompt and must preempt, and each
  preemption re-prefills a long context.
Both: `ignore_eos`, so each subagent generates exactly its `max_tokens`; a main agent keeps sending
short turns one after another, `--main-gap` seconds apart, until the subagents are done (in the long
regime they extend the parent context, as a main agent's next turn would).

Printed per mode: upstream preemptions (delta of `vllm:num_preemptions_total`), tokens re-prefilled
after preemption (see `recompute_bound`), makespan of the burst, p50/p95 subagent latency, main-agent
time to first token idle (before the burst) vs during it. Each mode has its own nonce at the start of
every prompt, so the two modes never share cached blocks. Then the goals (issue 30), pass/fail: 0
preemptions through the proxy in both regimes; makespan no worse than direct in the short regime and
at least 1.3x better in the long one; main-agent burst TTFT p95 at most 2x its idle p50.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

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
    recompute: int = 0  # upper bound on tokens re-prefilled after preemption (recompute_bound)

    def lat(self, kind: str) -> list[float]:
        return [r.latency for r in self.results if r.kind == kind and not r.error]

    def ttft(self, kind: str) -> list[float]:
        return [r.ttft for r in self.results if r.kind == kind and r.ttft is not None and not r.error]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def _stream(client: Any, url: str, body: dict[str, Any], headers: dict[str, str], kind: str,
                  progress: tuple[list[int], int] | None = None) -> Result:
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
                        if progress is not None:
                            progress[0][progress[1]] = res.tokens
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
    parent_words: int = 0  # long regime: the parent context every subagent (and the main agent) starts with


def _parent(load: Load, nonce: str) -> list[dict[str, str]]:
    """The main agent's conversation so far, which its subagents inherit (long regime only)."""
    return [{"role": "system", "content": f"[{nonce}] You are a coding agent. Repository notes follow."},
            {"role": "user", "content": "Context:\n" + _text(7, load.parent_words)},
            {"role": "assistant", "content": "Understood. I will split the work between subagents."}]


def _sub_body(load: Load, nonce: str, i: int) -> dict[str, Any]:
    task = {"role": "user", "content": f"Task {i}: " + _text(100 + i, load.sub_words)}
    if load.parent_words:
        messages = [*_parent(load, nonce), task]
    else:
        system = f"[{nonce}] You are a subagent of a coding agent. Context follows. " + _text(1, load.system_words)
        messages = [{"role": "system", "content": system}, task]
    return {"model": load.model, "stream": True, "max_tokens": load.sub_tokens, "temperature": 0,
            "ignore_eos": True, "messages": messages}


def _main_body(load: Load, nonce: str, i: int) -> dict[str, Any]:
    turn = {"role": "user", "content": f"Turn {i}: " + _text(1000 + i, load.main_words)}
    if load.parent_words:  # the parent's own next turn: its context, then a short question
        messages = [*_parent(load, nonce.removesuffix("-idle")), turn]
    else:
        messages = [{"role": "system", "content": f"[{nonce}] You are the main agent."}, turn]
    return {"model": load.model, "stream": True, "max_tokens": load.main_tokens, "temperature": 0,
            "messages": messages}


def recompute_bound(preempted: list[int], prompt_tokens: int, shared_tokens: int, sub_tokens: int) -> int:
    """Tokens vLLM re-prefills after its preemptions, bounded from above.

    vLLM 0.32 exports no counter of it: `vllm:prefix_cache_queries/hits`, `vllm:prompt_tokens` and
    `vllm:request_prefill_kv_computed_tokens` count a request's *first* prefill only (the scheduler sets
    `prefill_stats` only while `num_preemptions <= 0`; `PrefixCacheStats.preempted_queries/hits` are kept
    but not exported). So: a preempted request restarts from zero computed tokens and re-prefills its
    prompt plus what it had generated, less what the prefix cache still holds. The shared parent stays
    held by the other running subagents (a hit); the rest is at most the private prompt plus the tokens
    generated at the moment of preemption (`preempted[i]`: the most a victim could have generated when
    the i-th preemption was seen, the longest in-flight subagent at the poll that saw it)."""
    private = max(0, prompt_tokens - shared_tokens)
    return sum(private + min(g, sub_tokens) for g in preempted)


async def run_mode(mode: str, url: str, engine: str, load: Load, *, prompt_tokens: int = 0,
                   shared_tokens: int = 0) -> ModeReport:
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
        progress = [0] * load.subagents  # tokens streamed per subagent so far
        victims: list[int] = []

        async def watch() -> None:
            seen = before
            while not done.is_set():
                text = await _engine_metrics(c, engine)
                rep.peak_waiting = max(rep.peak_waiting, int(_gauge(text, "vllm:num_requests_waiting")))
                rep.peak_kv_usage = max(rep.peak_kv_usage, _gauge(text, "vllm:kv_cache_usage_perc"))
                now = _gauge(text, "vllm:num_preemptions_total")
                victims.extend([max(progress)] * int(now - seen))
                seen = now
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
                    {"x-session-id": f"{nonce}-sub{i}", "x-parent-session-id": f"{nonce}-main"}, "sub",
                    progress=(progress, i))
            for i in range(load.subagents)))
        rep.makespan = time.perf_counter() - start
        done.set()
        await asyncio.gather(watcher, trickle)
        rep.results.extend(subs)
        rep.preemptions = int(_gauge(await _engine_metrics(c, engine), "vllm:num_preemptions_total") - before)
        victims.extend([load.sub_tokens] * max(0, rep.preemptions - len(victims)))  # seen after the last poll
        rep.recompute = recompute_bound(victims[: rep.preemptions], prompt_tokens, shared_tokens, load.sub_tokens)
    return rep


def _ratio(r: ModeReport) -> float:
    return _pct(r.ttft("main-burst"), 0.5) / _pct(r.ttft("main-idle"), 0.5)


def _burst_ratio(r: ModeReport) -> float:
    return _pct(r.ttft("main-burst"), 0.95) / _pct(r.ttft("main-idle"), 0.5)


def format_reports(reports: list[ModeReport], load: Load, title: str = "") -> str:
    def ms(x: float) -> str:
        return f"{x * 1000:,.0f} ms"

    def s(x: float) -> str:
        return f"{x:,.2f} s"

    rows: list[tuple[str, Callable[[ModeReport], str]]] = [
        ("upstream preemptions", lambda r: str(r.preemptions)),
        ("re-prefilled after preemption", lambda r: f"<= {r.recompute:,} tok"),
        (f"makespan ({load.subagents} subagents)", lambda r: s(r.makespan)),
        ("subagent latency p50", lambda r: s(_pct(r.lat("sub"), 0.5))),
        ("subagent latency p95", lambda r: s(_pct(r.lat("sub"), 0.95))),
        ("main TTFT idle p50", lambda r: ms(_pct(r.ttft("main-idle"), 0.5))),
        ("main TTFT burst p50", lambda r: ms(_pct(r.ttft("main-burst"), 0.5))),
        ("main TTFT burst p95", lambda r: ms(_pct(r.ttft("main-burst"), 0.95))),
        ("burst p95 / idle p50 TTFT", lambda r: f"{_burst_ratio(r):.2f}x"),
        ("main requests in burst", lambda r: str(len(r.ttft("main-burst")))),
        ("peak engine waiting queue", lambda r: str(r.peak_waiting)),
        ("peak engine KV usage", lambda r: f"{r.peak_kv_usage:.0%}"),
        ("errors", lambda r: str(sum(1 for x in r.results if x.error))),
    ]
    width = max(len(name) for name, _ in rows)
    head = f"{'':{width}}  " + "  ".join(f"{r.mode:>14}" for r in reports)
    lines = [title or (f"fan-out: {load.subagents} subagents x (~{load.system_words + load.sub_words} words prompt, "
                       f"{load.sub_tokens} tokens out), main agent {load.main_tokens} tokens every {load.main_gap:g}s"),
             head]
    for name, fn in rows:
        lines.append(f"{name:{width}}  " + "  ".join(f"{fn(r):>14}" for r in reports))
    for r in reports:
        for x in r.results:
            if x.error:
                lines.append(f"  {r.mode} {x.kind} error (status {x.status}): {x.error}")
                break
    return "\n".join(lines)


@dataclass(frozen=True)
class Goal:
    name: str
    measured: str
    ok: bool


def goals(regime: str, direct: ModeReport, proxy: ModeReport) -> list[Goal]:
    """Issue 30's goals for one regime, from its direct and proxied runs."""
    idle = _pct(proxy.ttft("main-idle"), 0.5)
    burst = _pct(proxy.ttft("main-burst"), 0.95)
    speedup = direct.makespan / proxy.makespan if proxy.makespan else float("nan")
    out = [Goal(f"{regime}: 0 preemptions through the proxy", str(proxy.preemptions), proxy.preemptions == 0)]
    if regime == "short":
        out.append(Goal("short: proxy makespan <= direct", f"{proxy.makespan:.2f} s vs {direct.makespan:.2f} s",
                        proxy.makespan <= direct.makespan))
    else:
        out.append(Goal(f"{regime}: proxy makespan >= 1.3x faster than direct", f"{speedup:.2f}x", speedup >= 1.3))
    out.append(Goal(f"{regime}: main burst TTFT p95 <= 2x idle p50 (proxy)",
                    f"{burst * 1000:,.0f} ms vs 2 x {idle * 1000:,.0f} ms", burst <= 2 * idle))
    errors = sum(1 for r in (direct, proxy) for x in r.results if x.error)
    out.append(Goal(f"{regime}: no request failed", str(errors), errors == 0))
    return out


def format_goals(gs: list[Goal]) -> str:
    width = max(len(g.name) for g in gs)
    return "\n".join(f"  {'PASS' if g.ok else 'FAIL'}  {g.name:{width}}  {g.measured}" for g in gs)


def long_load(model: str, pool_tokens: int, max_model_len: int, tokens_per_word: float,
              subagents: int = 8) -> tuple[Load, int, int]:
    """The long regime sized from the pool: the parent a quarter of it, all prompts 90% of it, all worst
    cases 130% of it (so vLLM admits every prompt and must preempt while they decode). Returns the
    load, one subagent's prompt tokens and the parent's (shared) tokens, both approximate."""
    parent = pool_tokens // 4
    task = max(64, (pool_tokens * 9 // 10 - parent) // subagents)
    out = max(32, pool_tokens * 4 // 10 // subagents)
    room = max_model_len - parent - task - 64
    out = max(16, min(out, room))

    def words(tokens: int) -> int:
        return max(1, int(tokens / tokens_per_word))

    load = Load(model=model, subagents=subagents, sub_words=words(task), sub_tokens=out,
                parent_words=words(parent), main_words=20, main_tokens=16)
    return load, parent + task, parent


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


async def _tokens_per_word(engine: str, model: str) -> float:
    import httpx

    sample = _text(7, 400)
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(engine + "/tokenize", json={"model": model, "prompt": sample, "add_special_tokens": False})
        r.raise_for_status()
        return max(0.5, len(r.json()["tokens"]) / 400)


async def _pool_tokens(engine: str) -> int:
    import httpx

    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(engine + "/metrics")).text
    m = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text, re.M)
    b = re.search(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', text, re.M)
    if m is None or b is None:
        raise RuntimeError("the engine's /metrics has no vllm:cache_config_info: cannot size the long regime")
    return int(m.group(1)) * int(b.group(1))


async def regime(mode: str, profile_name: str, engine_url: str | None, log_dir: Path,
                 load_kw: dict[str, Any]) -> tuple[str, list[Goal]]:
    """One regime (short | long) against one engine of `profile_name`: direct, then through a proxy."""
    # Imported here: the load and sizing helpers above are used by tests that start no engine.
    from backend import geometry
    from backend.launcher import ManagedProcess, engine_argv, engine_env, free_port, wait_healthy
    from backend.models import prepare_model
    from backend.profiles import load_profile
    from backend.runtime import proxy_argv, proxy_settings

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
        name = profile.model.served_name
        prompt_tokens = shared_tokens = 0
        if mode == "long":
            load, prompt_tokens, shared_tokens = long_load(
                name, await _pool_tokens(engine_url), profile.engine.max_model_len,
                await _tokens_per_word(engine_url, name), subagents=load_kw.get("subagents", 8))
            load = replace(load, main_gap=load_kw.get("main_gap", load.main_gap))
            title = (f"long-context fan-out ({profile_name}): {load.subagents} subagents x (~{prompt_tokens:,} prompt "
                     f"tokens, ~{shared_tokens:,} of them a shared parent; {load.sub_tokens} out), main agent "
                     f"{load.main_tokens} tokens every {load.main_gap:g}s")
        else:
            load = Load(model=name, **load_kw)
            words = load.system_words + load.sub_words
            title = (f"short fan-out ({profile_name}): {load.subagents} subagents x (~{words}"
                     f" words prompt, {load.sub_tokens} tokens out), main agent {load.main_tokens} tokens every "
                     f"{load.main_gap:g}s")
        # Warm the engine's kernels once (not measured).
        await run_mode("warmup", engine_url, engine_url, Load(name, subagents=2, sub_tokens=8, idle_mains=1,
                                                              main_gap=60))
        kw = {"prompt_tokens": prompt_tokens, "shared_tokens": shared_tokens}
        direct = await run_mode("direct", engine_url, engine_url, load, **kw)
        proxied = await run_mode("proxy", proxy_url, engine_url, load, **kw)
        import httpx

        async with httpx.AsyncClient() as c:
            sched = [ln for ln in (await c.get(proxy_url + "/metrics")).text.splitlines()
                     if ln.startswith(("hh_scheduler_admitted_total", "hh_scheduler_pool_blocks",
                                       "hh_scheduler_reserve_blocks",
                                       "hh_scheduler_wait_seconds_sum",
                                       "hh_scheduler_wait_seconds_count"))]
        text = format_reports([direct, proxied], load, title) + "\nproxy scheduler: " + "; ".join(sched)
        return text, goals(mode, direct, proxied)
    finally:
        proxy_proc.stop()
        if engine_proc is not None:
            engine_proc.stop()


PROFILES = {"short": "cpu-fanout", "long": "cpu-fanout-long"}


async def fanout(profile_name: str | None, engine_url: str | None, log_dir: Path, load_kw: dict[str, Any],
                 mode: str = "both", long_profile: str | None = None) -> str:
    """`mode` short | long | both (each regime on an engine of its own profile, one after the other);
    `engine_url` reuses a running engine (one regime only). Prints each regime's table as it ends and
    returns the goals."""
    modes = ["short", "long"] if mode == "both" else [mode]
    if engine_url is not None and len(modes) > 1:
        raise ValueError("--engine-url serves one regime: pass --mode short or --mode long")
    texts: list[str] = []
    all_goals: list[Goal] = []
    for m in modes:
        name = (long_profile if m == "long" else profile_name) or PROFILES[m]
        text, gs = await regime(m, name, engine_url, log_dir, load_kw if m == "short" else {
            k: v for k, v in load_kw.items() if k in ("subagents", "main_gap")})
        print(text + "\n", flush=True)  # each regime as it ends: the long one takes minutes on a CPU
        texts.append(text)
        all_goals.extend(gs)
    verdict = "all goals met" if all(g.ok for g in all_goals) else "goals NOT met"
    return f"goals (issue 30): {verdict}\n" + format_goals(all_goals)
