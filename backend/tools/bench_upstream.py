"""`python -m backend.tools.bench_upstream`: the per-request cost of Upstream's reuse tracer (the aiohttp trace
hook that lets `Upstream._send` resend a request that met a pooled connection the server had closed).

Two Upstreams on one loopback aiohttp server, one with the tracer and one without, the same
`post_raw` path; rounds alternate the order. Prints each round's µs per request, the medians and
their ratio (traced / plain), measured side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp
from aiohttp import web

from proxy.upstream import KEEPALIVE_S, Upstream, _reuse_tracer


async def _serve() -> tuple[web.AppRunner, str]:
    async def handle(req: web.Request) -> web.Response:
        await req.read()
        return web.json_response({"ok": 1})

    app = web.Application()
    app.router.add_post("/x", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _upstream(url: str, traced: bool) -> Upstream:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    session = aiohttp.ClientSession(connector=connector, trace_configs=[_reuse_tracer()] if traced else None)
    return Upstream(url, session)


async def run(requests: int, rounds: int) -> dict[str, list[float]]:
    runner, url = await _serve()
    ups = {"plain": _upstream(url, False), "traced": _upstream(url, True)}
    out: dict[str, list[float]] = {name: [] for name in ups}
    try:
        for r in range(rounds):
            order = list(ups.items()) if r % 2 == 0 else list(reversed(ups.items()))
            for name, up in order:
                for _ in range(50):  # warm the pool and the code
                    await up.post_raw("/x", b"{}")
                t0 = time.perf_counter()
                for _ in range(requests):
                    await up.post_raw("/x", b"{}")
                out[name].append((time.perf_counter() - t0) / requests * 1e6)
    finally:
        for up in ups.values():
            await up.close()
        await runner.cleanup()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    res = asyncio.run(run(args.requests, args.rounds))
    for name, vals in res.items():
        row = " ".join(f"{v:6.1f}" for v in vals)
        print(f"{name:7s} {row}  median {statistics.median(vals):6.1f} µs/request")
    ratio = statistics.median(res["traced"]) / statistics.median(res["plain"])
    print(f"traced / plain (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
