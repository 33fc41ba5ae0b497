"""Where a 1-token chat turn's time to the first byte goes, stage by stage, inside the real server.

A diagnosis tool, not a benchmark (`bench_hotpath` is the benchmark of record): the fast local upstream
of `bench_hotpath`, our proxy in a child process with time stamps wrapped around the stages of a turn
(the protocol's read, ingress, plan and placement, admission, the engine request, the engine's answer,
the response's first write), N sequential turns from an aiohttp client, each beside a direct call to
the upstream (`--block N`: N turns in a row, then N direct calls, as `bench_hotpath` orders its targets
in blocks of 10; `--idle-ms T`: T ms idle before each call, as an agent's turn comes after its tools ran).
Prints the median of each stage and the added time to the first byte the client saw.
The wrappers cost ~0.3 us each; a stage's figure is its wall time on the proxy's (pinned) core.

    python -m backend.tools.hotpath_stages --model-dir ~/.cache/hyperharness/models/smollm2-135m-v1 [--turns 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from backend.tools.bench_costs import _free_port, _wait
from backend.tools.bench_hotpath import _pin, _request
from proxy.settings import Settings, UpstreamConfig

# The stamps in the order a turn passes them; a stage is the time between two neighbours.
ORDER = ("bytes in", "body parsed", "task runs", "handler", "ingress done", "planned", "placed", "admitted",
         "engine request sent", "engine head in", "first write")
WARMUP = 200


class Stamps:
    """The stamps of the turn in flight (the client sends one at a time) and the rows of finished ones."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.rows: list[list[float]] = []

    def at(self, name: str) -> None:
        self.now[name] = time.perf_counter()

    def done(self) -> None:
        if all(n in self.now for n in ORDER):
            self.rows.append([self.now[b] - self.now[a] for a, b in itertools.pairwise(ORDER)])
        self.now = {}


def _after(stamps: Stamps, obj: Any, attr: str, name: str) -> None:
    """Stamp `name` when `obj.attr` (sync or async) returns."""
    fn = getattr(obj, attr)
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped_async(*a: Any, **k: Any) -> Any:
            out = await fn(*a, **k)
            stamps.at(name)
            return out
        setattr(obj, attr, wrapped_async)
        return

    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        out = fn(*a, **k)
        stamps.at(name)
        return out
    setattr(obj, attr, wrapped)


def _before(stamps: Stamps, obj: Any, attr: str, name: str, when: Callable[..., bool] = lambda *a: True) -> None:
    """Stamp `name` when `obj.attr` starts running (for a coroutine: its first step, not its creation)."""
    fn = getattr(obj, attr)
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def started(*a: Any, **k: Any) -> Any:
            stamps.at(name)
            return await fn(*a, **k)
        setattr(obj, attr, started)
        return

    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        if when(*a):
            stamps.at(name)
        return fn(*a, **k)
    setattr(obj, attr, wrapped)


def serve(config: Path) -> None:
    """The proxy with stamps; SIGUSR2 prints the table and exits."""
    import uvicorn

    from proxy import engine_http, routes, server, turn, turn_http
    from proxy.app import create_app

    stamps = Stamps()
    _before(stamps, server.HeadWithBodyProtocol, "data_received", "bytes in",
            lambda self, data: data.startswith(b"POST "))
    _after(stamps, server.HeadWithBodyProtocol, "on_message_complete", "body parsed")
    _before(stamps, turn_http.TurnExchange, "run", "task runs")
    _before(stamps, routes.TurnEndpoints, "answer", "handler")
    _after(stamps, routes.TurnEndpoints, "ingest", "ingress done")
    _after(stamps, turn.TurnService, "plan", "planned")
    _after(stamps, turn.TurnService, "prepare", "placed")
    _after(stamps, turn.TurnService, "admit_now", "admitted")
    _before(stamps, engine_http.EngineConnection, "send", "engine request sent")
    _before(stamps, engine_http.EngineConnection, "data_received", "engine head in", lambda self, data: not self.status)
    # The answer's first bytes leave from the engine connection's callback (turn_http.py `EarlyOpen`):
    # the first write (or writelines) of the client's transport after the engine's head.
    for attr in ("write", "writelines"):
        def first_write(self: Any, data: Any, _orig: Any = getattr(server.HeadHoldingTransport, attr)) -> None:
            _orig(self, data)
            if "engine head in" in stamps.now and self._head is None:  # a held head has not left yet
                stamps.at("first write")
                stamps.done()
        setattr(server.HeadHoldingTransport, attr, first_write)

    def report(*_: Any) -> None:
        rows = stamps.rows[WARMUP:]
        for i, (a, b) in enumerate(itertools.pairwise(ORDER)):
            print(f"  {a + ' -> ' + b:42s} {statistics.median(r[i] for r in rows) * 1e6:8.1f} us", flush=True)
        total = [sum(r[:ORDER.index("engine request sent")]) + sum(r[ORDER.index("engine head in"):]) for r in rows]
        print(f"  {'ours in all (without the engine wait)':42s} {statistics.median(total) * 1e6:8.1f} us", flush=True)
        os._exit(0)

    signal.signal(signal.SIGUSR2, report)
    settings = Settings.load(config)
    uvicorn.Server(server.server_config(create_app(settings), settings)).run()


