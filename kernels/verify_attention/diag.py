"""Diagnosis of the verify-attention launcher's rule and of where a call's time goes (H200).

    python -m kernels.verify_attention.diag --rule [--json PATH]
    python -m kernels.verify_attention.diag --trace [--ctx 100000] [--t 8] [--batch 1] [--page 16]
    python -m kernels.verify_attention.diag --sweep [--ctx 100000] [--t 8] [--batch 4]

``--rule``: every choice of cuda/__init__.py's rule beside its alternatives on the rows where it
was decided (NOTES.md, "Rules in force"), with the table's protocol (bench.py: every variant run
once and checked against the fp32 reference, then every graph captured, then rounds of cold
replays): the decode kernel vs the wgmma kernel at T=1 by context (8K-200K b1, 100K b4, the
drafter's window layers), the wgmma kernel's dyn vs static tiles at T=1 and T=8, the combine
kernels (row / col / w, with and without programmatic dependent launch) after each split kernel,
and the split kernel alone (no combine: the second graph node's cost). A rule still holds where
its default is the fastest of its row (within noise: the rounds' spread is printed).

``--trace``: one problem's default launch with per-CTA %globaltimer stamps (the split kernels'
``trace`` buffers; the column combine's too): when the CTAs start, when their first tile lands,
when their loops end and they finish, tiles per CTA, and the combine's span.

``--sweep``: the default path at fixed split counts beside the rule's own count (the split rule's
measurement; the CUDA kernels on sm_90, Triton with HH_VERIFY_ATTENTION_BACKEND=triton).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernels.verify_attention import _backend
from kernels.verify_attention import cuda as vc
from kernels.verify_attention.bench import (
    FLUSH_BYTES, HKV, HQ, D, Entry, Problem, copy_bandwidth, flush_l2, make_pool, time_entries,
)  # fmt: skip

# (label, ctx, T, batch, pool key): the rows the decode / sched / combine rules were decided on.
RULE_ROWS = [
    ("8K T=1 b1", 8_192, 1, 1, "p16"), ("32K T=1 b1", 32_768, 1, 1, "p16"),
    ("100K T=1 b1", 100_000, 1, 1, "p16"), ("200K T=1 b1", 200_000, 1, 1, "p16"),
    ("100K T=1 b4", 100_000, 1, 4, "p16"), ("100K T=8 b1", 100_000, 8, 1, "p16"),
    ("100K T=8 b4", 100_000, 8, 4, "p16"), ("swa w=2048 T=1 b1", 100_000, 1, 1, "swa"),
]  # fmt: skip


def _variants(prob: Problem) -> dict[str, tuple[Callable[[], object], bool]]:
    """name -> (launch, writes out) for one rule row: the default, then each choice flipped."""
    v: dict[str, tuple[Callable[[], object], bool]] = {"default": (prob.ours(), True)}
    for dec in ((True, False) if prob.t == 1 else (False,)):
        name = "decode" if dec else "wgmma"
        for comb in ("row", "col", "w"):
            for pdl in (False, True):
                v[f"{name} {comb}{' pdl' if pdl else ''}"] = (prob.cuda(decode=dec, combine_kernel=comb, pdl=pdl), True)
        v[f"{name} split only"] = (prob.cuda(decode=dec, combine=False), False)
        if not dec:
            for sched in ("dyn", "static"):
                v[f"wgmma {sched}"] = (prob.cuda(decode=False, sched=sched), True)
    return v


def rule(flush: torch.Tensor, bw: float, results: list[dict], rounds: int) -> None:
    pools = {"p16": make_pool(4 * 200_000 + 64, 16, HKV, D), "swa": make_pool(4 * 100_000 + 64, 16, 8, 128)}
    entries: list[Entry] = []
    for label, ctx, t, b, pk in RULE_ROWS:
        swa = pk == "swa"
        prob = Problem(pools[pk], b, ctx, t, 32 if swa else HQ, 2048 if swa else 0)
        for name, (fn, writes) in _variants(prob).items():
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a variant a shape cannot take: say so, go on
                print(f"{label} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            err = prob.error() if writes else float("nan")
            entries.append(Entry(label, name, fn, prob.int8_bytes, err))
    time_entries(entries, flush, rounds)
    by_row: dict[str, list[Entry]] = {}
    for e in entries:
        by_row.setdefault(e.label, []).append(e)
    for label, es in by_row.items():
        base = statistics.median(es[0].times)
        print(f"\n{label}: default {base:.1f} µs ({100 * es[0].nbytes / base / 1e3 / bw:.1f}% of copy)")
        for e in es:
            us = statistics.median(e.times)
            print(f"  {e.provider:<22} {us:8.1f} µs  rounds {min(e.times):.1f}-{max(e.times):.1f}  "
                  f"x{us / base:5.2f}  err {e.err:.1e}", flush=True)  # fmt: skip
            results.append({"case": f"{label} {e.provider}", "us": us, "rounds": e.times, "err": e.err})


def trace(flush: torch.Tensor, ctx: int, t: int, batch: int, page: int, results: list[dict]) -> None:
    """Per-CTA stamps of the default split kernel (and of the column combine where it runs)."""
    pool = make_pool(4 * ctx * batch + 64, page, HKV, D)
    prob = Problem(pool, batch, ctx, t, HQ)
    p = prob.pool
    _, n_qt, n8 = vc._tile(HQ // HKV, t)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dec = n8 == 1 and page % 16 == 0 and vc.default_decode(ctx)
    splits = vc.num_splits_decode(batch, ctx, sms) if dec else vc.num_splits_for(batch, HKV, n_qt, ctx, sms)
    ctas = (1 if dec else HKV) * n_qt * splits * batch
    tr = torch.zeros(ctas, 8, dtype=torch.int64, device="cuda")
    rows = prob.q.shape[0] * HQ
    ctr = torch.zeros(rows * (D // vc.COMBINE_COLS), 8, dtype=torch.int64, device="cuda")
    col = dec and vc.COMBINE_MIN_SPLITS <= splits <= vc.ROW_COMBINE_MAX_SPLITS

    def call() -> None:
        vc.verify_attention_cuda(prob.q, p.k, prob.out, prob.cu_q, t, prob.seq_lens, ctx, D**-0.5, 0,
                                 prob.block_table, trace=tr, combine_trace=ctr if col else None)  # fmt: skip

    call()
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        flush_l2(flush)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        call()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    s = tr.cpu().double()
    t0 = s[:, 0].min()
    q = lambda x: f"{x.min():7.2f} {x.median():7.2f} {x.max():7.2f}"  # noqa: E731
    kernel = "verify_attn_decode" if dec else "verify_attn_split_wg"
    print(f"ctx={ctx} T={t} b={batch} page={page}: {kernel}, {splits} splits, {ctas} CTAs; eager call "
          f"{statistics.median(times):.1f} µs (median of 10, last launch's stamps below)")
    print("µs after the first CTA's start (min / median / max over CTAs)")
    print(f"  CTA start          {q((s[:, 0] - t0) / 1e3)}")
    if not dec:  # slots 6, 7, 1: the prologue (verify_attn_split_wg only)
        print(f"  first copies issued {q((s[:, 6] - t0) / 1e3)}\n  Q stored           {q((s[:, 7] - t0) / 1e3)}")
        print(f"  first tile landed  {q((s[:, 1] - t0) / 1e3)}")
    else:
        print(f"  producer done      {q((s[:, 1] - t0) / 1e3)}")
    print(f"  loop end           {q((s[:, 2] - t0) / 1e3)}\n  CTA end            {q((s[:, 3] - t0) / 1e3)}")
    print(f"  {'tiles' if not dec else 'chunks'} per CTA     {int(s[:, 4 if not dec else 5].min())}.."
          f"{int(s[:, 4 if not dec else 5].max())}")
    if col:
        c = ctr.cpu().double()
        print(f"  col combine: first CTA start {(c[:, 0].min() - t0) / 1e3:.2f}, (max, sum) barrier med "
              f"{(c[:, 1] - c[:, 0]).median() / 1e3:.2f}, last end {(c[:, 3].max() - t0) / 1e3:.2f}")
    results.append({"case": f"trace ctx={ctx} T={t} b={batch} page={page}", "stamps": s.tolist()})


def sweep(flush: torch.Tensor, ctx: int, t: int, batch: int, results: list[dict], rounds: int) -> None:
    """The default path at fixed split counts beside the rule's count, one row."""
    pool = make_pool(4 * ctx * batch + 64, 16, HKV, D)
    prob = Problem(pool, batch, ctx, t, HQ)
    cuda = _backend() != "triton"
    run = prob.cuda if cuda else prob.triton
    entries = [Entry("sweep", "default", prob.ours(), prob.int8_bytes, float("nan"))]
    for s in (1, 2, 4, 8, 16, 33, 66, 132, 264):
        entries.append(Entry("sweep", f"splits={s}", run(num_splits=s), prob.int8_bytes, float("nan")))
    for e in entries:
        e.fn()
        e.err = prob.error()
    time_entries(entries, flush, rounds)
    print(f"ctx={ctx} T={t} b={batch} ({'CUDA' if cuda else 'Triton'}): µs, error")
    for e in entries:
        us = statistics.median(e.times)
        print(f"  {e.provider:<12} {us:8.1f}  {e.err:.1e}", flush=True)
        results.append({"case": f"sweep ctx={ctx} T={t} b={batch} {e.provider}", "us": us, "err": e.err})


@torch.inference_mode()
def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rule", action="store_true")
    mode.add_argument("--trace", action="store_true")
    mode.add_argument("--sweep", action="store_true")
    ap.add_argument("--ctx", type=int, default=100_000)
    ap.add_argument("--t", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s", flush=True)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    results: list[dict] = [{"case": "copy", "GBps": bw}]
    if args.rule:
        rule(flush, bw, results, args.rounds)
    elif args.trace:
        trace(flush, args.ctx, args.t, args.batch, args.page, results)
    else:
        sweep(flush, args.ctx, args.t, args.batch, results, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
