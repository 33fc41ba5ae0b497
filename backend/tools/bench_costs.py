"""The proxy's own costs, measured side by side (a script, not a timed test):

1. render + tokenize + splice for a 100K-token session with 1K new tokens (`TurnService.plan`, the
   whole pre-upstream path: validation, identity, store lookup, matching, continuation render,
   prompt serialization), against a fresh render of the same conversation;
2. added time to first byte: a fast fake engine (separate process) called directly vs through the
   proxy (separate process, one uvicorn worker), pass-through and chat, interleaved, p50/p95;
3. proxy CPU per streamed event (from /proc/PID/stat), pass-through and chat.

    python -m backend.tools.bench_costs --model-dir ~/.cache/hyperharness/models/tiny-qwen-hybrid-v1

`--hot-path` runs backend/tools/bench_hotpath.py instead (issue 28: a bare relay, our pass-through and
chat mode side by side, pinned, at C = 1/8/32, fast and engine-paced, with the goals as pass/fail); the
arguments after it are that tool's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from backend.runtime import proxy_argv
from proxy.settings import Settings, UpstreamConfig

# -- 1. render cost ------------------------------------------------------------------------------


class _StubUpstream:
    """Just what `TurnService.plan` asks of the engine: the served model and its window."""

    async def model(self, *, refresh: bool = False) -> Any:
        from proxy.upstream import ModelInfo

        return ModelInfo("stub", 1_000_000)


def _session(fmt: Any, target_tokens: int) -> list[dict[str, Any]]:
    """An agent session of about `target_tokens`: a system prompt, then rounds of tool call + result."""
    para = " ".join(f"word{i} alpha beta gamma delta." for i in range(60))  # ~400 tokens
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent.\n" + para},
        {"role": "user", "content": "Refactor the project."},
    ]
    i = 0
    while len(fmt.render(messages).ids) < target_tokens:
        for _ in range(8):
            i += 1
            messages.append(
                {
                    "role": "assistant",
                    "content": f"Step {i}.",
                    "tool_calls": [
                        {
                            "id": f"call_{i}",
                            "type": "function",
                            "function": {"name": "read", "arguments": json.dumps({"path": f"f{i}.py"})},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"# file {i}\n" + para * 2})
    return messages


async def render_cost(model_dir: Path, tokens: int, new_tokens: int, reps: int) -> dict[str, float]:
    from proxy.format import load_format
    from proxy.ingress import Ingress
    from proxy.metrics import Metrics
    from proxy.quirks import QuirkLog
    from proxy.store.memory import MemoryStore
    from proxy.turn import TurnService

    fmt = load_format(model_dir)
    store = MemoryStore()
    metrics = Metrics()
    svc = TurnService(fmt=fmt, upstream=_StubUpstream(), store=store, metrics=metrics)  # type: ignore[arg-type]
    ingress = Ingress(QuirkLog(metrics.registry))
    history = _session(fmt, tokens)
    headers = {"x-session-id": "bench"}

    def request(body: dict[str, Any]) -> Any:  # what the route does before planning
        return ingress.openai(json.loads(json.dumps(body)), headers, max_model_len=1_000_000)

    # Turn N: the whole history ends with a user message; it is stored as if the engine answered it.
    last_call = {
        "role": "assistant",
        "content": "Reading.",
        "tool_calls": [
            {"id": "call_last", "type": "function", "function": {"name": "read", "arguments": '{"path": "big.py"}'}}
        ],
    }
    body_n = {"model": "m", "messages": [*history, {"role": "user", "content": "Next file."}]}
    plan = await svc.plan(request(body_n))
    generated = fmt.tokenizer.encode(
        "Reading.\n\n<tool_call>\n<function=read>\n<parameter=path>\nbig.py\n</parameter>\n</function>\n</tool_call>"
    ) + sorted(fmt.stop_token_ids)
    await svc.remember(plan, generated, "tool_calls", last_call)
    # Turn N+1: the reply echoed plus a ~1K-token tool result.
    big = " ".join(f"line{i} = compute(value_{i}) + offset" for i in range(int(new_tokens / 9.5)))
    body: dict[str, Any] = {
        "model": "m",
        "messages": [*body_n["messages"], last_call, {"role": "tool", "tool_call_id": "call_last", "content": big}],
    }
    splice = await svc.plan(request(body))
    if splice.parent is None:
        raise RuntimeError("benchmark setup error: turn N+1 did not splice")
    new = len(splice.prompt) - len(splice.parent.ids)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        await svc.plan(request(body))
        times.append(time.perf_counter() - t)
    fresh = []
    for _ in range(max(3, reps // 10)):
        t = time.perf_counter()
        fmt.render(body["messages"])
        fresh.append(time.perf_counter() - t)
    return {
        "session_tokens": len(splice.prompt),
        "new_tokens": new,
        "splice_p50_ms": statistics.median(times) * 1e3,
        "splice_p95_ms": sorted(times)[int(0.95 * len(times)) - 1] * 1e3,
        "fresh_render_warm_cache_p50_ms": statistics.median(fresh) * 1e3,
    }


# -- 2./3. relay costs -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def _has_token(line: bytes) -> bool:
    """A chunk carrying generated text (not the empty role chunk)."""
    return any(k in line and (k + b'"') not in line for k in (b'"content":"', b'"reasoning_content":"', b'"text":"'))


async def _ttfb(s: aiohttp.ClientSession, url: str, body: dict[str, Any], content: bool) -> tuple[float, int]:
    """Seconds to the first byte (or first content delta) and the number of SSE events read."""
    t = time.perf_counter()
    first = 0.0
    n = 0
    async with s.post(url, json=body) as r:
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            n += 1
            if not first and (not content or _has_token(line)):
                first = time.perf_counter() - t
    return first, n


async def relay_costs(model_dir: Path, reps: int, streams: int, events: int) -> dict[str, float]:
    up_port, px_port = _free_port(), _free_port()
    py = sys.executable
    fake_main = "from backend.tools.fake_engine import fake_engine_main as m; m({}, {}, {})"
    fake = subprocess.Popen([py, "-c", fake_main.format(up_port, 1, 0)])
    fake_slow = None
    config = Path(tempfile.mkdtemp(prefix="hh-bench-")) / "proxy.json"
    upstream = UpstreamConfig(url=f"http://127.0.0.1:{up_port}")
    Settings(port=px_port, upstreams=(upstream,), model_dir=model_dir, model_name="m", log_level="warning").dump(config)
    proxy = subprocess.Popen(proxy_argv(config, py))
    out: dict[str, float] = {}
    try:
        await _wait(f"http://127.0.0.1:{up_port}/health")
        await _wait(f"http://127.0.0.1:{px_port}/health")
        direct = f"http://127.0.0.1:{up_port}/v1/completions"
        passthru = f"http://127.0.0.1:{px_port}/v1/completions"
        chat = f"http://127.0.0.1:{px_port}/v1/chat/completions"
        comp = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": True}
        msgs = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "stream": True,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        res: dict[str, list[float]] = {"direct": [], "passthrough": [], "chat_first_byte": [], "chat_first_token": []}
        async with aiohttp.ClientSession() as s:
            for i in range(reps + 20):  # interleaved; the first 20 warm up
                d = (await _ttfb(s, direct, comp, False))[0]
                p = (await _ttfb(s, passthru, comp, False))[0]
                c = (await _ttfb(s, chat, {**msgs, "user": f"u{i}"}, False))[0]
                ct = (await _ttfb(s, chat, {**msgs, "user": f"v{i}"}, True))[0]
                if i >= 20:
                    for k, v in zip(res, (d, p, c, ct), strict=True):
                        res[k].append(v)
        base = statistics.median(res["direct"])
        out["direct_ttfb_p50_ms"] = base * 1e3
        for k in ("passthrough", "chat_first_byte", "chat_first_token"):
            out[f"{k}_added_p50_ms"] = (statistics.median(res[k]) - base) * 1e3
            out[f"{k}_added_p95_ms"] = (
                sorted(res[k])[int(0.95 * reps) - 1] - sorted(res["direct"])[int(0.95 * reps) - 1]
            ) * 1e3
        fake.terminate()
        fake.wait()
        # CPU per event: a slower engine that streams `events` events per request, `streams` at once.
        fake_slow = subprocess.Popen(
            [py, "-c", fake_main.format(up_port, events, 5)]
        )
        await _wait(f"http://127.0.0.1:{up_port}/health")
        async with aiohttp.ClientSession() as s:
            for name, url, body in (
                ("passthrough", passthru, {**comp, "max_tokens": events}),
                ("chat", chat, {**msgs, "max_tokens": events}),
            ):
                cpu0 = _cpu_seconds(proxy.pid)
                counts = await asyncio.gather(
                    *[_ttfb(s, url, {**body, "user": f"c{j}"}, False) for j in range(streams)]
                )
                cpu = _cpu_seconds(proxy.pid) - cpu0
                upstream_events = streams * events
                out[f"{name}_cpu_us_per_event"] = cpu / upstream_events * 1e6
                out[f"{name}_events_relayed"] = sum(n for _, n in counts)
    finally:
        for proc in (fake, fake_slow, proxy):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--hot-path" in argv:
        from backend.tools.bench_hotpath import main as hot_path

        return hot_path([a for a in argv if a != "--hot-path"])
    ap = argparse.ArgumentParser(prog="python -m backend.tools.bench_costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--new-tokens", type=int, default=1_000)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--skip-relay", action="store_true")
    a = ap.parse_args(argv)
    results = asyncio.run(render_cost(a.model_dir, a.tokens, a.new_tokens, max(a.reps // 4, 20)))
    if not a.skip_relay:
        results |= asyncio.run(relay_costs(a.model_dir, a.reps, a.streams, a.events))
    for k, v in results.items():
        print(f"{k:<36} {v:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
