"""An in-process stand-in for vLLM's OpenAI server (aiohttp), plus helpers to serve our app on a free port.

Only what the proxy uses: /health, /v1/models, /v1/completions (token-id prompts, streaming,
return_token_ids), /v1/chat/completions, /metrics. Completions "generate" a scripted list of token ids
(`FakeVLLM.script`) so tests control the output exactly.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.front import ProxyApp
from proxy.server import protocol_for


@dataclass
class FakeVLLM:
    model_id: str = "fake-model"
    max_model_len: int = 4096
    # Each completion pops one script: (token_ids, texts, finish_reason). Default: 3 tokens "abc", stop.
    scripts: list[tuple[list[int], list[str], str]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    cached_tokens: int = 0
    fail_with: int | None = None
    delay_s: float = 0.0  # between streamed events
    head_delay_s: float = 0.0  # before a stream's response head (the engine still computing)
    pool_blocks: int | None = None  # KV pool reported on /metrics (the scheduler admits inline once known)
    aborted: int = 0  # streams the client (the proxy) dropped before the end

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_id, "object": "model", "max_model_len": self.max_model_len}]}
        )

    async def _metrics(self, _: web.Request) -> web.Response:
        text = "vllm:prefix_cache_hits_total 0.0\n"
        if self.pool_blocks is not None:
            text += ('vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",'
                     f'mamba_cache_mode="none",num_gpu_blocks="{self.pool_blocks}"}} 1.0\n'
                     'vllm:kv_cache_usage_perc{engine="0"} 0.0\n')
        return web.Response(text=text)

    def _next_script(self) -> tuple[list[int], list[str], str]:
        if self.scripts:
            return self.scripts.pop(0)
        return [11, 12, 13], ["a", "b", "c"], "stop"

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.fail_with is not None:
            return web.json_response({"error": {"message": "boom", "type": "x", "code": None}}, status=self.fail_with)
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list):  # vLLM's own answer to a body without a prompt
            return web.json_response({"error": {"message": "prompt: Field required", "type": "BadRequestError",
                                                "param": "prompt", "code": 400}}, status=400)
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        ids, texts, finish = self._next_script()
        limit = body.get("max_tokens") or len(ids)
        if limit < len(ids):
            ids, texts, finish = ids[:limit], texts[:limit], "length"
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(ids),
            "total_tokens": n_prompt + len(ids),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        base = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": self.model_id}
        if not body.get("stream"):
            choice = {"index": 0, "text": "".join(texts), "finish_reason": finish, "token_ids": ids}
            return web.json_response(
                {
                    **base,
                    "choices": [choice],
                    "usage": usage,
                    "prompt_token_ids": prompt if isinstance(prompt, list) else None,
                }
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        if self.head_delay_s:
            await asyncio.sleep(self.head_delay_s)
        await resp.prepare(request)
        for i, (tid, text) in enumerate(zip(ids, texts)):
            choice: dict[str, Any] = {
                "index": 0,
                "text": text,
                "token_ids": [tid],
                "finish_reason": finish if i == len(ids) - 1 else None,
            }
            if body.get("logprobs") is not None:
                choice["logprobs"] = _logprobs(tid, body["logprobs"], bool(body.get("return_tokens_as_token_ids")))
            event: dict[str, Any] = {**base, "choices": [choice]}
            if i == 0 and isinstance(prompt, list):
                event["prompt_token_ids"] = prompt
            try:
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
            except (ConnectionResetError, asyncio.CancelledError):
                self.aborted += 1
                raise
        if not ids:
            await resp.write(
                b"data: "
                + json.dumps(
                    {**base, "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": finish}]}
                ).encode()
                + b"\n\n"
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        base = {"id": "chatcmpl-fake", "created": 0, "model": body.get("model")}
        if not body.get("stream"):
            msg = {"role": "assistant", "content": "hi"}
            return web.json_response(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
                }
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for delta, fin in (({"role": "assistant", "content": ""}, None), ({"content": "hi"}, None), ({}, "stop")):
            chunk = {
                **base,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": fin}],
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _logprobs(tid: int, top: int, as_ids: bool) -> dict[str, Any]:
    """vLLM completions logprobs for one sampled id: logprob -(tid % 7) / 10, and `top` + 1
    alternatives (the sampled id first, then tid + 1, tid + 2, ...), keyed as vLLM keys them."""

    def key(t: int) -> str:
        return f"token_id:{t}" if as_ids else chr(t) if t < 2**21 else ""

    value = -(tid % 7) / 10
    alts = {key(tid): value} | {key(tid + k): value - k for k in range(1, top + 1)}
    return {"text_offset": [0], "token_logprobs": [value], "tokens": [key(tid)], "top_logprobs": [alts]}


@asynccontextmanager
async def fake_vllm_server(fake: FakeVLLM) -> AsyncIterator[str]:
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def serve_app(app: Any) -> AsyncIterator[str]:
    """Run an ASGI app with uvicorn in this event loop on a free loopback port; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # The proxy's app on the proxy's own protocol (its turns served without ASGI, proxy/server.py).
    http = protocol_for(app) if isinstance(app, ProxyApp) else "auto"
    config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False, http=http)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()
