"""Benchmark: split-KV verify attention vs vLLM 0.32.0's unified_attention vs torch SDPA (H200).

    python -m kernels.verify_attention.bench [--sweep] [--json PATH] [--quick] [--triton] [--no-vllm]
        [--no-sdpa] [--no-mma] [--fixed-cost] [--before-dir DIR] [--node-costs[-only]] [--ceiling-only]

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


def time_graph(fn: Callable[[], object], flush: torch.Tensor, budget_s: float = 0.25) -> float:
    """Median µs of CUDA-graph replays of fn, L2 flushed (by a read, flush_l2) before each."""
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
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush_l2(flush)
    e0.record()
    graph.replay()
    e1.record()
    torch.cuda.synchronize()
    reps = int(min(50, max(5, budget_s / max(e0.elapsed_time(e1) * 1e-3, 1e-6))))
    times = []
    for _ in range(reps):
        flush_l2(flush)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    del graph
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


def sweep(pool: Int8KVCache, flush: torch.Tensor, bw: float, out: list) -> None:
    """Variants at 100K, batch 1: read windows on/off, launch parameters, combine alone."""
    variants: dict[int, list[dict]] = {
        1: [{}, {"block_n": 32, "num_warps": 4, "num_stages": 3}],
        8: [{}, {"block_n": 16, "num_warps": 4, "num_stages": 1},
            {"block_n": 16, "num_warps": 4, "num_stages": 2}],
        16: [{}, {"block_n": 16, "num_warps": 8, "num_stages": 2}],
    }  # fmt: skip
    for t, kws in variants.items():
        prob = Problem(pool, 1, 100_000, t, HQ)
        for kw in kws:
            try:
                us = time_graph(prob.ours(**kw), flush)
            except Exception as exc:  # noqa: BLE001 - report and go on (e.g. out of smem)
                print(f"T={t} {kw}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            r = row(f"variant T={t} {kw}", us, prob.int8_bytes, bw, None, 0.0)
            out.append(r)
            print(fmt(r), flush=True)
        splits = va_triton.default_num_splits(1, HKV, 1, 100_000, torch.device("cuda"))
        n = t
        acc = torch.randn(n, HQ, splits, D, device="cuda")
        ml = torch.randn(n, HQ, splits, 2, device="cuda").abs()
        o = torch.empty(n, HQ, D, device="cuda", dtype=torch.bfloat16)

        def combine() -> None:
            va_triton.verify_attention_combine_kernel[(n, HQ, D // 64)](
                o, acc, ml, splits, o.stride(0), o.stride(1), D=D,
                BLOCK_S=triton_next_pow2(splits), CHUNK_S=64, BLOCK_D=64, num_warps=4,
            )  # fmt: skip

        r = row(f"combine alone T={t} splits={splits}", time_graph(combine, flush),
                2 * acc.numel() * 4, bw, None, 0.0)  # fmt: skip
        out.append(r)
        print(fmt(r), flush=True)


def time_mma(
    prob: Problem, label: str, flush: torch.Tensor, bw: float, base: float | None,
    results: list, args: argparse.Namespace,
) -> None:
    """The mma.sync kernel (ea506d7) on the same problem, when the CUDA path serves it."""
    from kernels.verify_attention import _use_cuda

    p = prob.pool
    if args.no_mma or not _use_cuda(prob.q, p.k, p.v, prob.out, p.k_scale, p.v_scale):
        return
    fn = prob.mma()
    fn()
    err = prob.error()
    r = row(f"{label} mma-ea506d7", time_graph(fn, flush), prob.int8_bytes, bw, base, err)
    results.append(r)
    print(fmt(r), flush=True)


def time_before(
    prob: Problem, label: str, flush: torch.Tensor, bw: float, base: float | None,
    results: list, before_mod: Any,
) -> None:
    """The previous commit's default CUDA path (``--before-dir``) on the same problem."""
    from kernels.verify_attention import _use_cuda

    p = prob.pool
    if before_mod is None or not _use_cuda(prob.q, p.k, p.v, prob.out, p.k_scale, p.v_scale):
        return
    fn = before_default(prob, before_mod)
    fn()
    err = prob.error()
    r = row(f"{label} before", time_graph(fn, flush), prob.int8_bytes, bw, base, err)
    results.append(r)
    print(fmt(r), flush=True)


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


