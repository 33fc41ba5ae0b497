"""`python -m backend.tools.bench_engine_client`: the turn's engine client (proxy/engine_http.py) beside
aiohttp doing the same job, side by side in one run.

The same fast local upstream in vLLM's stream format as the hot-path bench (bench_hotpath), pinned to
the second core; this process on the first, on uvloop as the proxy runs. Each round streams N requests
of T tokens through `Upstream.open_events` + `read_batch` (ours) and through an aiohttp session that
posts the same body and feeds each `readany()` to the same SSE parser and event decoder (aiohttp),
the order alternating per round. Prints CPU and wall µs per request per round, the medians and the
ratio aiohttp / ours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import aiohttp
import uvloop

from backend.tools.bench_costs import _free_port, _wait
from proxy.sse import SSEParser
from proxy.upstream import _EVENT, Upstream


async def ours(up: Upstream, body: bytes) -> int:
    stream = await up.open_events("/v1/completions", body)
    events = 0
    try:
        while (batch := await stream.read_batch()) is not None:
            events += len(batch)
    finally:
        stream.close()
    return events


RETRIES = {"aiohttp": 0}


async def with_aiohttp(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    try:
        return await _aiohttp_once(session, url, body)
    except aiohttp.ClientOSError:  # seen once under load: "Can not write request body"; counted, printed
        RETRIES["aiohttp"] += 1
        return await _aiohttp_once(session, url, body)


async def _aiohttp_once(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    sse, events = SSEParser(), 0
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
        while not sse.done and (chunk := await resp.content.readany()):
            events += len([_EVENT.decode(d) for d in sse.feed(chunk)])
        await resp.read()  # the rest (the chunked terminator), so the connection is reused
    return events


async def run(url: str, requests: int, tokens: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": tokens, "stream": True, "return_token_ids": True}).encode()
    up = Upstream.open(url)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0))
    calls = {"ours": lambda: ours(up, body), "aiohttp": lambda: with_aiohttp(session, url + "/v1/completions", body)}
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    try:
        for call in calls.values():  # warm both
            for _ in range(50):
                await call()
        for r in range(rounds):
            for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(requests):
                    await calls[name]()
                out[name].append(((time.process_time() - c0) / requests * 1e6,
                                  (time.perf_counter() - t0) / requests * 1e6))
    finally:
        await up.close()
        await session.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.tools.bench_engine_client",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    a = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    port = _free_port()
    code = (f"import os; os.sched_setaffinity(0, {{{cores[-1]}}}); "
            f"from backend.tools.bench_hotpath import vllm_like_main as m; m({port})")
    upstream = subprocess.Popen([sys.executable, "-c", code])
    os.sched_setaffinity(0, {cores[0]})
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait(url + "/health"))
        for tokens in a.tokens:
            res = uvloop.run(run(url, a.requests, tokens, a.rounds))
            for name, rows in res.items():
                print(f"{tokens:>4} tokens  {name:<8} " + "  ".join(f"{c:7.1f}/{w:7.1f}" for c, w in rows)
                      + "   (CPU/wall µs per request, per round)")
            cpu = {n: statistics.median(c for c, _ in rows) for n, rows in res.items()}
            wall = {n: statistics.median(w for _, w in rows) for n, rows in res.items()}
            print(f"{tokens:>4} tokens  median CPU µs/request: ours {cpu['ours']:.1f}, "
                  f"aiohttp {cpu['aiohttp']:.1f} (x{cpu['aiohttp'] / cpu['ours']:.2f}); "
                  f"wall: ours {wall['ours']:.1f}, aiohttp {wall['aiohttp']:.1f} "
                  f"(x{wall['aiohttp'] / wall['ours']:.2f})")
        print(f"aiohttp requests sent again after a connection error: {RETRIES['aiohttp']}")
    finally:
        upstream.terminate()
        upstream.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
