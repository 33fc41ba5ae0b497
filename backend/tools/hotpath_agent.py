"""Agent-shaped turns for the hot-path bench (backend/tools/bench_hotpath.py): what a coding harness
sends, not a one-line prompt.

Each session starts with ~30 KB of tool definitions (20 tools), a ~5 KB system prompt and a ~60 KB
first user message, then every turn adds the proxy's own reply and a ~2 KB tool result, under one
session id: every turn after the first extends the session's transcript (the splice path), as an
agent's turns do. Per chat target: time to the first token and the proxy's CPU per turn over the
spliced turns, the targets interleaved turn by turn. `direct` is the upstream called with a
/v1/completions prompt of the same length (the engine's own echo of the prompt ids included), and
`relay` (the bare aiohttp relay) and `floor` (a byte pipe) passing that same request: what moving this
much data through one more process costs here, the yardsticks for the chat targets.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from proxy.format import load_format

_PARAM_TEXT = "One of the inputs this tool reads; say exactly what the caller wants here. "


def agent_tools(n: int = 20) -> list[dict[str, Any]]:
    """~30 KB of tool definitions, the size of a coding harness's set."""
    props = {f"arg_{j}": {"type": "string", "description": _PARAM_TEXT * 2} for j in range(8)}
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool {i}: " + "It reads files and runs commands. " * 12,
        "parameters": {"type": "object", "properties": props, "required": ["arg_0"]}}} for i in range(n)]


class Targets(Protocol):
    urls: dict[str, str]
    pids: dict[str, int]
    upstream: str
    model_dir: Path


def _first_messages(session: int) -> list[dict[str, Any]]:
    system = f"You are coding agent {session}. " + "Follow the repository's rules. " * 170
    task = "Here is the file to fix:\n" + "def f(x):\n    return x + 1  # a line of the file\n" * 1200
    return [{"role": "system", "content": system}, {"role": "user", "content": task}]


async def _turn(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                headers: dict[str, str]) -> tuple[float, str]:
    """(seconds to the first token, the reply's text). The first token is the first event that carries
    one (a chat delta with text or a finish, a completion's text or ids), timed by the network read it
    arrived in: a chat stream's first byte is its role chunk, sent before the engine's first event."""
    t = time.perf_counter()
    raw, marks = bytearray(), []
    async with s.post(url, json=body, headers=headers) as r:
        r.raise_for_status()
        async for chunk in r.content.iter_any():
            raw += chunk
            marks.append((len(raw), time.perf_counter() - t))
    text, first, pos = [], 0.0, 0
    for line in bytes(raw).split(b"\n"):
        pos += len(line) + 1
        if not line.startswith(b"data: {"):
            continue
        ev = json.loads(line[6:])
        for choice in ev.get("choices") or ():
            delta = choice.get("delta") or {}
            text.append(delta.get("content") or "")
            carries = (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                       or choice.get("text") or choice.get("token_ids") or choice.get("finish_reason"))
            if carries and not first:
                first = next(at for end, at in marks if end >= pos - 1)
    return first, "".join(text)


async def agent_turns(t: Targets, cpu_seconds: Any, sessions: int = 3,
                      turns: int = 25) -> dict[str, dict[str, float]]:
    names = [n for n in t.urls if n.endswith("-chat")]
    fmt = load_format(t.model_dir)  # the prompt's length, for the same-size direct and relay requests
    tools = agent_tools()
    hops = [n for n in ("relay", "floor") if n in t.urls]  # passing the same-size request
    measured = [*names, *hops]
    ttfb: dict[str, list[float]] = {n: [] for n in [*measured, "direct"]}
    cpu = dict.fromkeys(measured, 0.0)
    body_bytes = prompt_tokens = 0

    async def timed(s: aiohttp.ClientSession, n: str, body: dict[str, Any], headers: dict[str, str],
                    keep: bool) -> str:
        c0 = cpu_seconds(t.pids[n])
        first, reply = await _turn(s, t.urls[n], body, headers)
        if keep:  # the first turn renders afresh; the rest extend the transcript
            ttfb[n].append(first)
            cpu[n] += cpu_seconds(t.pids[n]) - c0
        return reply

    async with aiohttp.ClientSession() as s:
        for k in range(sessions):
            history = {n: _first_messages(k) for n in names}
            for turn in range(turns):
                for n in names:
                    body = {"model": "m", "messages": history[n], "tools": tools, "max_tokens": 1, "stream": True,
                            "stream_options": {"include_usage": True},
                            "chat_template_kwargs": {"enable_thinking": False}}
                    body_bytes = max(body_bytes, len(json.dumps(body)))
                    reply = await timed(s, n, body, {"x-session-id": f"{n}-{k}"}, turn > 0)
                    history[n] = [*history[n], {"role": "assistant", "content": reply},
                                  {"role": "user", "content": f"Tool result {turn}:\n" + "ok: a line\n" * 180}]
                if turn == 0:
                    continue
                prompt_tokens = len(fmt.render(history[names[0]][:-2], tools, enable_thinking=False).ids)
                same = {"model": "fake", "prompt": [17] * prompt_tokens, "max_tokens": 1, "stream": True,
                        "return_token_ids": True}
                ttfb["direct"].append((await _turn(s, t.urls["direct"], same, {}))[0])
                for n in hops:
                    await timed(s, n, same, {}, True)
    d50 = statistics.median(ttfb["direct"])
    out = {n: {"ttfb_added_p50_ms": (statistics.median(ttfb[n]) - d50) * 1e3,
               "cpu_ms_per_turn": cpu[n] / max(1, len(ttfb[n])) * 1e3} for n in measured}
    out["direct"] = {"ttfb_p50_ms": d50 * 1e3, "body_kb": body_bytes / 1024, "prompt_tokens": prompt_tokens}
    return out
