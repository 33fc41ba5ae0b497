"""Benchmark: split-KV verify attention vs vLLM 0.32.0's unified_attention vs torch SDPA (H200).

    python -m kernels.verify_attention.bench [--quick] [--json PATH] [--triton] [--no-vllm]
        [--no-sdpa] [--before-dir DIR] [--release-memory]
    python -m kernels.verify_attention.bench --goal [--page 1616] [--layers 16] [--rounds 5]

The table: the device's copy bandwidth, then every row's providers run once eagerly (each
checked against the fp32 reference), then every graph captured, then ROUNDS rounds of
CUDA-graph replays with a cold L2 (a 256 MiB buffer is read before every replay); a row's time
is the median of its round medians. Why this order: graphs captured after an allocator event (a
row's fp32 reference growing torch's cache, an ``empty_cache()`` returning it) read every
streaming kernel ~12% slower on the H200 (100K T=1 b1 67.9 vs 61.1 µs; NOTES.md, "Timing"). An
engine allocates its buffers, captures its graphs, then replays them; so does this table.
``--release-memory`` keeps the old row-by-row protocol (one row prepared, captured, timed and
released at a time) for GPUs without the memory to hold every row at once.

``--goal``: the issue's goal rows (100K, T=8 / T=1, batch 1 / 4) in an engine's memory life
cycle: ``--layers`` int8 pools of equal size fill all but ``--reserve-gb`` of the free memory (vLLM
allocates one KV tensor per attention layer at start-up; Qwen3.8-27B has 16 full-attention
layers; ``--page`` 1,616 tokens per block, vLLM's block size for this model with an fp32 GDN state
and 7 draft tokens, or 16), the problems on the middle layer's pool, then the table's protocol
with ``--rounds`` rounds of ``--reps`` replays, the spread over rounds printed beside each row.

Providers:
* ``ours``: kernels.verify_attention's public path (the CUDA kernels on sm_90, else Triton).
* ``vllm``: vLLM 0.32.0's ``unified_attention`` called exactly as ``TritonAttentionImpl.forward``
  calls it for ``int8_per_token_head`` (H200 metadata: seq_threshold_3D = 128 // Hkv,
  16 softmax segments). Its Triton files are read from ``$VLLM_REF_DIR`` (default
  ``.vllm_ref/vllm_ref``: copies of vllm/v1/attention/ops/triton_{unified_attention,
  attention_helpers}.py with their vllm imports shimmed; never committed).
* ``sdpa-bf16``: torch.nn.functional.scaled_dot_product_attention on a dequantized bf16 copy.
* ``triton``: with ``--triton``, the Triton kernel (the CPU/CI path and fallback).
* ``before``: with ``--before-dir``, an earlier commit's ``cuda/`` package (its __init__.py,
  verify_attention.cu and sm90_bulk.cuh, e.g. from ``git show``) loaded as a module of its own,
  its default path timed on the same problem; the summary says whether its output equals ours
  bit for bit.
GB/s counts the bytes each provider must read once (int8 records incl. scales for ours / vLLM,
bf16 K and V for SDPA, plus q and out); % is of the copy bandwidth measured in the same run.
The error column is ||out - ref|| / ||ref|| against the fp32 reference (reference.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.verify_attention import make_int8_kv_cache, naive_verify_attention, verify_attention
from kernels.verify_attention import triton as va_triton
from kernels.verify_attention.reference import Int8KVCache, gather_dequantized

HQ, HKV, D = 24, 4, 256  # Qwen3.8-27B full-attention layers
FLUSH_BYTES = 256 << 20
ROUNDS = 3  # replay rounds per graph; a row's time is the median of its per-round medians
BUDGET_S = 0.25  # replay time per graph and round (between 5 and 50 replays)
# --goal: (context, query tokens per request, requests): the two goal rows, then batch 4.
GOAL_CASES = ((100_000, 8, 1), (100_000, 1, 1), (100_000, 8, 4), (100_000, 1, 4))


# ---- timing harness -------------------------------------------------------------------------


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), median of 20."""
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e-3)
    del a, b
    return 2 * n / statistics.median(times) / 1e9


