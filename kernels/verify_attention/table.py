"""bench.py's table, timed in an engine's memory life cycle: every provider of every row is run
once eagerly (and checked against the fp32 reference) before any graph is captured, then every
graph is captured, then all of them are replayed in rounds.

Why not row by row: graphs captured after an allocator event (a row's fp32 reference growing the
cache, an ``empty_cache()`` returning it) read every streaming kernel ~12% slower on the H200, and
the row-by-row table reached that state by its 100K rows (100K T=1 b1 67.9 µs; the same kernel
61.1 µs with every allocation first; NOTES.md, session 10). An engine allocates its buffers, then
captures its graphs, then replays them, which is what this module does. ``per_row=True`` keeps
the old protocol (one row prepared, captured, timed and released at a time) for GPUs without the
memory to hold every row at once.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.verify_attention.bench import (
    HEADER, Problem, before_default, capture, fmt, replay_count, replay_median, row,
)  # fmt: skip

ROUNDS = 3  # replay rounds per graph; a row's time is the median of its per-round medians
BUDGET_S = 0.25  # replay time per graph and round (between 5 and 50 replays), as bench.time_graph


@dataclass
class Entry:
    """One provider on one row: its launch, the bytes it must read, its error, its round times."""

    label: str
    provider: str
    fn: Callable[[], object]
    nbytes: int
    err: float
    times: list[float] = field(default_factory=list)


def providers(prob: Problem, label: str, opts: Any, vllm: Any, before_mod: Any) -> list[Entry]:
    """The row's providers, each run once eagerly (its error against the fp32 reference; SDPA's
    is not measured): vLLM first (the anchor), ours, then what ``opts`` asks for."""
    from kernels.verify_attention import _use_cuda

    p = prob.pool
    cuda = _use_cuda(prob.q, p.k, p.v, prob.out, p.k_scale, p.v_scale)
    fns: list[tuple[str, Callable[[], object]]] = []
    if vllm is not None:
        fns.append(("vllm", prob.vllm(*vllm)))
    fns.append(("ours", prob.ours()))
    if cuda and not opts.no_mma:
        fns.append(("mma-ea506d7", prob.mma()))
    if cuda and before_mod is not None:
        fns.append(("before", before_default(prob, before_mod)))
    if opts.triton:
        fns.append(("triton", prob.triton()))
    out = []
    for name, fn in fns:
        fn()
        out.append(Entry(label, name, fn, prob.int8_bytes, prob.error()))
    if not opts.no_sdpa:
        try:
            fn = prob.sdpa()
            fn()
            out.append(Entry(label, "sdpa-bf16", fn, prob.bf16_bytes, float("nan")))
        except Exception as exc:  # noqa: BLE001 - SDPA may not support a shape; say so
            print(f"{label} sdpa-bf16: {type(exc).__name__}: {str(exc)[:100]}")
    return out


def time_entries(entries: list[Entry], flush: torch.Tensor, rounds: int = ROUNDS, reps: int = 0) -> None:
    """Capture every entry's graph, then `rounds` rounds over all of them, `reps` cold replays per
    graph and round (0: set from one cold replay so that a round spends about BUDGET_S on it)."""
    graphs = [capture(e.fn) for e in entries]
    counts = [reps or replay_count(g, flush, BUDGET_S) for g in graphs]
    for _ in range(rounds):
        for e, g, n in zip(entries, graphs, counts):
            e.times.append(replay_median(g, flush, n))


def report(entries: list[Entry], bw: float, results: list[dict]) -> None:
    """One result row per entry (bench.row; speedups against the same row's vLLM time)."""
    base = {e.label: statistics.median(e.times) for e in entries if e.provider == "vllm"}
    for e in entries:
        r = row(f"{e.label} {e.provider}", statistics.median(e.times), e.nbytes, bw,
                base.get(e.label) if e.provider != "vllm" else None, e.err)
        r["rounds"] = e.times
        results.append(r)
        print(fmt(r), flush=True)


def run_table(
    problems: list[tuple[Problem, str]], opts: Any, vllm: Any, before_mod: Any, flush: torch.Tensor,
    bw: float, results: list[dict], per_row: bool = False,
) -> None:
    """Every (problem, label): providers prepared, graphs captured, rounds timed, rows printed."""
    print(HEADER, flush=True)
    groups = [[pl] for pl in problems] if per_row else [problems]
    for group in groups:
        entries = [e for prob, label in group for e in providers(prob, label, opts, vllm, before_mod)]
        time_entries(entries, flush)
        report(entries, bw, results)
        if per_row:
            del entries
            torch.cuda.empty_cache()
