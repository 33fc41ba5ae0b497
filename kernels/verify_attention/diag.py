"""Diagnostics of the verify-attention kernels on the H200 (bench.py's modes beside its table).

    python -m kernels.verify_attention.bench --sweep | --fixed-cost[-only] | --node-costs[-only]
        | --decode-costs | --ceiling-only | --profile-one T

Each mode times variants side by side in one process with bench.py's harness (CUDA graph, cold
L2, the copy bandwidth measured in the same run); NOTES.md records what each found.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from kernels.verify_attention import triton as va_triton
from kernels.verify_attention.bench import (
    D,
    HKV,
    HQ,
    Problem,
    before_default,
    flush_l2,
    fmt,
    make_pool,
    row,
    time_graph,
)
from kernels.verify_attention.reference import Int8KVCache


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


def time_variants(
    prob: Problem, variants: dict[str, Callable[[], object]], label: str, flush: torch.Tensor, bw: float,
    results: list, no_output: Callable[[str], bool],
) -> dict[str, float]:
    """µs of each variant (bench's harness) and its error vs the reference unless no_output(name)
    (it does not write prob.out); prints and records one row each, reports a failing variant and
    goes on. Returns name -> µs."""
    us: dict[str, float] = {}
    for name, fn in variants.items():
        try:
            fn()
            err = float("nan") if no_output(name) else prob.error()
            us[name] = time_graph(fn, flush)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{label} {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        prob.out.fill_(float("nan"))
        r = row(f"{label} {name}", us[name], prob.int8_bytes, bw, None, err)
        results.append(r)
        print(fmt(r), flush=True)
    return us


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
            us = time_variants(prob, variants, label, flush, bw, results,
                               lambda n: "split" in n or "probe" in n or "empty" in n)
            ref = us.get("before", us.get("default", 1.0))
            print(f"  {label}: " + ", ".join(
                f"{k} {v:.1f} ({100 * prob.int8_bytes / v / 1e3 / bw:.1f}%, before/x {ref / v:.2f})"
                for k, v in us.items()
            ) + f"; default - split-only {us.get('default', 0) - us.get('split-only', 0):.1f} us", flush=True)  # fmt: skip
            del prob
        del pool
        torch.cuda.empty_cache()


def decode_costs(flush: torch.Tensor, bw: float, results: list) -> None:
    """Issue 6, T=1: verify_attn_decode against the wgmma split kernel, in a fresh process.

    On an 800K-token pool (the main table's), T=1, at 100K b1 / b4 and 50K / 150K / 200K b1: each
    kernel with its default combine (``decode=False`` / ``decode=True``) and alone
    (``combine=False``). At 100K b1 also: the decode kernel + an empty node, + its combine without
    PDL, its read-only probes (with / without the Q prologue and the merge epilogue),
    ceiling_stream's TMA probe on the same block table, and the %globaltimer stamps of split +
    combine (diag_combine._trace). Two rounds per size, the second in reverse order, so no variant
    always runs first."""
    empty = torch.cuda._compile_kernel('extern "C" __global__ void va_empty() {}', "va_empty")
    pool = make_pool(8 * 100_000 + 64, 16, HKV, D)
    for ctx, b in ((100_000, 1), (100_000, 4), (200_000, 1), (50_000, 1), (150_000, 1)):
        prob = Problem(pool, b, ctx, 1, HQ)
        variants: dict[str, Callable[[], object]] = {
            "wgmma": prob.cuda_variant(decode=False),
            "decode": prob.cuda_variant(decode=True),
            "wgmma-split-only": prob.cuda_variant(decode=False, combine=False),
            "decode-split-only": prob.cuda_variant(decode=True, combine=False),
        }
        if (ctx, b) == (100_000, 1):
            split = variants["decode-split-only"]

            def split_empty(split: Callable[[], object] = split) -> None:
                split()
                empty(grid=(1, 1, 1), block=(32, 1, 1), args=[])

            variants["decode-split+empty-node"] = split_empty
            variants["decode-no-pdl"] = prob.cuda_variant(decode=True, pdl=False)  # PDL is its default
            variants["decode-probe-split"] = prob.cuda_variant(decode=True, decode_mode=2, combine=False)
            # the read-only TMA probe of ceiling_stream.py (one CTA per SM, 16-slot copies, 6 stages;
            # 94.7% of copy in its own session-5 process) on this problem's pool and block table
            from kernels.verify_attention import ceiling_stream

            variants["probe-tma16x6-split"] = ceiling_stream.launcher(
                ceiling_stream.Probe("tma", 1, tok=16, stages=6), pool, prob.block_table, ctx)[0]
            variants["decode-probe3-split"] = prob.cuda_variant(decode=True, decode_mode=3, combine=False)
            variants["decode-probe4-split"] = prob.cuda_variant(decode=True, decode_mode=4, combine=False)
        label = f"ctx={ctx} T=1 b={b}"
        names = list(variants)
        runs: dict[str, list[float]] = {}
        for order in (names, names[::-1]):
            us = time_variants(prob, {n: variants[n] for n in order}, label, flush, bw, results,
                               lambda n: "split" in n)
            for n, v in us.items():
                runs.setdefault(n, []).append(v)
        base = min(runs.get("wgmma", [float("nan")]))
        print(f"  {label}: " + ", ".join(
            f"{n} {min(v):.1f} ({100 * prob.int8_bytes / min(v) / 1e3 / bw:.1f}%, wgmma/x {base / min(v):.2f})"
            for n, v in runs.items()
        ), flush=True)  # fmt: skip
        if (ctx, b) == (100_000, 1):
            # Where the time of split + merge goes: %globaltimer stamps of the split kernel's CTAs
            # and of a row-grid col combine (256 dims per CTA) in one graph, 10 cold replays.
            from kernels.verify_attention.diag_combine import _trace

            for name, kw in (("wgmma", {"decode": False}), ("decode", {"decode": True})):
                st = _trace(prob, flush, 256, False, **kw)
                print(f"  {label} stamps {name}+col256: " + ", ".join(f"{k} {v:.2f}" for k, v in st.items()), flush=True)
                results.append({"case": f"{label} stamps {name}+col256", **st})
        del prob
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