def before_call(prob: Problem, source: str) -> Callable[[], object]:
    """The wgmma kernel of commit 1344eca (its .cu text in ``source``), launched as 1344eca's
    launcher did: static splits (same rule), separate combine launch."""
    from kernels.verify_attention import cuda as vc

    p = prob.pool
    d, hkv = p.head_size, p.k.shape[2]
    group = prob.q.shape[1] // hkv
    block_q, n_qt, _, n8 = vc._tile(group, prob.t)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = vc.num_splits_for(prob.batch, hkv, n_qt, prob.ctx, sms)
    stages = vc.pick_stages(d, n8, vc.smem_bytes_wg)
    smem = vc.smem_bytes_wg(d, n8, stages) - 32  # 1344eca had no tile index ring
    split_k = vc._compiled(f"verify_attn_split_wg<{d}, {n8}, {stages}, true>", smem, source)
    comb_k = vc._compiled(f"verify_attn_combine<{d}, true>", 0, source)
    q, out, k = prob.q, prob.out, p.k
    n, hq = q.shape[0], q.shape[1]
    part_acc = torch.empty(n, hq, splits, d, dtype=torch.float32, device="cuda")
    part_ml = torch.empty(n, hq, splits, 2, dtype=torch.float32, device="cuda")

    def run() -> object:
        split_k(
            grid=(hkv * n_qt * splits, prob.batch, 1), block=(128, 1, 1),
            args=[
                q, k, prob.block_table, prob.seq_lens, prob.cu_q, out, part_acc, part_ml,
                float(d**-0.5 * vc.LOG2E), 0, splits, n_qt, block_q, group, k.shape[1], hkv,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1),
                k.stride(2), prob.block_table.stride(0),
            ],
            shared_mem=smem,
        )  # fmt: skip
        comb_k(grid=(n * hq, 1, 1), block=(256, 1, 1),
               args=[out, part_acc, part_ml, splits, hq, out.stride(0), out.stride(1)])  # fmt: skip
        return out

    return run


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


