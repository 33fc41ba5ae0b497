"""`hyperharness replay TRACE... --base-url URL [--direct-url URL]`: replay multi-turn agent traces
serially and print, per turn and in total, prompt tokens, tokens served from the engine's prefix
cache (delta of `vllm:prefix_cache_hits_total`), previously-seen tokens prefilled again, and TTFT.

Modes, in one run: `proxy` (through our proxy), `proxy+warmup` (the same, asking the proxy to prefill
the next turn's prefix during the tool gap, header `x-hyperharness-warmup: 1`), and `direct` (vLLM's
own chat endpoint). Each mode gets its own nonce at the start of every system prompt, so modes never
share cached blocks.

Trace format (JSONL, one event per line; see backend/tools/traces/*.jsonl):
    {"session": S, "start": {"system", "tools", "user", "thinking", "think_end_id", "client", "headers",
                             "max_tokens", "force"}}
    {"session": S, "turn": {"user"?, "tool_results"?, "force"?, "max_tokens"?}}
    {"session": S, "compact": {"summary", "max_tokens"?}}   history replaced: [system, user(summary)]
    {"session": S, "side": {"user", "max_tokens"?}}         a one-off request on the same session
A turn first echoes the previous reply the way the session's client does (`faithful`: with
`reasoning_content`; `renamed`: as `reasoning`; `stripped`: no reasoning), then one tool result per
tool call, then the new user message. `force` makes the engine emit exactly that text
(vLLM structured outputs), which is how traces get parallel tool calls out of a random-weight model.

Accounting per turn: `seen` = tokens of this session's previous prompt + output (what the engine
has computed before); `lcp` = how many of them the new prompt starts with; `diverged` = seen − lcp
(previously-seen tokens lost to prompt divergence: the proxy's goal is 0); `reprefilled` = seen −
cached (including what the engine's checkpoint granularity costs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from proxy.sessions import SESSION_HEADERS
from proxy.transcripts import common_prefix_len
from proxy.upstream import KEEPALIVE_S

TRACES_DIR = Path(__file__).parent / "traces"
_HITS = re.compile(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


@dataclass
class TurnResult:
    session: str
    kind: str
    prompt: int
    cached: int
    seen: int
    lcp: int
    ttft_ms: float
    output: int

    @property
    def diverged(self) -> int:
        return max(0, self.seen - self.lcp)

    @property
    def reprefilled(self) -> int:
        return max(0, self.seen - self.cached)


@dataclass
class SessionState:
    spec: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    last: dict[str, Any] | None = None  # the previous reply (message dict)
    sequence: list[int] = field(default_factory=list)  # previous prompt + output ids


def load_trace(path: Path) -> list[dict[str, Any]]:
    events = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                events.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc}") from exc
    return events


def echo(reply: dict[str, Any], client: str) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
    reasoning = reply.get("reasoning_content") or reply.get("reasoning")
    if reasoning and client == "faithful":
        out["reasoning_content"] = reasoning
    elif reasoning and client == "renamed":
        out["reasoning"] = reasoning
    if reply.get("tool_calls"):
        out["tool_calls"] = reply["tool_calls"]
    return out


class Replayer:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        *,
        url: str,
        mode: str,
        model: str,
        api_key: str | None,
        metrics_url: str | None,
        gap_s: float,
    ) -> None:
        self.http = http
        self.url = url.rstrip("/")
        self.mode = mode
        self.model = model
        self.api_key = api_key
        self.metrics_url = metrics_url
        self.gap_s = gap_s
        self.nonce_hex = secrets.token_hex(4)
        self.nonce = f"[{mode} {self.nonce_hex}] "

    async def hits(self) -> float:
        if not self.metrics_url:
            return 0.0
        async with self.http.get(self.metrics_url.rstrip("/") + "/metrics") as resp:
            text = await resp.text()
        return sum(float(v) for v in _HITS.findall(text))

    async def run(self, events: list[dict[str, Any]]) -> list[TurnResult]:
        sessions: dict[str, SessionState] = {}
        results: list[TurnResult] = []
        for event in events:
            name = event["session"]
            kind = next(k for k in ("start", "turn", "compact", "side") if k in event)
            body = event[kind]
            if kind == "start":
                state = sessions[name] = SessionState(spec=body)
                state.messages = [
                    {"role": body.get("system_role", "system"), "content": self.nonce + body["system"]},
                    {"role": "user", "content": body["user"]},
                ]
                messages = state.messages
            else:
                state = sessions[name]
                messages = self._next_messages(state, kind, body)
            if results:
                await asyncio.sleep(self.gap_s)  # the harness runs its tools
            results.append(await self._request(name, kind, state, messages, body))
        return results

    def _next_messages(self, state: SessionState, kind: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        system = state.messages[0]
        if kind == "compact":
            state.messages = [system, {"role": "user", "content": body["summary"]}]
            state.sequence = []  # a compaction is a cold prefill by design: nothing counts as seen
            return state.messages
        if kind == "side":
            return [system, {"role": "user", "content": body["user"]}]
        assert state.last is not None  # a turn always follows a request of its session
        state.messages.append(echo(state.last, state.spec.get("client", "faithful")))
        results = body.get("tool_results") or []
        for i, call in enumerate(state.last.get("tool_calls") or []):
            content = results[i] if i < len(results) else f"(output of {call['function']['name']})"
            state.messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        if body.get("user"):
            state.messages.append({"role": "user", "content": body["user"]})
        return state.messages

    async def _request(
        self, name: str, kind: str, state: SessionState, messages: list[dict[str, Any]], body: dict[str, Any]
    ) -> TurnResult:
        spec = state.spec
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "temperature": 0,
            "max_tokens": body.get("max_tokens", spec.get("max_tokens", 24)),
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": bool(spec.get("thinking", True))},
        }
        if spec.get("tools"):
            payload["tools"] = spec["tools"]
        force = body.get("force")
        if force and spec.get("thinking", True) and spec.get("think_end_id") is not None:
            # Engines with a reasoning parser apply the grammar only after reasoning: end it at once.
            payload["structured_outputs"] = {"choice": ["\n\n" + force]}
            payload["logit_bias"] = {str(spec["think_end_id"]): 100}
        elif force:
            payload["structured_outputs"] = {"choice": [force]}
        # Harness session headers get the mode's nonce so modes never share a transcript; sessions
        # without one are told apart by the proxy's fingerprint (the system prompt carries the nonce).
        headers = {
            k: (f"{v}-{self.nonce_hex}" if k.lower() in SESSION_HEADERS else v)
            for k, v in spec.get("headers", {}).items()
        }
        if self.mode == "proxy+warmup":
            headers["x-hyperharness-warmup"] = "1"
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        before = await self.hits()
        prompt, output, reply, ttft = await self._stream(payload, headers)
        cached = int(await self.hits() - before)
        seen = len(state.sequence) if kind != "side" else 0
        lcp = common_prefix_len(state.sequence, prompt) if seen else 0
        if kind != "side":
            state.sequence = prompt + output
            state.last = reply
        return TurnResult(name, kind, len(prompt), cached, seen, lcp, ttft, len(output))

    async def _stream(
        self, payload: dict[str, Any], headers: dict[str, str]
    ) -> tuple[list[int], list[int], dict[str, Any], float]:
        started = time.perf_counter()
        ttft = 0.0
        prompt: list[int] = []
        output: list[int] = []
        reply: dict[str, Any] = {"content": "", "reasoning_content": ""}
        calls: dict[int, dict[str, Any]] = {}
        async with self.http.post(self.url + "/v1/chat/completions", json=payload, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self.mode}: HTTP {resp.status}: {(await resp.text())[:500]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                prompt = event.get("prompt_token_ids") or prompt
                for choice in event.get("choices") or ():
                    output += choice.get("token_ids") or []
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    if (text or delta.get("tool_calls")) and not ttft:
                        ttft = (time.perf_counter() - started) * 1000
                    reply["content"] += delta.get("content") or ""
                    reply["reasoning_content"] += delta.get("reasoning_content") or delta.get("reasoning") or ""
                    for tc in delta.get("tool_calls") or ():
                        entry = calls.setdefault(
                            tc["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                        )
                        entry["id"] += tc.get("id") or ""
                        fn = tc.get("function") or {}
                        entry["function"]["name"] += fn.get("name") or ""
                        entry["function"]["arguments"] += fn.get("arguments") or ""
        if calls:
            reply["tool_calls"] = [calls[i] for i in sorted(calls)]
        return prompt, output, reply, ttft


def _table(mode: str, trace: str, results: list[TurnResult]) -> str:
    lines = [
        f"\n== {trace} · {mode}",
        f"{'#':>3} {'session':<10} {'kind':<8} {'prompt':>7} {'cached':>7} {'seen':>7} {'diverged':>8} "
        f"{'reprefill':>9} {'ttft ms':>8}",
    ]
    for i, r in enumerate(results, 1):
        lines.append(
            f"{i:>3} {r.session[:10]:<10} {r.kind:<8} {r.prompt:>7} {r.cached:>7} {r.seen:>7} "
            f"{r.diverged:>8} {r.reprefilled:>9} {r.ttft_ms:>8.1f}"
        )
    return "\n".join(lines)


def _totals(results: list[TurnResult]) -> dict[str, float]:
    warm = [r for r in results if r.seen]
    return {
        "prompt": sum(r.prompt for r in results),
        "cached": sum(r.cached for r in results),
        "seen": sum(r.seen for r in warm),
        "diverged": sum(r.diverged for r in warm),
        "reprefilled": sum(r.reprefilled for r in warm),
        "ttft_ms": sum(r.ttft_ms for r in warm) / max(len(warm), 1),
    }


async def replay(
    traces: Sequence[Path],
    base_url: str,
    direct_url: str | None = None,
    *,
    model: str = "default",
    api_key: str | None = None,
    metrics_url: str | None = None,
    gap_s: float = 0.5,
    warmup: bool = True,
    out: Any = sys.stdout,
) -> dict[str, dict[str, dict[str, float]]]:
    """Replay every trace in every mode; returns {trace: {mode: totals}} and prints the tables."""
    modes = [("proxy", base_url)] + ([("proxy+warmup", base_url)] if warmup else [])
    if direct_url:
        modes.append(("direct", direct_url))
    metrics_url = metrics_url or direct_url
    summary: dict[str, dict[str, dict[str, float]]] = {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    # the pool lets idle connections go before vLLM's server does (proxy.upstream.KEEPALIVE_S)
    connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        for path in traces:
            events = load_trace(Path(path))
            for mode, url in modes:
                key = api_key if mode != "direct" else None
                rep = Replayer(http, url=url, mode=mode, model=model, api_key=key, metrics_url=metrics_url, gap_s=gap_s)
                results = await rep.run(events)
                print(_table(mode, Path(path).name, results), file=out)
                summary.setdefault(Path(path).name, {})[mode] = _totals(results)
    print(_summary(summary), file=out)
    return summary


def _summary(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        "\n== totals over turns 2+ (compactions excluded from 'seen')",
        f"{'trace':<22} {'mode':<13} {'prompt':>8} {'cached':>8} {'seen':>8} {'diverged':>8} {'reprefill':>9}"
        f" {'ttft ms':>8}",
    ]
    for trace, modes in summary.items():
        for mode, t in modes.items():
            lines.append(
                f"{trace[:22]:<22} {mode:<13} {t['prompt']:>8.0f} {t['cached']:>8.0f} {t['seen']:>8.0f} "
                f"{t['diverged']:>8.0f} {t['reprefilled']:>9.0f} {t['ttft_ms']:>8.1f}"
            )
        if "direct" in modes and "proxy" in modes and modes["proxy"]["reprefilled"]:
            d, p = modes["direct"], modes["proxy"]
            lines.append(
                f"{'':<22} direct/proxy re-prefilled {d['reprefilled'] / p['reprefilled']:.2f}x, "
                f"TTFT {d['ttft_ms'] / max(p['ttft_ms'], 1e-9):.2f}x"
            )
    return "\n".join(lines)


def bundled_traces() -> list[Path]:
    return sorted(TRACES_DIR.glob("*.jsonl"))


def replay_command(
    traces: list[Path],
    base_url: str,
    direct_url: str | None = None,
    model: str = "default",
    api_key: str | None = None,
    metrics_url: str | None = None,
    gap: float = 0.5,
    warmup: bool = True,
) -> None:
    """Entry point for the CLI (`hyperharness replay`); no TRACE means the three bundled traces."""
    asyncio.run(
        replay(
            traces or bundled_traces(),
            base_url,
            direct_url,
            model=model,
            api_key=api_key,
            metrics_url=metrics_url,
            gap_s=gap,
            warmup=warmup,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m backend.tools.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="*", type=Path)
    p.add_argument("--base-url", required=True)
    p.add_argument("--direct-url")
    p.add_argument("--model", default="default")
    p.add_argument("--api-key")
    p.add_argument("--metrics-url", help="engine base URL for /metrics (default: --direct-url)")
    p.add_argument("--gap", type=float, default=0.5, help="seconds between turns (the harness runs tools)")
    p.add_argument("--no-warmup", action="store_true")
    a = p.parse_args(argv)
    replay_command(a.traces, a.base_url, a.direct_url, a.model, a.api_key, a.metrics_url, a.gap, not a.no_warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
