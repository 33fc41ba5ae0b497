"""Issue 6: what the second graph node (the combine) costs at 100K b1, and why.

    python -m kernels.verify_attention.bench --combine-costs[-only]

One process, bench.py's harness (CUDA graph, cold L2, median µs), the main table's 800K-token
pool, 100K keys, batch 1, T = 1 and 8 (66 splits). Times the shipped default beside the split
kernel alone, split + an empty node, and the combine variants: verify_attn_combine_r ("row"),
_w, _c at 256 / 128 / 64 / 32 dims per CTA ("colN"), each with the partials in a fresh
torch.empty (the graph's pool, as shipped) or in the per-device workspace ("+ws"), with PDL;
the combine alone on partials written earlier (cold: in DRAM after the flush; "x2": a second
launch on warm L2 and code); the split + a combine that reads those older partials ("stale")
instead of the ones the split just wrote. Then %globaltimer stamps of the split's CTAs and the
col combine's CTAs in one graph (10 cold replays): the gap between the split's last CTA and the
combine's first, the combine's phases ((max, sum) barrier, partials summed, end), its span, the
SM clock during it, and the time outside both kernels.

    python -m kernels.verify_attention.bench --loop-modes

The same graphs replayed in three host loops (the stamps of every replay kept on the device):
"tight" (bench.time_graph's: flush, events, replay, wait for the end event), "idle" (tight +
2 ms of host sleep after each replay: the GPU idles between replays) and "sync" (the stamp
loop above: a device-wide synchronize and a host read of the stamps after each replay).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels.verify_attention.bench import HKV, HQ, Problem, capture, flush_l2, make_pool
from kernels.verify_attention.diag import time_variants

CTX = 100_000
TRACE_REPLAYS = 10


def _stale(prob: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials of one eager split launch, copied into buffers of their own (the combine reads
    them from DRAM after the flush)."""
    from kernels.verify_attention import cuda as vc

    prob.cuda_variant(combine=False, workspace=True)()
    torch.cuda.synchronize()
    n, hq, d = prob.q.shape
    acc, ml = vc.partial_buffers(prob.q.device, (n, hq, _splits(prob), d), torch.float32, True)
    return acc.clone(), ml.clone()