def trace_stats(prob: Problem, sched: str, flush: torch.Tensor, fuse: bool = False) -> str:
    """One eager launch with per-CTA %globaltimer stamps: where the split kernel's time goes."""
    from kernels.verify_attention import cuda as vc

    p = prob.pool
    hkv = p.k.shape[2]
    _, n_qt, _, _ = vc._tile(prob.q.shape[1] // hkv, prob.t)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = vc.num_splits_for(prob.batch, hkv, n_qt, prob.ctx, sms)
    tr = torch.zeros(hkv * n_qt * splits * prob.batch, 8, dtype=torch.int64, device="cuda")

    def call(trace: torch.Tensor | None) -> None:
        vc.verify_attention_cuda(prob.q, p.k, prob.out, prob.cu_q, prob.t, prob.seq_lens, prob.ctx,
                                 p.head_size**-0.5, 0, prob.block_table, sched=sched, pdl=False,
                                 trace=trace, fuse=fuse)  # fmt: skip

    call(tr)
    torch.cuda.synchronize()
    flush_l2(flush)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    call(tr)
    e1.record()
    torch.cuda.synchronize()
    t = tr.cpu().double()
    base = t[:, 0].min()
    st, first, loop, end = [(t[:, i] - base) / 1e3 for i in range(4)]  # µs after the first CTA
    tiles = t[:, 4]
    q = lambda x: f"{x.min():.1f}/{x.median():.1f}/{x.max():.1f}"  # noqa: E731
    return (
        f"trace {sched:>6}{'+fused' if fuse else ''}: call {e0.elapsed_time(e1) * 1e3:.1f} us "
        f"(eager, incl. merge); "
        f"CTA start min/med/max {q(st)}; first tile landed {q(first)}; loop end {q(loop)}; "
        f"CTA end {q(end)}; first-tile wait per CTA med {(first - st).median():.1f}; "
        f"tiles/CTA {int(tiles.min())}..{int(tiles.max())}"
    )


def fixed_cost(
    flush: torch.Tensor, bw: float, results: list, before_src: str | None, before_mod: Any = None
) -> None:
    """Issue 6's fixed per-call cost at 100K: scheduling / merge variants side by side.

    ``fused*``: the merge inside the split kernel (HH_VERIFY_ATTENTION_FUSE), ``2node*``: the split
    kernel then the combine kernel (the path up to 86a6d8f), ``-GSn``: first-level merge groups of
    n splits; ``before``: the previous commit's default path (``--before-dir``)."""
    pool = make_pool(4 * 100_000 + 64, 16, HKV, D)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for t, b in ((1, 1), (8, 1), (1, 4), (8, 4)):
        prob = Problem(pool, b, 100_000, t, HQ)
        label = f"ctx=100000 T={t} b={b}"
        variants: dict[str, Callable[[], object]] = {}
        if before_mod is not None:
            variants["before"] = before_default(prob, before_mod)
        if before_src:
            variants["before-1344eca"] = before_call(prob, before_src)
        base_kw = {"sched": "static", "pdl": False}
        for name, kw in (
            ("default", {}),
            ("2node", {"fuse": False}), ("fused", {"fuse": True}),
            ("2node-static", {**base_kw, "fuse": False}), ("fused-static", {**base_kw, "fuse": True}),
            ("2node-dyn", {"sched": "dyn", "fuse": False}), ("fused-dyn", {"sched": "dyn", "fuse": True}),
            *[(f"fused-GS{g}", {"fuse": True, "merge_group": g}) for g in (4, 16, 66)],
            ("static-nocombine", {**base_kw, "combine": False}),
        ):  # fmt: skip
            variants[name] = prob.cuda_variant(**kw)
        us: dict[str, float] = {}
        for name, fn in variants.items():
            try:
                fn()
                err = prob.error() if name != "static-nocombine" else float("nan")
                us[name] = time_graph(fn, flush)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{label} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            r = row(f"{label} {name}", us[name], prob.int8_bytes, bw, None, err)
            results.append(r)
            print(fmt(r), flush=True)
        ref = us.get("before", us.get("2node", 1.0))
        print(f"  {label}: " + ", ".join(
            f"{k} {v:.1f} ({100 * prob.int8_bytes / v / 1e3 / bw:.1f}%, {ref / v:.2f}x)" for k, v in us.items()
        ), flush=True)  # fmt: skip
        if b == 1:
            for sched, fuse in (("static", False), ("dyn", False), ("static", True), ("dyn", True)):
                try:
                    line = trace_stats(prob, sched, flush, fuse)
                except Exception as exc:  # noqa: BLE001
                    line = f"trace {sched}: {type(exc).__name__}: {str(exc)[:120]}"
                results.append({"case": f"{label} {line}"})
                print("  " + line, flush=True)
        del prob
    del pool
    torch.cuda.empty_cache()


def node_costs(flush: torch.Tensor, bw: float, results: list, before_mod: Any = None) -> None:
    """Issue 6: the fixed cost at 100K b1 (T=1, T=8) per pool size, in one process.

    Per pool (the problem's blocks drawn at random from pools of 100K and 800K tokens; the main
    table uses 800K): the shipped default (split + combine kernel), ``before`` (--before-dir),
    the split kernel alone (``combine=False``), split + an empty kernel node, an empty node
    alone, the session-5 variants (fp16 partials with combine_w, combine_w / the row combine with
    and without PDL, the fused merge),
    and the read-only ceiling
    probe (ceiling.py: same grid, bytes and block table; on a contiguous block table; with 33
    and 132 splits).
    Session 3 (NOTES.md) measured the default 3.2 µs over the split alone on a 100K pool, where
    earlier runs on 400K / 800K pools gave ~9 µs."""
    from kernels.verify_attention.ceiling import probe

    empty = torch.cuda._compile_kernel('extern "C" __global__ void va_empty() {}', "va_empty")

    def node() -> None:
        empty(grid=(1, 1, 1), block=(32, 1, 1), args=[])

    for tokens in (100_000, 8 * 100_000):
        pool = make_pool(tokens + 64, 16, HKV, D)
        for t in (1, 8):
            prob = Problem(pool, 1, 100_000, t, HQ)
            split = prob.cuda_variant(combine=False)

            def split_node(split: Callable[[], object] = split) -> None:
                split()
                node()

            nblk = prob.block_table.shape[1]
            flat = torch.arange(nblk, dtype=torch.int32, device="cuda").view(1, nblk)
            variants: dict[str, Callable[[], object]] = {"default": prob.ours()}
            if before_mod is not None:
                variants["before"] = before_default(prob, before_mod)
            variants.update({
                "fp16-partials": prob.cuda_variant(partials="fp16", combine_kernel="w"),
                "combine-w": prob.cuda_variant(combine_kernel="w"),
                "combine-w+pdl": prob.cuda_variant(combine_kernel="w", pdl=True),
                "combine-row": prob.cuda_variant(combine_kernel="row"),
                "combine-row+pdl": prob.cuda_variant(combine_kernel="row", pdl=True),
                "fused": prob.cuda_variant(fuse=True),
                "split-only": split, "split+empty": split_node, "empty-node": node,
                "probe": probe(pool.k, prob.block_table, prob.seq_lens, prob.cu_q, t, HQ),
                "probe-contig": probe(pool.k, flat, prob.seq_lens, prob.cu_q, t, HQ),
                # other grids: half the splits (one CTA per SM), twice (two waves)
                "probe-S33": probe(pool.k, prob.block_table, prob.seq_lens, prob.cu_q, t, HQ, 33),
                "probe-S132": probe(pool.k, prob.block_table, prob.seq_lens, prob.cu_q, t, HQ, 132),
            })  # fmt: skip
            label = f"pool={tokens // 1000}K ctx=100000 T={t} b=1"
            us: dict[str, float] = {}
            for name, fn in variants.items():
                try:
                    fn()
                    err = prob.error() if "split" not in name and "probe" not in name and "empty" not in name else float("nan")
                    us[name] = time_graph(fn, flush)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"{label} {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                prob.out.fill_(float("nan"))
                r = row(f"{label} {name}", us[name], prob.int8_bytes, bw, None, err)
                results.append(r)
                print(fmt(r), flush=True)
            ref = us.get("before", us.get("default", 1.0))
            print(f"  {label}: " + ", ".join(
                f"{k} {v:.1f} ({100 * prob.int8_bytes / v / 1e3 / bw:.1f}%, before/x {ref / v:.2f})"
                for k, v in us.items()
            ) + f"; default - split-only {us.get('default', 0) - us.get('split-only', 0):.1f} us", flush=True)  # fmt: skip
            del prob
        del pool
        torch.cuda.empty_cache()


def stream_ceiling(flush: torch.Tensor, bw: float, results: list) -> None:
    """Issue 6: is >= 80% of copy reachable at all for a read of this cache at 100K, batch 1?

    Times the pure-read probes of ceiling_stream.py (TMA bulk ring, 16-byte loads over whole
    pages, per-head windows) beside ceiling.py's split-grid probe and an empty node, on page 16
    with random pages (800K-token pool, as the main table), page 16 with a contiguous block table,
    and page 1,616 with random pages; each probe's word sum is checked against torch's first.
    Two rounds (the second in reverse order); % is of prob.int8_bytes (the attention's bytes) over
    the round's µs, as the main table, and "net" subtracts the empty node (graph launch + events).
    """
    from kernels.verify_attention import ceiling_stream as cs
    from kernels.verify_attention import cuda as vc
    from kernels.verify_attention.ceiling import probe as split_probe

    empty = torch.cuda._compile_kernel('extern "C" __global__ void va_empty() {}', "va_empty")
    ctx = 100_000
    vc.precompile(cs.jobs(cs.DEFAULT_PROBES, (16, 1616)))
    pool16 = make_pool(8 * ctx + 64, 16, HKV, D)
    prob16 = Problem(pool16, 1, ctx, 1, HQ)
    nblk = prob16.block_table.shape[1]
    flat = torch.arange(nblk, dtype=torch.int32, device="cuda").view(1, nblk)
    pool1616 = make_pool(ctx + 4096, 1616, HKV, D)
    prob1616 = Problem(pool1616, 1, ctx, 1, HQ)
    setups = (("p16 random", pool16, prob16, prob16.block_table), ("p16 contig", pool16, prob16, flat),
              ("p1616 random", pool1616, prob1616, prob1616.block_table))  # fmt: skip
    entries: list[tuple[str, Callable[[], object], int, str]] = [
        ("empty node", lambda: empty(grid=(1, 1, 1), block=(32, 1, 1), args=[]), prob16.int8_bytes, "-")
    ]
    for name, pool, prob, bt in setups:
        entries.append((f"{name} split-grid probe (ceiling.py)",
                        split_probe(pool.k, bt, prob.seq_lens, prob.cu_q, 1, HQ), prob.int8_bytes, "-"))  # fmt: skip
        sums = {h: cs.expected_sum(pool, bt, ctx, h) for h in (False, True)}
        for p in cs.DEFAULT_PROBES:
            label = f"{name} {p.label}"
            try:
                run, sink = cs.launcher(p, pool, bt, ctx)
                run()
                torch.cuda.synchronize()
                got = cs.sink_sum(sink)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            ok = "ok" if got == sums[p.kind == "head"] else f"SUM MISMATCH {got:#x} vs {sums[p.kind == 'head']:#x}"
            print(f"{label}: {ok}", flush=True)
            if ok == "ok":
                entries.append((label, run, prob.int8_bytes, ok))
    times: dict[str, list[float]] = {e[0]: [] for e in entries}
    for order in (entries, entries[::-1]):
        for label, fn, _, _ in order:
            times[label].append(time_graph(fn, flush))
    e_us = statistics.median(times["empty node"])
    print(f"{'case (100K keys, batch 1, D=256, 4 KV heads)':<52} {'us r1':>7} {'us r2':>7} {'%copy':>6} "
          f"{'net %':>6}  check", flush=True)  # fmt: skip
    for label, _, nbytes, ok in entries:
        r1, r2 = times[label]
        best = min(r1, r2)
        pct = 100 * nbytes / best / 1e3 / bw
        net = 100 * nbytes / max(best - e_us, 1e-3) / 1e3 / bw
        results.append({"case": f"ceiling {label}", "us": [r1, r2], "pct_copy": pct, "pct_copy_net": net,
                        "check": ok})  # fmt: skip
        cells = "     -      -" if label == "empty node" else f"{pct:5.1f}% {net:5.1f}%"
        print(f"{label:<52} {r1:7.1f} {r2:7.1f} {cells}  {ok}", flush=True)
    floor = prob16.int8_bytes / bw / 1e3
    print(f"copy {bw:.0f} GB/s: floor {floor:.1f} us, 80% = {floor / 0.8:.1f} us", flush=True)
    del pool16, pool1616
    torch.cuda.empty_cache()


def triton_next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def profile_one(t: int) -> None:
    """One launch of ours at 100K, batch 1 (run under ncu)."""
    pool = make_pool(100_000 + 64, 16, HKV, D)
    prob = Problem(pool, 1, 100_000, t, HQ)
    prob.ours()()
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="launch-parameter sweep at 100K")
    ap.add_argument("--quick", action="store_true", help="100K only")
    ap.add_argument("--sweep-only", action="store_true", help="stop after the sweep")
    ap.add_argument("--json", default=None)
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
    ap.add_argument("--ceiling-only", action="store_true",
                    help="pure-read ceiling probes at 100K b1 (ceiling_stream.py), then stop")  # fmt: skip
    ap.add_argument("--before-src", default=None, help="the .cu of commit 1344eca, timed as 'before-1344eca'")
    ap.add_argument("--before-dir", default=None,
                    help="a folder with the previous commit's cuda/__init__.py and verify_attention.cu: "
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
    if args.ceiling_only:
        stream_ceiling(flush, bw, results)
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

    # The anchor first: vLLM at 100K, T=8, batch 1 (issue 6 measured 11,524 µs).
    print(HEADER, flush=True)
    cases = [(ctx, t, b) for ctx in contexts for t in (1, 8, 16) for b in (1, 4)]
    cases.sort(key=lambda c: c != (100_000, 8, 1))
    for ctx, t, b in cases:
        prob = Problem(pool, b, ctx, t, HQ)
        base = None
        label = f"ctx={ctx} T={t} b={b}"
        if vllm is not None:
            fn = prob.vllm(*vllm)
            fn()
            err = prob.error()
            base = time_graph(fn, flush)
            r = row(f"{label} vllm", base, prob.int8_bytes, bw, None, err)
            results.append(r)
            print(fmt(r), flush=True)
        fn = prob.ours()
        fn()
        err = prob.error()
        r = row(f"{label} ours", time_graph(fn, flush), prob.int8_bytes, bw, base, err)
        results.append(r)
        print(fmt(r), flush=True)
        time_mma(prob, label, flush, bw, base, results, args)
        time_before(prob, label, flush, bw, base, results, before_mod)
        if args.triton:
            fn = prob.triton()
            fn()
            err = prob.error()
            r = row(f"{label} triton", time_graph(fn, flush), prob.int8_bytes, bw, base, err)
            results.append(r)
            print(fmt(r), flush=True)
        if args.no_sdpa:
            del prob
            torch.cuda.empty_cache()
            continue
        try:
            fn = prob.sdpa()
            r = row(f"{label} sdpa-bf16", time_graph(fn, flush), prob.bf16_bytes, bw, base, 0)
            r["err"] = float("nan")
            results.append(r)
            print(fmt(r), flush=True)
        except Exception as exc:  # noqa: BLE001 - SDPA may not support a shape; say so
            print(f"{label} sdpa-bf16: {type(exc).__name__}: {str(exc)[:100]}")
        del prob
        torch.cuda.empty_cache()

    # Page size 1,616 (fp32 GDN state, 7 draft tokens) and the drafter's sliding-window layers.
    del pool
    torch.cuda.empty_cache()
    pool = make_pool(100_000 + 4096, 1616, HKV, D)
    extra = [(pool, 1, 100_000, t, HQ, 0, f"page=1616 ctx=100000 T={t} b=1") for t in (1, 8)]
    swa = make_pool(4 * 100_000 + 64, 16, 8, 128)
    extra += [
        (swa, b, 100_000, t, 32, 2048, f"swa 8x128 w=2048 ctx=100000 T={t} b={b}")
        for t in (1, 8)
        for b in (1, 4)
    ]
    print(HEADER, flush=True)
    for p, b, ctx, t, hq, window, label in extra:
        prob = Problem(p, b, ctx, t, hq, window)
        base = None
        if vllm is not None:
            fn = prob.vllm(*vllm)
            fn()
            err = prob.error()
            base = time_graph(fn, flush)
            r = row(f"{label} vllm", base, prob.int8_bytes, bw, None, err)
            results.append(r)
            print(fmt(r), flush=True)
        fn = prob.ours()
        fn()
        err = prob.error()
        r = row(f"{label} ours", time_graph(fn, flush), prob.int8_bytes, bw, base, err)
        results.append(r)
        print(fmt(r), flush=True)
        time_mma(prob, label, flush, bw, base, results, args)
        time_before(prob, label, flush, bw, base, results, before_mod)
        if args.triton:
            fn = prob.triton()
            fn()
            err = prob.error()
            r = row(f"{label} triton", time_graph(fn, flush), prob.int8_bytes, bw, base, err)
            results.append(r)
            print(fmt(r), flush=True)

    summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
