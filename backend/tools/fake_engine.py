"""A fast stand-in for vLLM's OpenAI server, for the proxy's benches, soak and fault tests: a process of its
own that imports aiohttp only (so it starts in well under a second, and can be SIGKILLed and restarted
on its port). /v1/completions streams one-token events in vLLM's format; /health, /v1/models, /metrics.

    python -m backend.tools.fake_engine PORT EVENTS INTERVAL_MS
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web


def fake_engine_main(port: int, events: int, interval_ms: float) -> None:
    """A fast stand-in for vLLM: /v1/completions streams `events` one-token events (ids 16, 17, ...)."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake", "max_model_len": 1_000_000}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or events)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(min(n, events)):
            fin = "length" if i == min(n, events) - 1 else None
            ev = {
                "id": "cmpl",
                "object": "text_completion",
                "created": 0,
                "model": "fake",
                "choices": [
                    {"index": 0, "text": "x", "token_ids": [16 + i % 50], "logprobs": None, "finish_reason": fin}
                ],
            }
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            if interval_ms:
                await asyncio.sleep(interval_ms / 1000)
        await resp.write(b'data: {"id":"cmpl","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def fake_engine_argv(python: str, port: int, events: int, interval_ms: float) -> list[str]:
    """The command line that runs `fake_engine_main` in a process of its own."""
    return [python, "-m", "backend.tools.fake_engine", str(port), str(events), str(interval_ms)]


if __name__ == "__main__":
    import sys

    fake_engine_main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
