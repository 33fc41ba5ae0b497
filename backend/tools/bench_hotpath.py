"""The proxy's hot path side by side in one run (issue 28); `bench_costs --hot-path` runs it too.

A fast local upstream in vLLM's /v1/completions stream format (one token per event, `token_ids`, the
prompt ids echoed in the first event, compact JSON), a bare aiohttp relay (~30 lines), the floor of any
proxy (a uvloop byte pipe: what one more process on the path costs at least), our pass-through and
our chat mode, each proxy pinned to one core (the upstream and this client to the other). Prints,
per target: added time to first byte p50/p95 over calling the upstream directly, proxy CPU per request,
proxy CPU per token at C = 1/8/32 with a fast and an engine-paced (5 ms/token) upstream (the median
of `--rounds` rounds, targets interleaved); agent-shaped turns (backend/tools/hotpath_agent.py: 30 KB of
tools, a 100+ KB body, each turn extending its session's transcript): time to the first token and CPU
per turn beside the bare relay passing a request of the same size; then the per-event cost of parsing
a 1-event read vs a 2,000-event read; then the issue's goals as pass/fail.

`--base DIR` adds the same proxy from another checkout (e.g. /work/main) as targets `base-*`, measured
in the same run: before/after on one noisy machine.

    python -m backend.tools.bench_hotpath --model-dir ~/.cache/hyperharness/models/smollm2-135m-v1 \\
        [--base /work/main] [--reps 200] [--tokens 2000] [--paced-tokens 400]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from backend.runtime import proxy_argv
from backend.tools.bench_costs import _cpu_seconds as _cpu_ticks
from backend.tools.bench_costs import _free_port, _wait
from proxy.settings import Settings, UpstreamConfig


def _cpu_seconds(pid: int) -> float:
    """The process's CPU time in ns resolution (the scheduler's per-thread accounting, summed), where
    /proc/PID/stat counts 10 ms ticks: too coarse for µs per token over a few thousand tokens."""
    try:
        return sum(int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
                   for t in os.listdir(f"/proc/{pid}/task")) / 1e9
    except (OSError, ValueError, IndexError):  # a thread that just ended, or no schedstat: ticks
        return _cpu_ticks(pid)


def vllm_like_main(port: int) -> None:
    """A fast stand-in for vLLM's /v1/completions stream; events are prebuilt so it costs little."""

    def event(i: int, fin: str | None, prompt: list[int] | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "text": "x", "logprobs": None, "finish_reason": fin,
                                  "stop_reason": None, "token_ids": [16 + i % 50]}
        if prompt is not None:
            choice["prompt_token_ids"] = prompt
        ev = {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion", "created": 1764712345,
              "model": "fake", "choices": [choice], "usage": None}
        return b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"

    middle = [event(i, None, None) for i in range(50)]
    usage = b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"fake","choices":[],' \
            b'"usage":{"prompt_tokens":5,"total_tokens":6,"completion_tokens":1}}\n\ndata: [DONE]\n\n'

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = max(1, int(body.get("max_tokens") or 1))
        prompt = body.get("prompt") if body.get("return_token_ids") else None
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        pace = request.app["pace_ms"] / 1000
        for i in range(n):
            if i == 0 and prompt is not None:
                out = event(0, "length" if n == 1 else None, prompt)
            else:
                out = event(i, "length", None) if i == n - 1 else middle[i % 50]
            await resp.write(out)
            if pace:
                await asyncio.sleep(pace)
        await resp.write(usage)
        return resp

    async def pace(request: web.Request) -> web.Response:
        request.app["pace_ms"] = float(request.query["ms"])
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake", "max_model_len": 1_000_000}]})

    async def empty(_: web.Request) -> web.Response:
        return web.Response(text="")

    # A pool as vLLM reports it, large enough never to queue: without geometry the proxy's admission
    # would read /metrics on every request, a cost a real engine does not cause.
    metrics_text = ('vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",'
                    'mamba_cache_mode="none",num_gpu_blocks="1000000"} 1.0\n'
                    'vllm:kv_cache_usage_perc{engine="0"} 0.0\n')

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=metrics_text)

    app = web.Application()
    app["pace_ms"] = 0.0  # milliseconds per token, set by POST /_pace?ms=
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", empty)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/_pace", pace)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def bare_relay_main(port: int, upstream: str) -> None:
    """The yardstick: forward the body, stream the answer back by network read. Nothing else."""

    async def relay(request: web.Request) -> web.StreamResponse:
        client: aiohttp.ClientSession = request.app["client"]
        body = await request.read()
        async with client.post(upstream + request.path, data=body, headers={"content-type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={"content-type": up.headers["content-type"]})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def start(app: web.Application) -> None:
        app["client"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app["client"].close()

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", relay)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def floor_relay_main(port: int, upstream_port: int) -> None:
    """The floor of one more process on the path: each client connection piped byte for byte to one
    upstream connection (uvloop, no HTTP parsing, nothing copied but what the sockets need)."""
    import uvloop

    class Up(asyncio.Protocol):
        def __init__(self, down: asyncio.Transport) -> None:
            self.down = down

        def data_received(self, data: bytes) -> None:
            self.down.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.down.close()

    class Down(asyncio.Protocol):
        up: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: asyncio.Transport = transport  # type: ignore[assignment]
            self.pending: list[bytes] = []
            asyncio.get_running_loop().create_task(self.open())

        async def open(self) -> None:
            up, _ = await asyncio.get_running_loop().create_connection(
                lambda: Up(self.transport), "127.0.0.1", upstream_port)
            self.up = up
            up.writelines(self.pending)

        def data_received(self, data: bytes) -> None:
            if self.up is None:
                self.pending.append(data)
            else:
                self.up.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.up is not None:
                self.up.close()

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Down, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(serve())


async def _request(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """Seconds to the first body byte; reads the whole answer."""
    t = time.perf_counter()
    first = 0.0
    async with s.post(url, json=body) as r:
        async for _ in r.content.iter_any():
            if not first:
                first = time.perf_counter() - t
    return first


# The cores this run may use, read once before anything is pinned: read at each call, they were the
# caller's own after it pinned itself to core 1, so "core 0" meant core 1 and every proxy shared the
# client's and the upstream's core (every bench of this file until 2026-12-05).
_CORES = sorted(os.sched_getaffinity(0))


def _pin(pid: int, core: int) -> None:
    """Every thread of `pid` (the event loop's and the workers' started before this call) to one core."""
    cpu = {_CORES[core % len(_CORES)]}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpu)


class Targets:
    """The processes under test and the URL/body of each target."""

    def __init__(self, model_dir: Path, base: Path | None) -> None:
        self.model_dir, self.base = model_dir, base
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: dict[str, str] = {}
        self.pids: dict[str, int] = {}

    def _spawn(self, argv: list[str], pythonpath: str | None = None) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: another
        # checkout's proxy must run from that checkout, or it imports this one's (it did before 2026-12-03:
        # every `base-*` column until then measured this checkout's code twice).
        proc = subprocess.Popen(argv, env=env, cwd=pythonpath)
        self.procs.append(proc)
        return proc

    async def start(self) -> None:
        py, here = sys.executable, "from backend.tools.bench_hotpath import "
        up_port = _free_port()
        self.upstream = f"http://127.0.0.1:{up_port}"
        _pin(self._spawn([py, "-c", here + f"vllm_like_main as m; m({up_port})"]).pid, 1)
        _pin(os.getpid(), 1)
        await _wait(self.upstream + "/health")
        self.urls["direct"] = self.upstream + "/v1/completions"
        port = _free_port()
        relay = self._spawn([py, "-c", here + f"bare_relay_main as m; m({port}, {self.upstream!r})"])
        self.urls["relay"], self.pids["relay"] = f"http://127.0.0.1:{port}/v1/completions", relay.pid
        port = _free_port()
        floor = self._spawn([py, "-c", here + f"floor_relay_main as m; m({port}, {up_port})"])
        self.urls["floor"], self.pids["floor"] = f"http://127.0.0.1:{port}/v1/completions", floor.pid
        trees: list[tuple[str, str | None]] = [("ours", None)]
        if self.base is not None:
            trees.append(("base", str(self.base)))
        for name, path in trees:
            port = _free_port()
            config = Path(tempfile.mkdtemp(prefix="hh-hotpath-")) / "proxy.json"
            Settings(port=port, upstreams=(UpstreamConfig(url=self.upstream),), model_dir=self.model_dir,
                     model_name="m", log_level="warning").dump(config)
            proc = self._spawn(proxy_argv(config, py), path)
            self.urls[f"{name}-pass"] = f"http://127.0.0.1:{port}/v1/completions"
            self.urls[f"{name}-chat"] = f"http://127.0.0.1:{port}/v1/chat/completions"
            self.pids[f"{name}-pass"] = self.pids[f"{name}-chat"] = proc.pid
        for pid in set(self.pids.values()):
            _pin(pid, 0)
        for url in set(self.urls.values()):
            await _wait(url.rsplit("/v1/", 1)[0] + "/health")

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the proxies before their upstream
            if proc.poll() is None:
                proc.terminate()
                proc.wait()

    def body(self, target: str, tokens: int, tag: str) -> dict[str, Any]:
        if target.endswith("-chat"):
            return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                    "stream": True, "user": tag, "chat_template_kwargs": {"enable_thinking": False}}
        return {"model": "m", "prompt": [1, 2, 3], "max_tokens": tokens, "stream": True, "user": tag}


async def ttfb_and_cpu(t: Targets, reps: int, block: int = 10, idle_s: float = 0.0) -> dict[str, dict[str, float]]:
    """1-token requests, C=1, in blocks of `block` per target, blocks interleaved: added TTFB over the
    direct call, and the target process's CPU per request (from /proc, over its own blocks only).
    `idle_s`: each request (the direct ones too) after that long idle, as an agent's turn comes after
    its tools ran: the same code then runs on cold caches (docs/hot-path.md)."""
    names = list(t.urls)
    ttfb: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, float] = {n: 0.0 for n in names}
    async with aiohttp.ClientSession() as s:
        for r in range(-2, max(1, reps // block)):  # two warm-up rounds
            for n in names:
                pid = t.pids.get(n)
                c0 = _cpu_seconds(pid) if pid else 0.0
                got = []
                for i in range(block):
                    if idle_s:
                        await asyncio.sleep(idle_s)
                    got.append(await _request(s, t.urls[n], t.body(n, 1, f"r{r}-{i}")))
                if r >= 0:
                    ttfb[n] += got
                    cpu[n] += (_cpu_seconds(pid) - c0) if pid else 0.0
    d50, d95 = statistics.median(ttfb["direct"]), _p95(ttfb["direct"])
    out = {}
    for n in names[1:]:
        out[n] = {"ttfb_added_p50_ms": (statistics.median(ttfb[n]) - d50) * 1e3,
                  "ttfb_added_p95_ms": (_p95(ttfb[n]) - d95) * 1e3,
                  "cpu_ms_per_request": cpu[n] / len(ttfb[n]) * 1e3}
    out["direct"] = {"ttfb_p50_ms": d50 * 1e3, "ttfb_p95_ms": d95 * 1e3}
    return out


def _p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(0.95 * len(xs)) - 1)]


async def cpu_per_token(t: Targets, conc: int, tokens: int, pace_ms: float) -> dict[str, float]:
    """`conc` streams of `tokens` tokens at once per target; the target process's CPU per upstream token."""
    out = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async with s.post(t.upstream + f"/_pace?ms={pace_ms}") as r:
            r.raise_for_status()
        for n, pid in t.pids.items():
            await _request(s, t.urls[n], t.body(n, 4, "warm"))
            c0 = _cpu_seconds(pid)
            await asyncio.gather(*[_request(s, t.urls[n], t.body(n, tokens, f"t{conc}-{j}")) for j in range(conc)])
            out[n] = (_cpu_seconds(pid) - c0) / (conc * tokens) * 1e6
    return out


def parse_cost(events: int = 2000, reps: int = 5) -> dict[str, float]:
    """µs per event through `EventStream.batches()` (parse + decode), one event per read vs `events` per read."""
    from proxy.upstream import EventStream

    ev = (b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764712345,"model":"fake",'
          b'"choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null,"stop_reason":null,'
          b'"token_ids":[279]}],"usage":null}\n\n')

    def stream_of(reads: list[bytes]) -> Any:
        """An EventStream fed `reads` as its network reads, no socket."""
        import proxy.upstream

        if not hasattr(proxy.upstream, "EnginePool"):  # a checkout from before the lean engine client
            return _aiohttp_stream_of(EventStream, reads)
        from proxy.engine_http import EngineConnection

        class Scripted(EngineConnection):
            async def wait(self) -> None:  # the next network read arrives
                if reads:
                    self.on_body(reads.pop())
                else:
                    self.complete = True

        class Pool:
            def release(self, conn: Any) -> None: ...

        return EventStream(Scripted(), Pool())  # type: ignore[arg-type]

    async def drain(reads: list[bytes]) -> float:
        stream = stream_of(reads[::-1])
        t0 = time.perf_counter()
        async for _ in stream.batches():
            pass
        return time.perf_counter() - t0

    async def run() -> dict[str, float]:
        small = min([await drain([ev] * events) for _ in range(reps)])
        big = min([await drain([ev * events]) for _ in range(reps)])
        return {"us_per_event_1_per_read": small / events * 1e6, f"us_per_event_{events}_per_read": big / events * 1e6}

    return asyncio.run(run())


def _aiohttp_stream_of(stream_cls: Any, reads: list[bytes]) -> Any:
    """The same, for an EventStream over an aiohttp response (checkouts before the lean client)."""

    class Content:
        async def readany(self) -> bytes:
            return reads.pop() if reads else b""

        def at_eof(self) -> bool:
            return not reads

    class Resp:
        content = Content()

        def release(self) -> None: ...

        def close(self) -> None: ...

    return stream_cls(Resp())


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    t = Targets(a.model_dir, a.base)
    try:
        await t.start()
        res: dict[str, Any] = {"requests": await ttfb_and_cpu(t, a.reps)}
        if a.idle_ms:
            res["after idle"] = await ttfb_and_cpu(t, a.reps, idle_s=a.idle_ms / 1e3)
        if a.agent_turns:
            # here, not at the top: `--base` runs this file inside a checkout that may not have it
            from backend.tools.hotpath_agent import agent_turns
            res["agent"] = await agent_turns(t, _cpu_seconds, turns=a.agent_turns)
        for pace, tokens in ((0.0, a.tokens), (5.0, a.paced_tokens)):
            for conc in (1, 8, 32):
                # rounds with the targets interleaved in each, the median per target: one round's figure
                # moved by +-15 us at C=8 between two targets running the same code
                rounds = [await cpu_per_token(t, conc, tokens, pace) for _ in range(a.rounds)]
                res[f"tokens pace={pace:g}ms C={conc}"] = {n: statistics.median(r[n] for r in rounds)
                                                           for n in rounds[0]}
        return res
    finally:
        t.stop()


def _goals(res: dict[str, Any], parse: dict[str, float], prefix: str) -> list[tuple[str, bool, str]]:
    chat, out = res["requests"].get(f"{prefix}-chat"), list[tuple[str, bool, str]]()
    if chat is None:
        return out
    out.append((f"{prefix}: chat added TTFB p50 <= 0.5 ms", chat["ttfb_added_p50_ms"] <= 0.5,
                f"{chat['ttfb_added_p50_ms']:.3f} ms"))
    for conc in (8, 32):
        row = res[f"tokens pace=5ms C={conc}"]
        d = row[f"{prefix}-chat"] - row["relay"]
        out.append((f"{prefix}: chat CPU/token <= relay + 10 us, paced, C={conc}", d <= 10,
                    f"chat {row[f'{prefix}-chat']:.1f} vs relay {row['relay']:.1f} us (+{d:.1f})"))
    if prefix == "ours":  # the parser this process imports
        vals = list(parse.values())
        ratio = vals[1] / vals[0]
        # The goal is against cost that grows with the read (the old parser: x3.4); a ratio below 1
        # means the per-read costs (await, batch) amortize over the read's events.
        out.append(("parse cost per event of a 2,000-event read <= 1.2x a 1-event read's", ratio <= 1.2,
                    f"ratio {ratio:.2f}"))
    return out


def _base_parse_cost(base: Path) -> dict[str, float] | None:
    """`parse_cost` against the other checkout's EventStream (this file run there by path)."""
    code = (f"import json, runpy; m = runpy.run_path({str(Path(__file__).resolve())!r}); "
            "print(json.dumps(m['parse_cost']()))")
    env = {**os.environ, "PYTHONPATH": str(base)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False,
                          cwd=base)  # `-c` puts the working directory first on sys.path too
    if done.returncode != 0:
        print(f"base parse cost not measured: {done.stderr.strip()[-300:]}")
        return None
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.tools.bench_hotpath", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--base", type=Path, help="another checkout whose proxy runs beside ours (targets base-*)")
    ap.add_argument("--reps", type=int, default=200, help="1-token requests per target for TTFB and CPU/request")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens per stream, fast upstream")
    ap.add_argument("--paced-tokens", type=int, default=400, help="tokens per stream at 5 ms/token")
    ap.add_argument("--rounds", type=int, default=3, help="CPU-per-token rounds (the median is printed)")
    ap.add_argument("--agent-turns", type=int, default=25,
                    help="turns per agent-shaped session (3 sessions; 0 skips them)")
    ap.add_argument("--idle-ms", type=float, default=0.0,
                    help="also the 1-token requests each after this long idle (an agent's turn after its tools)")
    a = ap.parse_args(argv)
    res = asyncio.run(run_all(a))
    parse = parse_cost()
    base_parse = _base_parse_cost(a.base) if a.base is not None else None
    for key in ("requests", "after idle"):
        if key not in res:
            continue
        if key == "after idle":
            print(f"the same, each request after {a.idle_ms:g} ms idle")
        print(f"{'target':<12} {'TTFB +p50 ms':>13} {'TTFB +p95 ms':>13} {'CPU/request ms':>15}")
        for n, row in res[key].items():
            if n != "direct":
                print(f"{n:<12} {row['ttfb_added_p50_ms']:13.3f} {row['ttfb_added_p95_ms']:13.3f} "
                      f"{row['cpu_ms_per_request']:15.3f}")
        print(f"direct TTFB p50 {res[key]['direct']['ttfb_p50_ms']:.3f} ms\n")
    if "agent" in res:
        d = res["agent"]["direct"]
        print(f"agent-shaped turns (spliced; body up to {d['body_kb']:.0f} KB, {d['prompt_tokens']} prompt tokens)")
        print(f"{'target':<12} {'TTFT +p50 ms':>13} {'CPU/turn ms':>12}")
        for n, row in res["agent"].items():
            if n != "direct":
                print(f"{n:<12} {row['ttfb_added_p50_ms']:13.3f} {row['cpu_ms_per_turn']:12.3f}")
        print(f"direct TTFT p50 {d['ttfb_p50_ms']:.3f} ms (a prompt of the same length)\n")
    rows = [k for k in res if k.startswith("tokens")]
    names = list(res[rows[0]])
    print("CPU per token, us " + " ".join(f"{n:>11}" for n in names))
    for k in rows:
        print(f"{k[7:]:<17} " + " ".join(f"{res[k][n]:11.1f}" for n in names))
    print()
    for k, v in parse.items():
        print(f"parse {k:<32} {v:8.3f}" + (f"   base {base_parse[k]:8.3f}" if base_parse else ""))
    print()
    for prefix in ("ours", "base"):
        for goal, ok, detail in _goals(res, parse, prefix):
            print(f"{'PASS' if ok else 'FAIL'}  {goal}: {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