async def drive(model_dir: Path, turns: int, block: int = 1, idle_s: float = 0.0) -> None:
    py = sys.executable
    up = _free_port()
    upstream = subprocess.Popen([py, "-c", f"from backend.tools.bench_hotpath import vllm_like_main as m; m({up})"])
    _pin(upstream.pid, 1)
    _pin(os.getpid(), 1)
    await _wait(f"http://127.0.0.1:{up}/health")
    port = _free_port()
    config = Path(tempfile.mkdtemp(prefix="hh-stages-")) / "proxy.json"
    Settings(port=port, upstreams=(UpstreamConfig(url=f"http://127.0.0.1:{up}"),), model_dir=model_dir,
             model_name="m", log_level="warning").dump(config)
    proxy = subprocess.Popen([py, "-m", "backend.tools.hotpath_stages", "--serve", str(config)])
    _pin(proxy.pid, 0)
    try:
        await _wait(f"http://127.0.0.1:{port}/health")
        chat, direct = f"http://127.0.0.1:{port}/v1/chat/completions", f"http://127.0.0.1:{up}/v1/completions"
        ours: list[float] = []
        theirs: list[float] = []
        async with aiohttp.ClientSession() as s:
            for i in range(0, turns + WARMUP, block):  # `block` turns through the proxy, then as many direct
                t = []
                for k in range(block):
                    if idle_s:
                        await asyncio.sleep(idle_s)  # the turn comes after idle, as an agent's does after its tools
                    t.append(await _request(s, chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 1, "stream": True, "user": f"u{i + k}",
                                                      "chat_template_kwargs": {"enable_thinking": False}}))
                d = []
                for _ in range(block):
                    if idle_s:
                        await asyncio.sleep(idle_s)
                    d.append(await _request(s, direct, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1,
                                                        "stream": True}))
                if i >= WARMUP:
                    ours += t
                    theirs += d
        d50, o50 = statistics.median(theirs) * 1e3, statistics.median(ours) * 1e3
        print(f"client: direct TTFB p50 {d50:.3f} ms, through the proxy {o50:.3f} ms, added {o50 - d50:.3f} ms")
        print("stages in the proxy (p50, wall):", flush=True)
        os.kill(proxy.pid, signal.SIGUSR2)
        proxy.wait(30)
    finally:
        for p in (proxy, upstream):
            if p.poll() is None:
                p.terminate()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.tools.hotpath_stages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--block", type=int, default=1,
                    help="turns through the proxy in a row before as many direct calls (bench_hotpath: 10)")
    ap.add_argument("--idle-ms", type=float, default=0.0, help="idle time before each call (proxied and direct)")
    ap.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the child: the proxy with stamps
    a = ap.parse_args(argv)
    if a.serve is not None:
        serve(a.serve)
        return 0
    if a.model_dir is None:
        ap.error("--model-dir is required")
    asyncio.run(drive(a.model_dir, a.turns, max(1, a.block), a.idle_ms / 1e3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