def _splits(prob: Problem) -> int:
    from kernels.verify_attention import cuda as vc

    _, n_qt, _, _ = vc._tile(HQ // HKV, prob.t)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return vc.num_splits_for(prob.batch, HKV, n_qt, prob.ctx, sms)


def _variants(prob: Problem, node: Callable[[], None]) -> dict[str, Callable[[], object]]:
    from kernels.verify_attention import cuda as vc

    cv = prob.cuda_variant
    split, split_ws = cv(combine=False), cv(combine=False, workspace=True)
    stale_acc, stale_ml = _stale(prob)

    def comb(kind: str, cols: int | None = None, src: tuple | None = None) -> Callable[[], None]:
        acc, ml = src or (stale_acc, stale_ml)
        return lambda: vc.launch_combine(kind, prob.out, acc, ml, cols=cols)

    def seq(*fns: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for f in fns:
                f()

        return run

    v: dict[str, Callable[[], object]] = {
        "default": prob.ours(), "split-only": split, "split+empty": seq(split, node), "empty-node": node,
        "split-only+ws": split_ws, "row": cv(combine_kernel="row"), "row+ws": cv(combine_kernel="row", workspace=True),
        "row+pdl": cv(combine_kernel="row", pdl=True), "w": cv(combine_kernel="w"),
    }  # fmt: skip
    for cols in (256, 128, 64, 32):
        v[f"col{cols}"] = cv(combine_kernel="col", combine_cols=cols)
    for cols in (64, 32):
        v[f"col{cols}+ws"] = cv(combine_kernel="col", combine_cols=cols, workspace=True)
    v["col64+pdl"] = cv(combine_kernel="col", combine_cols=64, pdl=True)
    v["col64+ws+pdl"] = cv(combine_kernel="col", combine_cols=64, workspace=True, pdl=True)
    if prob.t == 1:
        v["static default"] = cv(sched="static")
        v["static split-only"] = cv(sched="static", combine=False)
    v["split+row(stale)"] = seq(split_ws, comb("row"))
    v["split+col64(stale)"] = seq(split_ws, comb("col", 64))
    v["row alone (cold)"] = comb("row")
    v["row alone x2"] = seq(comb("row"), comb("row"))
    v["col64 alone (cold)"] = comb("col", 64)
    v["col64 alone x2"] = seq(comb("col", 64), comb("col", 64))
    return v


def _trace(prob: Problem, flush: torch.Tensor, cols: int, ws: bool, **kw: Any) -> dict[str, float]:
    """Stamps of split + col combine in one graph, TRACE_REPLAYS cold replays; medians (µs).
    ``kw``: more launcher options (decode=True: verify_attn_decode's stamps, same slots 0 and 3)."""
    n, hq, d = prob.q.shape
    tr_s = torch.zeros(4096 * prob.batch, 8, dtype=torch.int64, device="cuda")  # >= the split grid
    tr_c = torch.zeros(n * hq * (d // cols), 8, dtype=torch.int64, device="cuda")
    fn = prob.cuda_variant(combine_kernel="col", combine_cols=cols, workspace=ws, trace=tr_s, combine_trace=tr_c,
                           **kw)  # fmt: skip
    graph = capture(fn, warm_on_side_stream=False)
    keys = ("event", "split_span", "split_start_spread", "split_end_spread", "gap", "comb_start_spread",
            "ph_ml", "ph_ml_max", "ph_sum", "ph_sum_max", "ph_end", "comb_cta_max", "comb_span", "outside",
            "sm_mhz", "sms")  # fmt: skip
    rec: dict[str, list[float]] = {k: [] for k in keys}
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(TRACE_REPLAYS):
        tr_s.zero_(), tr_c.zero_()
        flush_l2(flush)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        s, c = tr_s.cpu(), tr_c.cpu()
        s = s[s[:, 0] > 0]
        base = int(s[:, 0].min())
        us = lambda x: (x - base).double() / 1e3  # noqa: E731 - int64 ns, exact before the subtraction
        s_end = float(us(s[:, 3]).max())
        c0, c1, c2, c3 = (us(c[:, i]) for i in range(4))
        ev = e0.elapsed_time(e1) * 1e3
        rec["event"].append(ev)
        rec["split_span"].append(s_end)
        rec["split_start_spread"].append(float(us(s[:, 0]).max()))
        rec["split_end_spread"].append(s_end - float(us(s[:, 3]).min()))
        rec["gap"].append(float(c0.min()) - s_end)
        rec["comb_start_spread"].append(float(c0.max() - c0.min()))
        rec["ph_ml"].append(float((c1 - c0).median())), rec["ph_ml_max"].append(float((c1 - c0).max()))
        rec["ph_sum"].append(float((c2 - c1).median())), rec["ph_sum_max"].append(float((c2 - c1).max()))
        rec["ph_end"].append(float((c3 - c2).median()))
        rec["comb_cta_max"].append(float((c3 - c0).max()))
        rec["comb_span"].append(float(c3.max() - c0.min()))
        rec["outside"].append(ev - float(c3.max()))
        rec["sm_mhz"].append(float((c[:, 5].double() / (c3 - c0)).median()))  # cycles per µs
        rec["sms"].append(float(c[:, 4].unique().numel()))
    del graph
    return {k: statistics.median(v) for k, v in rec.items()}


def combine_costs(flush: torch.Tensor, bw: float, results: list) -> None:
    from kernels.verify_attention import cuda as vc

    empty = torch.cuda._compile_kernel('extern "C" __global__ void va_empty() {}', "va_empty")

    def node() -> None:
        empty(grid=(1, 1, 1), block=(32, 1, 1), args=[])

    jobs = [(f"verify_attn_combine_c<{D_}, {c}, true>", 0) for D_ in (256,) for c in (256, 128, 64, 32)]
    vc.precompile(jobs + [("verify_attn_combine_r<256, true>", 0), ("verify_attn_combine_w<256, true>", 0)])
    pool = make_pool(8 * CTX + 64, 16, HKV, 256)
    for t in (1, 8):
        prob = Problem(pool, 1, CTX, t, HQ)
        label = f"ctx=100000 T={t} b=1"
        us = time_variants(prob, _variants(prob, node), label, flush, bw, results,
                           lambda n: any(x in n for x in ("split-only", "split+empty", "empty-node")))
        base = us.get("split+empty", 0.0)
        print(f"  {label} over split+empty: " + ", ".join(
            f"{k} {v - base:+.1f}" for k, v in us.items() if k not in ("split+empty", "empty-node")
        ), flush=True)  # fmt: skip
        for cols, ws in ((256, False), (256, True), (64, False), (64, True), (32, True)):
            try:
                st = _trace(prob, flush, cols, ws)
            except Exception as exc:  # noqa: BLE001
                print(f"{label} trace col{cols}{'+ws' if ws else ''}: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            name = f"{label} trace split+col{cols}{'+ws' if ws else ''}"
            results.append({"case": name, **st})
            print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in st.items()), flush=True)
        del prob
    del pool
    torch.cuda.empty_cache()


def _loop(graph: torch.cuda.CUDAGraph, flush: torch.Tensor, mode: str, reps: int,
          stamps: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], list[torch.Tensor]]:
    """Event µs of each replay and, per stamp buffer, its copy after each replay [reps, CTAs, 8]."""
    hist = [torch.zeros(reps, *buf.shape, dtype=buf.dtype, device=buf.device) for buf, _ in stamps]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps):
        flush_l2(flush)
        e0.record()
        graph.replay()
        e1.record()
        for h, (buf, _) in zip(hist, stamps):
            h[i].copy_(buf)  # after the end event: not timed
        if mode == "sync":
            torch.cuda.synchronize()
            _ = [buf.cpu() for buf, _ in stamps]
        else:
            e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
        if mode == "idle":
            time.sleep(0.002)
    torch.cuda.synchronize()
    return times, hist


def _phases(ev: float, s: torch.Tensor, c: torch.Tensor) -> dict[str, float]:
    s = s[s[:, 0] > 0]
    base = int(s[:, 0].min())
    us = lambda x: (x - base).double() / 1e3  # noqa: E731
    s_end = float(us(s[:, 3]).max())
    c0, c3 = us(c[:, 0]), us(c[:, 3])
    return {"event": ev, "split_span": s_end, "gap": float(c0.min()) - s_end,
            "comb_span": float(c3.max() - c0.min()), "outside": ev - float(c3.max()),
            "sm_mhz": float((c[:, 5].double() / (c3 - c0)).median())}  # fmt: skip


def loop_modes(flush: torch.Tensor, bw: float, results: list, reps: int = 30) -> None:
    """100K b1, T = 1 and 8: the default graph, the split alone and the stamped split + col256
    combine, each in the tight / idle / sync host loops (and tight again at the end)."""
    from kernels.verify_attention import cuda as vc

    vc.precompile([("verify_attn_combine_c<256, 256, true>", 0), ("verify_attn_combine_r<256, true>", 0)])
    pool = make_pool(8 * CTX + 64, 16, HKV, 256)
    q3 = lambda xs: f"{min(xs):.1f}/{statistics.median(xs):.1f}/{max(xs):.1f}"  # noqa: E731
    for t in (1, 8):
        prob = Problem(pool, 1, CTX, t, HQ)
        n, hq, d = prob.q.shape
        _, n_qt, _, _ = vc._tile(hq // HKV, t)
        tr_s = torch.zeros(HKV * n_qt * _splits(prob), 8, dtype=torch.int64, device="cuda")
        tr_c = torch.zeros(n * hq, 8, dtype=torch.int64, device="cuda")
        fns = {"default": prob.ours(), "split-only": prob.cuda_variant(combine=False),
               "stamped split+col256": prob.cuda_variant(combine_kernel="col", combine_cols=256, trace=tr_s,
                                                         combine_trace=tr_c)}  # fmt: skip
        for name, fn in fns.items():
            graph = capture(fn, warm_on_side_stream=False)
            stamps = [(tr_s, "s"), (tr_c, "c")] if "stamped" in name else []
            for mode in ("tight", "idle", "sync", "tight"):
                times, hist = _loop(graph, flush, mode, reps, stamps)
                line = f"ctx=100000 T={t} b=1 {name} [{mode}] event min/med/max {q3(times)}"
                rec = {"case": f"ctx=100000 T={t} b=1 {name} loop {mode}", "events": times}
                if stamps:
                    hs, hc = (h.cpu() for h in hist)
                    ph = [_phases(times[i], hs[i], hc[i]) for i in range(reps)]
                    med = {k: statistics.median(p[k] for p in ph) for k in ph[0]}
                    rec["phases"] = ph
                    line += "; medians " + ", ".join(f"{k} {v:.2f}" for k, v in med.items() if k != "event")
                    slow = [p for p in ph if p["event"] > statistics.median(times) + 2]
                    if slow:
                        line += f"; {len(slow)} slow replays (> median + 2), their medians " + ", ".join(
                            f"{k} {statistics.median(p[k] for p in slow):.2f}" for k in ph[0])
                results.append(rec)
                print(line, flush=True)
            del graph
        del prob
    del pool
    torch.cuda.empty_cache()