_SINK: dict[torch.device, torch.Tensor] = {}


def flush_l2(flush: torch.Tensor) -> None:
    """Evict the L2 by reading a 256 MiB buffer (one int64 sum, written to a scalar). A read
    leaves clean lines: a ``flush.zero_()`` left ~60 MB of dirty lines whose write-back the timed
    kernel then paid for (+15 µs on 100K T=1 b1, H200)."""
    sink = _SINK.get(flush.device)
    if sink is None:
        sink = _SINK[flush.device] = torch.empty(1, dtype=torch.int64, device=flush.device)
    torch.sum(flush.view(torch.int64), 0, keepdim=True, out=sink)


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn run once eagerly on a side stream (as torch's capture docs ask), then captured in a
    graph that is replayed once; returns the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_count(graph: torch.cuda.CUDAGraph, flush: torch.Tensor, budget_s: float = BUDGET_S) -> int:
    """Replays (5 to 50) that spend about budget_s on a graph, from one cold replay."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush_l2(flush)
    e0.record()
    graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return int(min(50, max(5, budget_s / max(e0.elapsed_time(e1) * 1e-3, 1e-6))))


def replay_median(graph: torch.cuda.CUDAGraph, flush: torch.Tensor, reps: int) -> float:
    """Median µs of `reps` replays of a captured graph, L2 flushed (by a read) before each."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        flush_l2(flush)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(times)


def time_graph(fn: Callable[[], object], flush: torch.Tensor, budget_s: float = BUDGET_S) -> float:
    """Median µs of CUDA-graph replays of fn, L2 flushed before each (one graph, one round)."""
    graph = capture(fn)
    us = replay_median(graph, flush, replay_count(graph, flush, budget_s))
    del graph
    return us


# ---- problems and providers -----------------------------------------------------------------


def load_vllm_unified_attention() -> tuple[Callable[..., object], object] | None:
    root = Path(os.environ.get("VLLM_REF_DIR", ".vllm_ref/vllm_ref"))
    if not (root / "triton_unified_attention.py").exists():
        return None
    spec = importlib.util.spec_from_file_location(
        "vllm_ref", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    assert spec is not None and spec.loader is not None
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["vllm_ref"] = pkg
    spec.loader.exec_module(pkg)
    from vllm_ref._shim import KVQuantMode  # type: ignore[import-not-found]
    from vllm_ref.triton_unified_attention import unified_attention  # type: ignore[import-not-found]

    return unified_attention, KVQuantMode


def load_before(folder: str) -> Any:
    """An earlier commit's kernels/verify_attention/cuda package as a module of its own: its own
    launcher, source and caches."""
    spec = importlib.util.spec_from_file_location("va_cuda_before", Path(folder) / "__init__.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_pool(tokens: int, page: int, hkv: int, d: int) -> Int8KVCache:
    """A random int8 pool of at least `tokens` slots (random bytes, scales in [0.004, 0.03))."""
    nblk = -(-tokens // page) + 8
    pool = make_int8_kv_cache(nblk, page, hkv, d, "cuda")
    raw = pool.raw.as_strided((pool.raw.untyped_storage().nbytes(),), (1,))
    raw.random_(-128, 128)
    pool.k_scale.uniform_(0.004, 0.03)
    pool.v_scale.uniform_(0.004, 0.03)
    return pool


class Problem:
    """One benchmark shape: B requests of ctx keys, T query tokens each, pages drawn at random
    from the whole pool (as an engine's block tables after some churn)."""

    def __init__(self, pool: Int8KVCache, batch: int, ctx: int, t: int, hq: int, window: int = 0) -> None:
        page = pool.block_size
        nblk = -(-ctx // page)
        perm = torch.randperm(pool.k.shape[0], device="cuda")[: batch * nblk]
        self.block_table = perm.view(batch, nblk).int().contiguous()  # [B, nblk]
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.cu_q = torch.arange(0, batch * t + 1, t, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch * t, hq, pool.head_size, device="cuda").bfloat16()  # [B T, Hq, D]
        self.out = torch.full_like(self.q, float("nan"))
        self.pool, self.batch, self.ctx, self.t, self.window = pool, batch, ctx, t, window
        self.win = (window - 1, 0) if window else (-1, -1)

    def _keys(self) -> int:
        return min(self.ctx, self.window + self.t - 1) if self.window else self.ctx

    @property
    def int8_bytes(self) -> int:
        hkv, d = self.pool.k.shape[2], self.pool.head_size
        return self.batch * self._keys() * hkv * 2 * (d + 4) + 2 * self.q.numel() * 2

    @property
    def bf16_bytes(self) -> int:
        hkv, d = self.pool.k.shape[2], self.pool.head_size
        return self.batch * self._keys() * hkv * 2 * d * 2 + 2 * self.q.numel() * 2

    def ours(self) -> Callable[[], object]:
        """The public default path (kernels.verify_attention.verify_attention)."""
        p = self.pool

        def run() -> object:
            return verify_attention(
                self.q, p.k, p.v, self.out, self.cu_q, self.t, self.seq_lens, self.ctx, None,
                self.win, self.block_table, p.k_scale, p.v_scale,
            )  # fmt: skip

        return run

    def triton(self, **kw: Any) -> Callable[[], object]:
        """The Triton launcher (the CPU/CI path and fallback) with options (num_splits, ...)."""
        p = self.pool

        def run() -> object:
            return va_triton.verify_attention_fwd(
                self.q, p.k, p.v, self.out, self.cu_q, self.t, self.seq_lens, self.ctx,
                1 / math.sqrt(p.head_size), self.window, self.block_table, p.k_scale, p.v_scale, **kw,
            )  # fmt: skip

        return run

    def cuda(self, mod: Any = None, **kw: Any) -> Callable[[], object]:
        """The CUDA launcher (``mod``: another commit's package, load_before) with keywords that
        override the rule's choices (cuda.verify_attention_cuda)."""
        if mod is None:
            from kernels.verify_attention import cuda as mod
        p = self.pool

        def run() -> object:
            return mod.verify_attention_cuda(
                self.q, p.k, self.out, self.cu_q, self.t, self.seq_lens, self.ctx,
                1 / math.sqrt(p.head_size), self.window, self.block_table, **kw,
            )  # fmt: skip

        return run

    def vllm(self, ua: Callable[..., object], kv_quant_enum: Any) -> Callable[[], object]:
        """As TritonAttentionImpl.forward calls it (metadata as the builder makes it on SM90)."""
        p, hq = self.pool, self.q.shape[1]
        hkv = p.k.shape[2]
        threshold = 128 // hkv  # MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
        segs = 16  # NUM_PAR_SOFTMAX_SEGMENTS
        dpad = 1 << (p.head_size - 1).bit_length()
        segm_out = torch.empty(threshold, hq, segs, dpad, dtype=torch.float32, device="cuda")
        segm_max = torch.empty(threshold, hq, segs, dtype=torch.float32, device="cuda")
        segm_sum = torch.empty(threshold, hq, segs, dtype=torch.float32, device="cuda")

        def run() -> object:
            return ua(
                q=self.q, k=p.k, v=p.v, out=self.out, cu_seqlens_q=self.cu_q,
                max_seqlen_q=self.t, seqused_k=self.seq_lens, max_seqlen_k=self.ctx,
                softmax_scale=1 / math.sqrt(p.head_size), causal=True, alibi_slopes=None,
                use_alibi_sqrt=False, window_size=self.win, block_table=self.block_table,
                softcap=0, q_descale=None, k_descale=None, v_descale=None,
                seq_threshold_3D=threshold, num_par_softmax_segments=segs,
                softmax_segm_output=segm_out, softmax_segm_max=segm_max,
                softmax_segm_expsum=segm_sum, sinks=None, output_scale=None,
                mm_prefix_range=None, rswa_prefix_lens=None, rswa_window=None,
                kv_quant_mode=kv_quant_enum.INT8_PER_TOKEN_HEAD, k_scale_cache=p.k_scale, v_scale_cache=p.v_scale,
                chunk_lookback=-1, use_td=False, mm_prefix_clamp_sliding_window=False,
            )  # fmt: skip

        return run

    def sdpa(self) -> Callable[[], object]:
        ks, vs = [], []
        for i in range(self.batch):
            k, v = gather_dequantized(self.pool, self.block_table[i], self.ctx)
            ks.append(k.bfloat16().transpose(0, 1))
            vs.append(v.bfloat16().transpose(0, 1))
        k, v = torch.stack(ks), torch.stack(vs)  # [B, Hkv, L, D]
        q = self.q.view(self.batch, self.t, -1, self.pool.head_size).transpose(1, 2)
        q_pos = torch.arange(self.ctx - self.t, self.ctx, device="cuda")[:, None]
        k_pos = torch.arange(self.ctx, device="cuda")[None, :]
        mask = None if self.t == 1 else (k_pos <= q_pos)

        def run() -> object:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        return run

    def error(self) -> float:
        """||out - ref|| / ||ref|| of the last run (NaN if a row was left unwritten); refills out."""
        ref = naive_verify_attention(self.q, self.pool, self.cu_q, self.seq_lens, self.block_table, window_size=self.win)
        bad = torch.isnan(self.out).any().item()
        err = ((self.out.float() - ref).norm() / ref.norm()).item()
        self.out.fill_(float("nan"))
        return float("nan") if bad else err


# ---- the table protocol ---------------------------------------------------------------------


@dataclass
class Entry:
    """One provider on one row: its launch, the bytes it must read, its error, its round times."""

    label: str
    provider: str
    fn: Callable[[], object]
    nbytes: int
    err: float
    times: list[float] = field(default_factory=list)
    same_bits: bool | None = None  # "before" only: its output equals ours bit for bit


def providers(prob: Problem, label: str, opts: Any, vllm: Any, before_mod: Any) -> list[Entry]:
    """The row's providers, each run once eagerly (its error against the fp32 reference; SDPA's
    is not measured): vLLM first (the anchor), ours, then what ``opts`` asks for."""
    from kernels.verify_attention import _use_cuda

    p = prob.pool
    fns: list[tuple[str, Callable[[], object]]] = []
    if vllm is not None:
        fns.append(("vllm", prob.vllm(*vllm)))
    fns.append(("ours", prob.ours()))
    if before_mod is not None and _use_cuda(prob.q, p.k, p.v, prob.out, p.k_scale, p.v_scale):
        fns.append(("before", prob.cuda(before_mod)))
    if opts.triton:
        fns.append(("triton", prob.triton()))
    out, ours_out = [], None
    for name, fn in fns:
        fn()
        same = None
        if name == "ours":
            ours_out = prob.out.clone()
        elif name == "before":
            same = bool(torch.equal(prob.out, ours_out))
        out.append(Entry(label, name, fn, prob.int8_bytes, prob.error(), same_bits=same))
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
    counts = [reps or replay_count(g, flush) for g in graphs]
    for _ in range(rounds):
        for e, g, n in zip(entries, graphs, counts, strict=True):
            e.times.append(replay_median(g, flush, n))


def row(label: str, us: float, nbytes: int, bw: float, base: float | None, err: float) -> dict:
    gbs = nbytes / us / 1e3
    r = {"case": label, "us": us, "GBps": gbs, "pct_copy": 100 * gbs / bw, "err": err}
    if base is not None:
        r["speedup_vs_vllm"] = base / us
    return r


HEADER = f"{'case':<40} {'us':>10} {'GB/s':>8} {'%copy':>7} {'vs vllm':>9} err"


def fmt(r: dict) -> str:
    sp = f"{r['speedup_vs_vllm']:8.1f}x" if "speedup_vs_vllm" in r else " " * 9
    err = f"{r['err']:.1e}" if r["err"] == r["err"] else "   -   "
    return f"{r['case']:<40} {r['us']:10.1f} {r['GBps']:8.0f} {r['pct_copy']:6.1f}% {sp} {err}"


def report(entries: list[Entry], bw: float, results: list[dict]) -> None:
    """One result row per entry (speedups against the same row's vLLM time)."""
    base = {e.label: statistics.median(e.times) for e in entries if e.provider == "vllm"}
    for e in entries:
        r = row(f"{e.label} {e.provider}", statistics.median(e.times), e.nbytes, bw,
                base.get(e.label) if e.provider != "vllm" else None, e.err)  # fmt: skip
        r["rounds"] = e.times
        if e.same_bits is not None:
            r["same_bits"] = e.same_bits
        results.append(r)
        print(fmt(r), flush=True)


def run_table(
    problems: list[tuple[Problem, str]], opts: Any, vllm: Any, before_mod: Any, flush: torch.Tensor,
    bw: float, results: list[dict], per_row: bool = False, rounds: int = ROUNDS, reps: int = 0,
) -> None:
    """Every (problem, label): providers prepared, graphs captured, rounds timed, rows printed."""
    print(HEADER, flush=True)
    for group in [[pl] for pl in problems] if per_row else [problems]:
        entries = [e for prob, label in group for e in providers(prob, label, opts, vllm, before_mod)]
        time_entries(entries, flush, rounds, reps)
        report(entries, bw, results)
        if per_row:
            del entries
            torch.cuda.empty_cache()


def summary(results: list[dict]) -> None:
    """Side by side per case: vLLM, the earlier commit (``before``), ours; ratios from this run."""
    cases: dict[str, dict[str, dict]] = {}
    for r in results:
        if "us" in r:
            case, _, prov = r["case"].rpartition(" ")
            cases.setdefault(case, {})[prov] = r
    print(f"\n{'case':<40} {'vllm us':>9} {'bef us':>8} {'ours us':>8} {'rounds':>13} {'ours %':>7} "
          f"{'bef/ours':>8} {'vllm/ours':>9} {'bits':>5}  err ours / vllm")  # fmt: skip
    for case, d in cases.items():
        o, v, bf = d.get("ours"), d.get("vllm"), d.get("before")
        if o is None:
            continue
        ratio = lambda x: f"{x['us'] / o['us']:.2f}x" if x else "-"  # noqa: E731
        bits = "-" if bf is None else ("same" if bf.get("same_bits") else "DIFF")
        print(f"{case:<40} {v['us'] if v else float('nan'):9.1f} {bf['us'] if bf else float('nan'):8.1f} "
              f"{o['us']:8.1f} {min(o['rounds']):6.1f}-{max(o['rounds']):<6.1f} {o['pct_copy']:6.1f}% "
              f"{ratio(bf):>8} {ratio(v):>9} {bits:>5}  {o['err']:.1e} / {v['err'] if v else float('nan'):.1e}")


# ---- --goal: the goal rows in an engine's memory life cycle ---------------------------------


def record_bytes(hkv: int, d: int) -> int:
    """Bytes of one token in a layer's pool: per KV head K int8 x D, its fp32 scale, V, its scale."""
    return hkv * 2 * (d + 4)


def layer_tokens(free_bytes: int, layers: int, reserve_bytes: int, hkv: int, d: int) -> int:
    """Tokens per layer pool when `layers` equal pools fill all but `reserve_bytes` of free memory.
    A pool must hold 4x the largest case's keys (the table's pools do too): the problems draw
    their pages at random from the whole pool, as an engine's block tables do after some churn."""
    tokens = (free_bytes - reserve_bytes) // layers // record_bytes(hkv, d)
    if tokens < 4 * max(c[0] * c[2] for c in GOAL_CASES):
        raise ValueError(f"{layers} pools in {free_bytes / 1e9:.1f} GB leave {tokens} tokens per layer: "
                         "too few for the goal rows (lower --layers or --reserve-gb)")
    return tokens


def goal_problems(layers: int, page: int, reserve_bytes: int) -> tuple[list[Int8KVCache], list[tuple[Problem, str]]]:
    """The layer pools (all kept alive: they are the engine's memory) and the goal rows' problems
    on the middle one."""
    free, _ = torch.cuda.mem_get_info()
    tokens = layer_tokens(free, layers, reserve_bytes, HKV, D)
    pools = [make_pool(tokens, page, HKV, D) for _ in range(layers)]
    pool = pools[len(pools) // 2]
    print(f"{layers} layer pools of {pool.raw.untyped_storage().nbytes() / 1e9:.2f} GB (page {page}); "
          f"the problems on layer {len(pools) // 2}", flush=True)
    return pools, [(Problem(pool, b, ctx, t, HQ), f"ctx={ctx} T={t} b={b} page={page}") for ctx, t, b in GOAL_CASES]


def table_problems(quick: bool) -> list[tuple[Problem, str]]:
    """The table's rows: 8K-200K x T 1 / 8 / 16 x batch 1 / 4 on a page-16 pool (the anchor, 100K
    T=8 b1, first: issue 6 measured vLLM at 11,524 µs there), page 1,616 at 100K, and the DFlash2
    drafter's sliding-window layers (8 KV heads x 128, window 2,048)."""
    contexts = [100_000] if quick else [8_192, 32_768, 100_000, 200_000]
    pool = make_pool(4 * max(contexts) + 64, 16, HKV, D)
    cases = sorted(((ctx, t, b) for ctx in contexts for t in (1, 8, 16) for b in (1, 4)), key=lambda c: c != (100_000, 8, 1))
    problems = [(Problem(pool, b, ctx, t, HQ), f"ctx={ctx} T={t} b={b}") for ctx, t, b in cases]
    p1616 = make_pool(100_000 + 4096, 1616, HKV, D)
    problems += [(Problem(p1616, 1, 100_000, t, HQ), f"page=1616 ctx=100000 T={t} b=1") for t in (1, 8)]
    swa = make_pool(4 * 100_000 + 64, 16, 8, 128)
    problems += [(Problem(swa, b, 100_000, t, 32, 2048), f"swa 8x128 w=2048 ctx=100000 T={t} b={b}")
                 for t in (1, 8) for b in (1, 4)]  # fmt: skip
    return problems


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the table's 100K rows only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--triton", action="store_true", help="also time the Triton kernel (the fallback)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's kernel")
    ap.add_argument("--no-sdpa", action="store_true", help="skip torch SDPA (bf16 copy of the cache)")
    ap.add_argument("--before-dir", default=None,
                    help="an earlier commit's cuda/ package (__init__.py, verify_attention.cu, sm90_bulk.cuh): "
                         "its default path is timed as 'before' beside ours")  # fmt: skip
    ap.add_argument("--release-memory", action="store_true",
                    help="prepare, capture and time one row at a time, emptying torch's CUDA cache after each "
                         "(small GPUs; graphs captured after that read slower)")  # fmt: skip
    ap.add_argument("--goal", action="store_true", help="the goal rows in an engine's memory life cycle")
    ap.add_argument("--page", type=int, default=1616, help="--goal: tokens per block (vLLM's for this model)")
    ap.add_argument("--layers", type=int, default=16, help="--goal: per-layer pools filling the GPU")
    ap.add_argument("--reserve-gb", type=float, default=10.0, help="--goal: memory left free")
    ap.add_argument("--rounds", type=int, default=None, help=f"replay rounds (default {ROUNDS}; --goal 5)")
    ap.add_argument("--reps", type=int, default=None, help="replays per graph and round (default by budget; --goal 30)")
    args = ap.parse_args()

    torch.manual_seed(0)
    bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"device {dev}; copy bandwidth {bw:.0f} GB/s (read + write, 2 GiB buffer)", flush=True)
    results: list[dict] = [{"case": "copy", "GBps": bw, "device": dev}]
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    vllm = None if args.no_vllm else load_vllm_unified_attention()
    if vllm is None and not args.no_vllm:
        print("vLLM reference files not found: set VLLM_REF_DIR (see the module docstring); vllm column skipped")
    before_mod = load_before(args.before_dir) if args.before_dir else None
    if args.goal:
        args.no_sdpa = True
        # the pools stay referenced until the end: they are the engine's memory
        pools, problems = goal_problems(args.layers, args.page, int(args.reserve_gb * 2**30))
        rounds, reps = args.rounds or 5, args.reps if args.reps is not None else 30
    else:
        problems = table_problems(args.quick)
        rounds, reps = args.rounds or ROUNDS, args.reps or 0
    run_table(problems, args, vllm, before_mod, flush, bw, results, args.release_memory, rounds, reps)
    summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
