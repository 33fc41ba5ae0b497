"""The rig for real-harness tests: our proxy app served in-process against a real engine, wrapped in a
pure-ASGI recorder that keeps every request the harness sent (method, path, headers, JSON body) and what
the proxy answered (status, usage with cached prompt tokens), and helpers to run a harness CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from proxy.app import create_app
from proxy.settings import Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_vllm import serve_app

KEY = "sk-harness-test"
# Headers worth keeping in a trace (the rest is SDK noise: x-stainless-*, accept, content-length).
KEPT_HEADERS = re.compile(r"^(user-agent|x-harness|x-session-id|session_id|x-session-affinity|x-client-request-id"
                          r"|x-deepseek-harness-.*|x-parent-session-id|anthropic-.*)$")
_DATA = re.compile(rb"^data: (\{.*\})\s*$", re.M)
MODEL_PATHS = ("/v1/chat/completions", "/v1/messages")


@dataclass
class Exchange:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    status: int = 0
    usage: dict[str, Any] | None = None
    # vLLM prefix-cache counters (tokens) over the exchange: queried and hit. The engine runs without
    # --enable-prompt-tokens-details, so usage.cached_tokens is 0; these deltas are the measurement.
    engine_queries: float = 0.0
    engine_hits: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.engine_hits / self.engine_queries if self.engine_queries else 0.0

    @property
    def prompt_tokens(self) -> int:
        u = self.usage or {}
        if "input_tokens" in u:  # Anthropic: input excludes cached
            return int(u.get("input_tokens") or 0) + int(u.get("cache_read_input_tokens") or 0)
        return int(u.get("prompt_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        u = self.usage or {}
        if "cache_read_input_tokens" in u:
            return int(u.get("cache_read_input_tokens") or 0)
        return int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def usage_of(raw: bytes) -> dict[str, Any] | None:
    """The last usage object of a JSON or SSE (OpenAI or Anthropic) response body."""
    found = None
    objs = [m.group(1) for m in _DATA.finditer(raw)] or [raw]
    for obj in objs:
        try:
            data = json.loads(obj)
        except ValueError:
            continue
        if not isinstance(data, dict):
            continue
        usage = data.get("usage") or (data.get("message") or {}).get("usage")
        if isinstance(usage, dict) and usage:
            found = {**(found or {}), **usage} if "input_tokens" in usage or "output_tokens" in usage else usage
    return found


_QUERIES = re.compile(r"^vllm:prefix_cache_queries_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
_HITS = re.compile(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


async def engine_counters(engine_url: str) -> tuple[float, float]:
    """(prefix-cache queries, hits) in tokens, summed over label sets."""
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            text = (await c.get(engine_url + "/metrics")).text
    except httpx.HTTPError:
        return 0.0, 0.0  # the engine is gone: the model call itself will fail and say so
    return sum(map(float, _QUERIES.findall(text))), sum(map(float, _HITS.findall(text)))


class Recorder:
    """Pure ASGI: records each HTTP exchange; never changes what passes through. Around each model call
    it also reads the engine's prefix-cache counters (exact when calls do not overlap)."""

    def __init__(self, app: Any, engine_url: str | None = None) -> None:
        self.app = app
        self.engine_url = engine_url
        self.exchanges: list[Exchange] = []
        self._pending: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        ex = Exchange(scope["method"], scope["path"], {k: v for k, v in headers.items() if KEPT_HEADERS.match(k)},
                      None)
        self.exchanges.append(ex)
        body, out = bytearray(), bytearray()
        counting = self.engine_url is not None and scope["method"] == "POST" and scope["path"] in MODEL_PATHS
        if counting:
            q0, h0 = await engine_counters(self.engine_url)  # type: ignore[arg-type]

        async def rec_receive() -> Any:
            msg = await receive()
            if msg["type"] == "http.request":
                body.extend(msg.get("body", b""))
                if not msg.get("more_body"):
                    try:
                        ex.body = json.loads(body) if body else None
                    except ValueError:
                        ex.body = {"_raw_bytes": len(body)}
            return msg

        async def rec_send(msg: Any) -> None:
            if msg["type"] == "http.response.start":
                ex.status = msg["status"]
            elif msg["type"] == "http.response.body":
                out.extend(msg.get("body", b""))
                if not msg.get("more_body"):
                    ex.usage = usage_of(bytes(out))
            await send(msg)

        try:
            await self.app(scope, rec_receive, rec_send)
        finally:
            if counting:
                # A task of its own: when the client leaves right after [DONE] (Pi does), the server
                # cancels this request's task, which must not cancel the measurement.
                task = asyncio.get_running_loop().create_task(self._count(ex, q0, h0))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)

    async def settle(self) -> None:
        """Wait for the measurements still running (call before reading `engine_*`)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def _count(self, ex: Exchange, q0: float, h0: float) -> None:
        """Runs even when the client left right after the last chunk (Pi exits on [DONE])."""
        # vLLM updates the counters a moment after the last token is sent: wait for them to move.
        for _ in range(50):
            q1, h1 = await engine_counters(self.engine_url)  # type: ignore[arg-type]
            if q1 > q0 or ex.status not in (0, 200):
                break
            await asyncio.sleep(0.1)
        ex.engine_queries, ex.engine_hits = q1 - q0, h1 - h0

    def model_calls(self, start: int = 0) -> list[Exchange]:
        return [e for e in self.exchanges[start:] if e.method == "POST" and e.path in MODEL_PATHS]


class ForceReply:
    """Pure ASGI, between the recorder and the app: adds vLLM structured outputs to each model call so the
    engine answers exactly `reply` and stops. SmolLM2-135M under a harness' long system prompt rambles
    until the cap at temperature 1 (seen: 4 of 4 runs hit 160 tokens), and DSH exits 1 on a length stop;
    a forced short answer keeps two turns in CI's budget and leaves the prompts exactly the harness'."""

    def __init__(self, app: Any, reply: str) -> None:
        self.app = app
        self.reply = reply

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in MODEL_PATHS:
            await self.app(scope, receive, send)
            return
        raw = bytearray()
        while True:
            msg = await receive()
            raw.extend(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        try:
            body = json.loads(raw)
            body["structured_outputs"] = {"choice": [self.reply]}
            raw = bytearray(json.dumps(body).encode())
        except (ValueError, TypeError):
            pass
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        sent = False

        async def once() -> Any:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": bytes(raw), "more_body": False}

        await self.app({**scope, "headers": headers}, once, send)


@dataclass
class Rig:
    url: str  # proxy base, no /v1
    app: Any
    recorder: Recorder
    engine: Any
    key_file: Path

    def quirk_log(self) -> list[Any]:
        return list(self.app.state.services.quirk_log.recent)


@asynccontextmanager
async def proxy_rig(engine: Any, tmp: Path, force_reply: str | None = "Done.") -> AsyncIterator[Rig]:
    settings = Settings(upstream=engine.base_url, model_dir=engine.model_dir, model_name=engine.model_name,
                        api_key=KEY)
    app = create_app(settings, store=MemoryStore())
    recorder = Recorder(ForceReply(app, force_reply) if force_reply else app, engine.base_url)
    key_file = tmp / "proxy.key"
    key_file.write_text(KEY + "\n")
    async with serve_app(recorder) as url:
        yield Rig(url, app, recorder, engine, key_file)


@dataclass
class Run:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


async def run_cli(argv: list[str], *, env: Mapping[str, str], cwd: Path, timeout_s: float, log: Path) -> Run:
    """Run a harness CLI without blocking the loop that serves the proxy; kill its group on timeout."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    proc = await asyncio.create_subprocess_exec(*argv, env=dict(env), cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        os.killpg(proc.pid, 9)
        out, err = await proc.communicate()
        proc.returncode = 124
    run = Run(argv, proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"),
              loop.time() - started)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"$ {' '.join(argv)}\n[rc={run.returncode} {run.seconds:.1f}s]\n--- stdout\n{run.stdout}\n"
                f"--- stderr\n{run.stderr[-20000:]}\n")
    return run


async def adapters_install(harness: str, rig: Rig, home: Path, *, max_output: int, log: Path) -> Run:
    """`hyperharness adapters install` as a user runs it (a subprocess: it calls the proxy synchronously)."""
    import sys

    argv = [sys.executable, "-c", "from backend.cli import main; main()", "adapters", "install", harness,
            "--base-url", rig.url + "/v1",
            "--key-file", str(rig.key_file), "--home", str(home), "--max-output", str(max_output)]
    return await run_cli(argv, env=os.environ, cwd=Path.cwd(), timeout_s=120, log=log)
