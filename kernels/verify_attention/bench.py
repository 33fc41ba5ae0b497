"""Benchmark: split-KV verify attention vs vLLM 0.32.0's unified_attention vs torch SDPA (H200).

    python -m kernels.verify_attention.bench [--sweep] [--json PATH] [--quick] [--triton] [--no-vllm]
        [--no-sdpa] [--no-mma] [--fixed-cost] [--before-dir DIR] [--node-costs[-only]] [--ceiling-only]
        [--combine-costs[-only]] [--loop-modes] [--release-memory]

The diagnostic modes (--sweep, --fixed-cost, --node-costs, --ceiling-only, --profile-one) live in
diag.py, --combine-costs and --loop-modes in diag_combine.py; they share this file's harness.
The table (table.py) prepares every provider of every row before it captures any graph, then
replays all graphs in rounds, as an engine allocates, captures and replays; goal.py times the
goal rows again with per-layer pools filling the GPU.
Measures the device's copy bandwidth first, then times every provider with CUDA-graph replay
and a cold L2 (a 256 MiB buffer is read before every replay), median of the replays.
Providers:
* ``ours``: kernels.verify_attention on the int8 per-token-head cache (the CUDA kernel on sm_90:
  the wgmma split kernel by default).
* ``mma``: the CUDA mma.sync split kernel of commit ea506d7 (same launcher, same split rule), so
  every run prints the before/after of the wgmma kernel side by side (``--no-mma`` skips it).
* ``triton``: the Triton kernel (CPU/CI path and fallback), with ``--triton``.
* ``vllm``: vLLM 0.32.0's ``unified_attention`` called exactly as ``TritonAttentionImpl.forward``
  calls it for ``int8_per_token_head`` (H200 metadata: seq_threshold_3D = 128 // Hkv,
  16 softmax segments). Its Triton files are read from ``$VLLM_REF_DIR`` (default
  ``.vllm_ref/vllm_ref``: copies of vllm/v1/attention/ops/triton_{unified_attention,
  attention_helpers}.py with their vllm imports shimmed; never committed).
* ``sdpa``: torch.nn.functional.scaled_dot_product_attention on a dequantized bf16 copy.
* ``before``: with ``--before-dir``, the previous commit's ``cuda/`` package (its launcher and .cu)
  loaded as a module of its own; its default path, timed on the same problem.
GB/s counts the bytes each provider must read once (int8 records incl. scales for ours/vllm,
bf16 K and V for sdpa, plus q and out); % is of the copy bandwidth measured in the same run.
The error column is ||out - ref|| / ||ref|| against the fp32 reference (reference.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
from collections.abc import Callable
from typing import Any
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.verify_attention import make_int8_kv_cache, naive_verify_attention, verify_attention
from kernels.verify_attention import triton as va_triton
from kernels.verify_attention.reference import Int8KVCache, gather_dequantized

HQ, HKV, D = 24, 4, 256  # Qwen3.8-27B full-attention layers
FLUSH_BYTES = 256 << 20


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


def flush_l2(flush: torch.Tensor) -> None:
    """Evict the L2 by reading a 256 MiB buffer (one int64 sum, written to a scalar).

    A read leaves clean lines: the earlier ``flush.zero_()`` left ~60 MB of dirty lines whose
    write-back the timed kernel then paid for (+15 µs on 100K T=1 b1, H200; NOTES.md)."""
    sink = _SINK.get(flush.device)
    if sink is None:
        sink = _SINK[flush.device] = torch.empty(1, dtype=torch.int64, device=flush.device)
    torch.sum(flush.view(torch.int64), 0, keepdim=True, out=sink)


_SINK: dict[torch.device, torch.Tensor] = {}


def capture(fn: Callable[[], object], warm_on_side_stream: bool = True) -> torch.cuda.CUDAGraph:
    """fn run once eagerly (on a side stream, as torch's capture docs ask), then captured in a
    graph that is replayed once; returns the graph."""
    if warm_on_side_stream:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
    else:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(fn: Callable[[], object], flush: torch.Tensor, budget_s: float = 0.25) -> float:
    """Median µs of CUDA-graph replays of fn, L2 flushed (by a read, flush_l2) before each."""
    graph = capture(fn)
    us = replay_median(graph, flush, replay_count(graph, flush, budget_s))
    del graph
    return us


def replay_count(graph: torch.cuda.CUDAGraph, flush: torch.Tensor, budget_s: float = 0.25) -> int:
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


def load_vllm_unified_attention() -> tuple[Callable[..., object], object] | None:
    root = Path(os.environ.get("VLLM_REF_DIR", ".vllm_ref/vllm_ref"))
    if not (root / "triton_unified_attention.py").exists():
        return None
    spec = importlib.util.spec_from_file_location(
        "vllm_ref", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    assert spec is not None and spec.loader is not None
    pkg = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["vllm_ref"] = pkg
    spec.loader.exec_module(pkg)
    from vllm_ref._shim import KVQuantMode  # type: ignore[import-not-found]
    from vllm_ref.triton_unified_attention import (  # type: ignore[import-not-found]
        unified_attention,
    )

    return unified_attention, KVQuantMode


class Problem:
    """One benchmark shape: B requests of ctx keys, T query tokens each, random paged cache."""

    def __init__(
        self, pool: Int8KVCache, batch: int, ctx: int, t: int, hq: int, window: int = 0
    ) -> None:
        page = pool.block_size
        nblk = -(-ctx // page)
        perm = torch.randperm(pool.k.shape[0], device="cuda")[: batch * nblk]
        self.block_table = perm.view(batch, nblk).int().contiguous()
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.cu_q = torch.arange(0, batch * t + 1, t, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch * t, hq, pool.head_size, device="cuda").bfloat16()
        self.out = torch.full_like(self.q, float("nan"))
        self.pool, self.batch, self.ctx, self.t, self.window = pool, batch, ctx, t, window
        self.win = (window - 1, 0) if window else (-1, -1)

    @property
    def int8_bytes(self) -> int:
        hkv, d = self.pool.k.shape[2], self.pool.head_size
        keys = min(self.ctx, self.window + self.t - 1) if self.window else self.ctx
        return self.batch * keys * hkv * 2 * (d + 4) + 2 * self.q.numel() * 2

    @property
    def bf16_bytes(self) -> int:
        hkv, d = self.pool.k.shape[2], self.pool.head_size
        keys = min(self.ctx, self.window + self.t - 1) if self.window else self.ctx
        return self.batch * keys * hkv * 2 * d * 2 + 2 * self.q.numel() * 2

    def ours(self, **kw: object) -> Callable[[], object]:
        p = self.pool

        def run() -> object:
            if kw:
                return va_triton.verify_attention_fwd(
                    self.q, p.k, p.v, self.out, self.cu_q, self.t, self.seq_lens, self.ctx,
                    1 / math.sqrt(p.head_size), self.window, self.block_table,
                    p.k_scale, p.v_scale, **kw,  # type: ignore[arg-type]
                )  # fmt: skip
            return verify_attention(
                self.q, p.k, p.v, self.out, self.cu_q, self.t, self.seq_lens, self.ctx, None,
                self.win, self.block_table, p.k_scale, p.v_scale,
            )  # fmt: skip

        return run

    def mma(self) -> Callable[[], object]:
        """The mma.sync CUDA kernel (ea506d7's), default launch."""
        from kernels.verify_attention.cuda import verify_attention_cuda

        p = self.pool

        def run() -> object:
            return verify_attention_cuda(
                self.q, p.k, self.out, self.cu_q, self.t, self.seq_lens, self.ctx,
                1 / math.sqrt(p.head_size), self.window, self.block_table, kernel="mma",
            )  # fmt: skip

        return run

    def cuda_variant(self, **kw: Any) -> Callable[[], object]:
        """The wgmma CUDA kernel with launcher options (sched, pdl, num_splits, combine)."""
        from kernels.verify_attention.cuda import verify_attention_cuda

        p = self.pool

        def run() -> object:
            return verify_attention_cuda(
                self.q, p.k, self.out, self.cu_q, self.t, self.seq_lens, self.ctx,
                1 / math.sqrt(p.head_size), self.window, self.block_table, kernel="wgmma", **kw,
            )  # fmt: skip

        return run

    def triton(self) -> Callable[[], object]:
        """The Triton kernel (the CPU/CI path and the fallback), default launch."""
        p = self.pool

        def run() -> object:
            return va_triton.verify_attention_fwd(
                self.q, p.k, p.v, self.out, self.cu_q, self.t, self.seq_lens, self.ctx,
                1 / math.sqrt(p.head_size), self.window, self.block_table, p.k_scale, p.v_scale,
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
        ref = naive_verify_attention(
            self.q, self.pool, self.cu_q, self.seq_lens, self.block_table, window_size=self.win
        )
        bad = torch.isnan(self.out).any().item()
        err = ((self.out.float() - ref).norm() / ref.norm()).item()
        self.out.fill_(float("nan"))
        return float("nan") if bad else err


def make_pool(tokens: int, page: int, hkv: int, d: int) -> Int8KVCache:
    nblk = -(-tokens // page) + 8
    pool = make_int8_kv_cache(nblk, page, hkv, d, "cuda")
    raw = pool.raw.as_strided((pool.raw.untyped_storage().nbytes(),), (1,))
    raw.random_(-128, 128)
    pool.k_scale.uniform_(0.004, 0.03)
    pool.v_scale.uniform_(0.004, 0.03)
    return pool


def row(label: str, us: float, nbytes: int, bw: float, base: float | None, err: float) -> dict:
    gbs = nbytes / us / 1e3
    r = {"case": label, "us": us, "GBps": gbs, "pct_copy": 100 * gbs / bw, "err": err}
    if base is not None:
        r["speedup_vs_vllm"] = base / us
    return r


def fmt(r: dict) -> str:
    sp = f"{r['speedup_vs_vllm']:8.1f}x" if "speedup_vs_vllm" in r else " " * 9
    err = f"{r['err']:.1e}" if r["err"] == r["err"] else "   -   "
    return (
        f"{r['case']:<40} {r['us']:10.1f} {r['GBps']:8.0f} {r['pct_copy']:6.1f}% {sp} {err}"
    )


HEADER = f"{'case':<40} {'us':>10} {'GB/s':>8} {'%copy':>7} {'vs vllm':>9} err"


def summary(results: list[dict]) -> None:
    """Side by side per case: vLLM, the mma kernel (ea506d7), the previous commit's default path
    (``before``), ours; ratios from this run."""
    cases: dict[str, dict[str, dict]] = {}
    for r in results:
        if "us" not in r:
            continue
        case, _, prov = r["case"].rpartition(" ")
        cases.setdefault(case, {})[prov] = r
    print(f"\n{'case':<40} {'vllm us':>9} {'mma us':>8} {'bef us':>8} {'ours us':>8} {'ours %':>7} "
          f"{'bef %':>6} {'mma/ours':>8} {'bef/ours':>8} {'vllm/ours':>9} err ours/bef/vllm")  # fmt: skip
    for case, d in cases.items():
        if "ours" not in d:
            continue
        o, m, v, bf = d["ours"], d.get("mma-ea506d7"), d.get("vllm"), d.get("before")
        cell = lambda x, k, f: format(x[k], f) if x else "-"  # noqa: E731
        ratio = lambda x: f"{x['us'] / o['us']:.2f}x" if x else "-"  # noqa: E731
        errs = "/".join(f"{x['err']:.1e}" if x else "-" for x in (o, bf, v))
        print(f"{case:<40} {cell(v, 'us', '9.1f'):>9} {cell(m, 'us', '8.1f'):>8} {cell(bf, 'us', '8.1f'):>8} "
              f"{o['us']:8.1f} {o['pct_copy']:6.1f}% {cell(bf, 'pct_copy', '5.1f'):>6} {ratio(m):>8} "
              f"{ratio(bf):>8} {ratio(v):>9} {errs}")  # fmt: skip


def load_before(folder: str) -> Any:
    """The previous commit's kernels/verify_attention/cuda package (its __init__.py and .cu, e.g.
    from ``git show 86a6d8f:...``) as a module of its own: its own launcher, source and caches."""
    spec = importlib.util.spec_from_file_location("va_cuda_before", Path(folder) / "__init__.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def before_default(prob: Problem, mod: Any) -> Callable[[], object]:
    """The previous commit's default CUDA path on this problem (its own split rule and combine)."""
    p = prob.pool

    def run() -> object:
        return mod.verify_attention_cuda(
            prob.q, p.k, prob.out, prob.cu_q, prob.t, prob.seq_lens, prob.ctx,
            1 / math.sqrt(p.head_size), prob.window, prob.block_table,
        )  # fmt: skip

    return run


def main() -> None:
    from kernels.verify_attention.diag import (
        decode_costs, fixed_cost, node_costs, profile_one, stream_ceiling, sweep,
    )  # fmt: skip

    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="launch-parameter sweep at 100K")
    ap.add_argument("--quick", action="store_true", help="100K only")
    ap.add_argument("--sweep-only", action="store_true", help="stop after the sweep")
    ap.add_argument("--json", default=None)
    ap.add_argument("--release-memory", action="store_true",
                    help="prepare, capture and time one row at a time, emptying torch's CUDA cache after "
                         "each (small GPUs; graphs captured after that read slower: table.py)")
    ap.add_argument("--triton", action="store_true", help="also time the Triton kernel (the fallback)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's kernel (slow at long T>1)")
    ap.add_argument("--no-sdpa", action="store_true", help="skip torch SDPA (bf16 copy of the cache)")
    ap.add_argument("--no-mma", action="store_true", help="skip the mma.sync kernel (ea506d7)")
    ap.add_argument("--profile-one", type=int, default=0, help="one launch at 100K, T=this")
    ap.add_argument("--fixed-cost", action="store_true", help="scheduling/combine variants at 100K")
    ap.add_argument("--fixed-cost-only", action="store_true", help="stop after --fixed-cost")
    ap.add_argument("--node-costs", action="store_true",
                    help="fixed cost per pool size (100K b1, T=1/8): nodes, candidates, ceiling probe")
    ap.add_argument("--node-costs-only", action="store_true", help="stop after --node-costs")  # fmt: skip
    ap.add_argument("--combine-costs", action="store_true",
                    help="the combine node at 100K b1 (T=1/8): variants, workspace, stamps (diag_combine.py)")
    ap.add_argument("--combine-costs-only", action="store_true", help="stop after --combine-costs")
    ap.add_argument("--loop-modes", action="store_true",
                    help="default / split / stamped graphs in three host loops, then stop (diag_combine.py)")
    ap.add_argument("--decode-costs", action="store_true",
                    help="T=1: the decode kernel vs the wgmma split kernel (50K-200K b1, 100K b4), then stop")
    ap.add_argument("--ceiling-only", action="store_true",
                    help="pure-read ceiling probes at 100K b1 (ceiling_stream.py), then stop")  # fmt: skip
    ap.add_argument("--before-src", default=None, help="the .cu of commit 1344eca, timed as 'before-1344eca'")
    ap.add_argument("--before-dir", default=None,
                    help="a folder with the previous commit's cuda/__init__.py and verify_attention.cu "
                         "(and sm90_bulk.cuh where that commit has one): "
                         "its default path is timed as 'before' beside ours")  # fmt: skip
    args = ap.parse_args()
    if args.profile_one:
        profile_one(args.profile_one)
        return
    torch.manual_seed(0)
    results: list[dict] = []
    bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"device {dev}; copy bandwidth {bw:.0f} GB/s (read + write, 2 GiB buffer)", flush=True)
    results.append({"case": "copy", "GBps": bw, "device": dev})
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    vllm = None if args.no_vllm else load_vllm_unified_attention()
    if vllm is None and not args.no_vllm:
        print("vLLM reference files not found: set VLLM_REF_DIR (see module docstring)")

    before_mod = load_before(args.before_dir) if args.before_dir else None
    if args.decode_costs:
        decode_costs(flush, bw, results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    if args.ceiling_only:
        stream_ceiling(flush, bw, results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    if args.loop_modes:
        from kernels.verify_attention.diag_combine import loop_modes

        loop_modes(flush, bw, results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    if args.combine_costs or args.combine_costs_only:
        from kernels.verify_attention.diag_combine import combine_costs

        combine_costs(flush, bw, results)
        if args.combine_costs_only:
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
            return
    if args.node_costs or args.node_costs_only:
        node_costs(flush, bw, results, before_mod)
        if args.node_costs_only:
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
            return
    if args.fixed_cost or args.fixed_cost_only:
        before = Path(args.before_src).read_text() if args.before_src else None
        fixed_cost(flush, bw, results, before, before_mod)
        if args.fixed_cost_only:
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
            return

    contexts = [100_000] if args.quick else [8_192, 32_768, 100_000, 200_000]
    pool = make_pool(4 * max(contexts) + 64, 16, HKV, D)
    if args.sweep:
        sweep(pool, flush, bw, results)
        if args.sweep_only:
            return

    # The anchor first: vLLM at 100K, T=8, batch 1 (issue 6 measured 11,524 µs). Then page size
    # 1,616 (fp32 GDN state, 7 draft tokens) and the drafter's sliding-window layers. Every pool
    # and problem exists before the first capture (table.py says why).
    cases = [(ctx, t, b) for ctx in contexts for t in (1, 8, 16) for b in (1, 4)]
    cases.sort(key=lambda c: c != (100_000, 8, 1))
    problems = [(Problem(pool, b, ctx, t, HQ), f"ctx={ctx} T={t} b={b}") for ctx, t, b in cases]
    p1616 = make_pool(100_000 + 4096, 1616, HKV, D)
    problems += [(Problem(p1616, 1, 100_000, t, HQ), f"page=1616 ctx=100000 T={t} b=1") for t in (1, 8)]
    swa = make_pool(4 * 100_000 + 64, 16, 8, 128)
    problems += [
        (Problem(swa, b, 100_000, t, 32, 2048), f"swa 8x128 w=2048 ctx=100000 T={t} b={b}")
        for t in (1, 8)
        for b in (1, 4)
    ]
    from kernels.verify_attention.table import run_table

    run_table(problems, args, vllm, before_mod, flush, bw, results, per_row=args.release_memory)

    summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
