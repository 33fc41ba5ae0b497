"""Benchmark: lookup drafting on the GPU (CUDA-graph replay, L2 flushed before each).

    python -m kernels.lookup_scan.bench [--sweep] [--vllm-ref .vllm_ref] [--baseline .baseline]
    python -m kernels.lookup_scan.bench --precompile [--workers 16]

``--sweep`` first times the candidate tile configs (SWEEP) on every row of the table (--sizes x B
1/8 x n 5-5/6-12 x quote/vocab 8) with the before and vLLM kernels in the same rows: a first pass
over all rows, then second passes (configs in reverse order) until ``--until`` (epoch seconds);
``--sweep-only`` skips the table.  ``--precompile`` compiles every launch this bench and the GPU
tests make in parallel processes (Triton's on-disk cache is shared), then exits.

Providers: ours (one launch); before (the same launch through an earlier copy of
kernels/lookup_scan/triton.py in the ``--baseline`` folder, ignored by git); vLLM 0.32.0's V2 n-gram speculator kernels (_ngram_scan_kernel +
_ngram_finalize_kernel, copied into an ignored folder, never committed; max_model_len set to the
history capacity, its most favourable setting); the serial torch reference on the CPU.
Histories: "quote" = vocab 150K with copied spans and a suffix quoting an earlier span (agent-like),
"lowent" = vocab 8 (every block has last-token hits: no early exit).  Proposals of all providers
are compared; any mismatch is printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

from kernels.lookup_scan import lookup_scan, naive_lookup_scan
from kernels.lookup_scan.triton import CANDIDATES, DEFAULT, candidate, lookup_scan_fwd, workspace_numel, zero_outputs
from kernels.timing import time_graph

K_DRAFT = 7


@triton.jit
def _empty_kernel(x):
    pass


def load_vllm(ref_dir: Path):
    path = ref_dir / "ngram_kernels.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("vllm_ngram_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_baseline(base_dir: Path):
    path = base_dir / "lookup_scan_triton.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("lookup_scan_triton_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.lookup_scan_fwd


def histories(kind: str, B: int, S: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "lowent":
        return torch.randint(0, 8, (B, S), generator=g, dtype=torch.int32)
    tok = torch.randint(0, 150_000, (B, S), generator=g, dtype=torch.int32)
    for i_b in range(B):  # copied spans every ~100 tokens, and the suffix quotes one
        n_sp = S // 100
        src = torch.randint(0, S - 64, (n_sp,), generator=g)
        dst = torch.randint(64, S - 64, (n_sp,), generator=g)
        for s_, d_ in zip(src.tolist(), dst.tolist()):
            if s_ < d_:
                tok[i_b, d_ : d_ + 32] = tok[i_b, s_ : s_ + 32].clone()
        q = int(torch.randint(0, S // 2, (1,), generator=g))
        tok[i_b, S - 20 :] = tok[i_b, q : q + 20].clone()
    return tok


def vllm_runner(mod, tok: torch.Tensor, lens: torch.Tensor, min_n: int, max_n: int):
    B, S = tok.shape
    block_l = 256 if S >= 1024 else 128
    n_blocks = triton.cdiv(S, block_l)
    idx = torch.arange(B, device="cuda", dtype=torch.int64)
    num_sampled = torch.ones(B, device="cuda", dtype=torch.int32)
    last = tok[idx, (lens - 1).long()].to(torch.int64)
    scratch = torch.zeros(B, n_blocks, device="cuda", dtype=torch.int64)
    drafts = torch.zeros(B, K_DRAFT, device="cuda", dtype=torch.int64)

    def fn():
        mod._ngram_scan_kernel[(B, n_blocks)](
            tok, tok.stride(0), idx, lens, num_sampled, scratch, scratch.stride(0), S,
            min_n, max_n, max(1, triton.next_power_of_2(max_n)), block_l, num_warps=4, num_stages=2)
        mod._ngram_finalize_kernel[(B,)](
            tok, tok.stride(0), idx, lens, num_sampled, last, scratch, scratch.stride(0), drafts, S,
            n_blocks, K_DRAFT, max(1, triton.next_power_of_2(K_DRAFT)),
            max(1, triton.next_power_of_2(n_blocks)), num_warps=2, num_stages=1)

    return fn, drafts


SIZES = (8192, 32768, 100_000, 262_144)
TEST_S = 50_001  # tests/kernels/test_lookup_scan.py::test_candidate_configs_gpu (odd capacity)
# (NV, G, warps, programs-per-launch cap, FENCE, ORDER), kernels/lookup_scan/triton.py: tile = 32 *
# warps * G rows of 4 * NV tokens.  Candidates for the per-(B, S) rule, each with ORDER 0 and 1
# (tile issued before the length's load, behind a barrier): the two 3236c0e defaults (512- and
# 2048-token tiles, 4 warps), one-warp programs of 256 / 128 / 512 tokens (the best at 100K B1 in
# the 3236c0e sweep) and 1024-token tiles of 4 warps.  FENCE=0 is outside the memory model: not a
# candidate.
_BASES = [(1, 1, 4, 2048, 1), (4, 1, 4, 1024, 1), (2, 1, 1, 4096, 1), (1, 1, 1, 8192, 1), (4, 1, 1, 4096, 1),
          (2, 1, 4, 2048, 1)]
SWEEP = [(*b, order) for b in _BASES for order in (0, 1)]


def register_auto(path: str | None = None) -> list[str]:
    """Candidates "auto" / "auto2" from a prof.py --sweep2 pick file (path, or $HH_LOOKUP_AUTO so
    that spawned precompile workers see them too): auto = c1 with the picked tile and switches on
    the two goal tiers (100K B1's, 256K B8's); auto2 = auto plus the picked switches (not tiles) on
    the other two tiers (the one-warp tier takes row a's, the four-warp tier row b's)."""
    path = path or os.environ.get("HH_LOOKUP_AUTO")
    if not path:
        return []
    os.environ["HH_LOOKUP_AUTO"] = path
    pick = json.loads(Path(path).read_text())
    fence, c1 = CANDIDATES["c1"]
    a = {**c1[1], **pick["a"]["opts"], "TILE": tuple(pick["a"]["tile"])}
    b = {**c1[3], **pick["b"]["opts"], "TILE": tuple(pick["b"]["tile"])}
    CANDIDATES["auto"] = (fence, (c1[0], a, c1[2], b))
    CANDIDATES["auto2"] = (fence, ({**c1[0], **pick["a"]["opts"]}, a, {**c1[2], **pick["b"]["opts"]}, b))
    return ["auto", "auto2"]


def cases(sizes) -> list[tuple[int, int, int, int, str]]:
    """Bench rows in table order: (S, B, min_n, max_n, data kind)."""
    return [(S, B, mn, mx, kind) for S in sizes for B in (1, 8) for mn, mx in ((5, 5), (6, 12))
            for kind in ("quote", "lowent")]


def _run_variant(tok, lens, mn, mx, var, out=None):
    ws = torch.zeros(workspace_numel(tok.shape[0]), dtype=torch.int64, device="cuda")
    return lambda: lookup_scan_fwd(tok, lens, mn, mx, K_DRAFT, None, ws, out, None, var)


def precompile_jobs() -> list[tuple]:
    """One job per launch configuration this bench and the GPU tests make (ours, before, vLLM)."""
    jobs = set()
    for S in SIZES:
        for B in (1, 8):
            for mn, mx in ((5, 5), (6, 12)):
                for var in SWEEP:
                    jobs.add(("lookup", "sweep", S, B, mn, mx, var))
                for who in ("ours", "old", "vllm"):
                    jobs.add(("lookup", who, S, B, mn, mx, None))
    for mn, mx in ((5, 5), (6, 12)):
        for var in SWEEP:
            jobs.add(("lookup", "sweep", TEST_S, 8, mn, mx, var))
    return sorted(jobs, key=str)


def precompile_one(job: tuple) -> str:
    _, who, S, B, mn, mx, var = job
    tok = torch.zeros(B, S, dtype=torch.int32, device="cuda")
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    if who == "sweep":
        _run_variant(tok, lens, mn, mx, var)()
    elif who == "ours":
        lookup_scan(tok, lens, mn, mx, K_DRAFT, workspace=torch.zeros(workspace_numel(B), dtype=torch.int64, device="cuda"))
    elif who == "old":
        fwd = load_baseline(Path(".baseline"))
        if fwd is not None:
            fwd(tok, lens, mn, mx, K_DRAFT, None, torch.zeros(2 * B, dtype=torch.int64, device="cuda"), None)
    else:
        mod = load_vllm(Path(".vllm_ref"))
        if mod is not None:
            vllm_runner(mod, tok, lens, mn, mx)[0]()
    torch.cuda.synchronize()
    return f"lookup {who} S={S} B={B} n{mn}-{mx} {var}"


def precompile(workers: int) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = precompile_jobs()
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for _ in ex.map(precompile_one, jobs):
            pass
    print(f"precompiled {len(jobs)} lookup_scan launches in {time.perf_counter() - t0:.0f} s ({workers} processes)",
          flush=True)


def _fmt(var) -> str:
    return "/".join(str(x) for x in var)


def _sweep_row(mod, old_fwd, case, variants, tag: str) -> None:
    S, B, mn, mx, kind = case
    tok_c = histories(kind, B, S, S + B)
    lens_c = torch.full((B,), S, dtype=torch.int32)
    d_ref, n_ref = naive_lookup_scan(tok_c, lens_c, mn, mx, K_DRAFT)
    tok, lens = tok_c.cuda(), lens_c.cuda()
    res = []
    for var in variants:
        out = (torch.full((B, K_DRAFT), -7, dtype=torch.int64, device="cuda"),
               torch.full((B,), -7, dtype=torch.int32, device="cuda"))
        t = time_graph(_run_variant(tok, lens, mn, mx, var, out))
        ok = torch.equal(out[0].cpu(), d_ref) and torch.equal(out[1].cpu(), n_ref)
        res.append(f"{_fmt(var)} {t:.2f}{'' if ok else '!'}")
    t_b = t_v = float("nan")
    if old_fwd is not None:
        ws_b = torch.zeros(2 * B, dtype=torch.int64, device="cuda")
        out_b = (torch.full((B, K_DRAFT), -7, dtype=torch.int64, device="cuda"),
                 torch.full((B,), -7, dtype=torch.int32, device="cuda"))
        t_b = time_graph(lambda: old_fwd(tok, lens, mn, mx, K_DRAFT, None, ws_b, out_b))
        if not torch.equal(out_b[0].cpu(), d_ref):
            res.append("before!")
    if mod is not None:
        fn, d_v = vllm_runner(mod, tok, lens, mn, mx)
        t_v = time_graph(fn)
        if not torch.equal(d_v.cpu(), d_ref):
            res.append("vllm!")
    print(f"sweep {tag} S={S} B={B} n{mn}-{mx} {kind}: before {t_b:.2f}  vllm {t_v:.2f} | " + "  ".join(res)
          + f" | matched {int((n_ref > 0).sum())}/{B}", flush=True)


def sweep(mod, old_fwd, sizes, until: float) -> None:
    """Pass 1: every config on every row; then pass 2 (reverse config order: each config's two
    timings sit at different places in the row) on the rows in order while time is left."""
    print("sweep: µs per call (same harness); variant NV/G/warps/cap/fence/order; '!' = proposal differs from the "
          "serial reference", flush=True)
    rows = cases(sizes)
    for case in rows:
        _sweep_row(mod, old_fwd, case, SWEEP, "p1")
    for case in rows:
        t0 = time.time()
        if until and t0 + 8.0 > until:
            print(f"sweep p2 stopped before S={case[0]} B={case[1]} n{case[2]}-{case[3]} {case[4]} (--until)")
            return
        _sweep_row(mod, old_fwd, case, SWEEP[::-1], "p2")


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--sweep", action="store_true", help="time the SWEEP configs of ours on every row first")
    ap.add_argument("--sweep-only", action="store_true", help="with --sweep: skip the table")
    ap.add_argument("--until", type=float, default=0.0, help="epoch seconds: no second sweep pass past it")
    ap.add_argument("--precompile", action="store_true", help="compile every launch in parallel, then exit")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--vllm-ref", type=Path, default=Path(".vllm_ref"))
    ap.add_argument("--baseline", type=Path, default=Path(".baseline"))
    ap.add_argument("--candidates", default="", help="launcher candidates (triton.CANDIDATES) timed beside ours")
    ap.add_argument("--cand-first", action="store_true", help="time the candidates before ours in each row "
                    "(a second pass in the other order: the column timed later reads up to ~0.3 µs higher at 100K B1)")
    ap.add_argument("--auto", default=None, help="prof.py --sweep2 pick file: registers candidates auto, auto2")
    args = ap.parse_args()
    register_auto(args.auto)
    cands = [c for c in args.candidates.split(",") if c and c != DEFAULT]
    for c in cands:
        if c not in CANDIDATES:
            raise SystemExit(f"unknown candidate {c}; known: {', '.join(CANDIDATES)}")
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.precompile:
        precompile(args.workers)
        return
    mod = load_vllm(args.vllm_ref)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if mod is None:
        print("vLLM kernel copy not found: vllm column skipped")
    old_fwd = load_baseline(args.baseline)
    if old_fwd is None:
        print("baseline kernel copy not found: before column skipped")
    if args.sweep:
        sweep(mod, old_fwd, sizes, args.until)
        if args.sweep_only:
            return
    dummy = torch.zeros(1, device="cuda")
    print(f"launch floor in this harness (one empty Triton kernel): {time_graph(lambda: _empty_kernel[(1,)](dummy)):.2f} µs")
    print(f"\nlookup scan, k={K_DRAFT}; µs per call (CUDA graph, cold L2: memset-flushed, flush time subtracted); ref = serial torch on CPU, ms")
    print(f"{'hist':>7} {'B':>2} {'n':>5} {'data':>6} | {'ours':>7} | {'before':>7} | {'vllm':>7} | {'ref ms':>8} "
          f"| vllm/ours | before/ours | same" + "".join(f" | {c:>6} vllm/{c} {c}/ours" for c in cands)
          + f"   (ours = {DEFAULT})")
    for S in sizes:
        for B in (1, 8):
            for min_n, max_n in ((5, 5), (6, 12)):
                for kind in ("quote", "lowent"):
                    tok_c = histories(kind, B, S, S + B)
                    lens_c = torch.full((B,), S, dtype=torch.int32)
                    tok, lens = tok_c.cuda(), lens_c.cuda()
                    ws = torch.zeros(workspace_numel(B), dtype=torch.int64, device="cuda")
                    out = zero_outputs(B, K_DRAFT, "cuda")  # persistent, as the engine's
                    ours = lambda: lookup_scan(tok, lens, min_n, max_n, K_DRAFT, workspace=ws, out=out)  # noqa: E731
                    cand_t = {c: _time_candidate(c, tok, lens, min_n, max_n, B, S) for c in cands} if args.cand_first else {}
                    t_ours = time_graph(ours)
                    t0 = time.perf_counter()
                    d_ref, n_ref = naive_lookup_scan(tok_c, lens_c, min_n, max_n, K_DRAFT)
                    t_ref = (time.perf_counter() - t0) * 1e3
                    same = torch.equal(out[0].cpu(), d_ref) and torch.equal(out[1].cpu(), n_ref)
                    t_b = float("nan")
                    if old_fwd is not None:
                        ws_b = torch.zeros(2 * B, dtype=torch.int64, device="cuda")
                        out_b = (torch.empty(B, K_DRAFT, dtype=torch.int64, device="cuda"),
                                 torch.empty(B, dtype=torch.int32, device="cuda"))
                        t_b = time_graph(lambda: old_fwd(tok, lens, min_n, max_n, K_DRAFT, None, ws_b, out_b))  # noqa: B023
                        same = same and torch.equal(out_b[0].cpu(), d_ref)
                    t_v = float("nan")
                    if mod is not None:
                        fn, d_v = vllm_runner(mod, tok, lens, min_n, max_n)
                        t_v = time_graph(fn)
                        same = same and torch.equal(d_v.cpu(), d_ref)
                    extra = ""
                    for c in cands:  # each candidate: its own workspace and outputs, same row and data
                        res = cand_t[c] if c in cand_t else _time_candidate(c, tok, lens, min_n, max_n, B, S)
                        if isinstance(res, str):
                            extra += f" | {c} ERR {res}"
                            continue
                        t_c, (d_c, n_c) = res
                        ok = torch.equal(d_c.cpu(), d_ref) and torch.equal(n_c.cpu(), n_ref)
                        extra += f" | {t_c:6.2f}{'' if ok else '!'} {t_v / t_c:7.2f}x {t_c / t_ours:7.2f}x"
                    print(f"{S:>7} {B:>2} {min_n:>2}-{max_n:<2} {kind:>6} | {t_ours:7.2f} | {t_b:7.2f} | {t_v:7.2f} | "
                          f"{t_ref:8.2f} | {t_v / t_ours:8.2f}x | {t_b / t_ours:10.2f}x | {same} "
                          f"(matched {int((n_ref > 0).sum())}/{B})" + extra, flush=True)


def _time_candidate(c: str, tok, lens, min_n: int, max_n: int, B: int, S: int):
    """(µs, (drafts, num_valid)) of the named launcher candidate on one row (own workspace and
    outputs), or the error's name (a launch option this Triton lacks: the row goes on)."""
    cfg, opts = candidate(c, B, S, max_n)
    ws_c = torch.zeros(workspace_numel(B), dtype=torch.int64, device="cuda")
    out_c = (torch.full((B, K_DRAFT), -7, dtype=torch.int64, device="cuda"),
             torch.full((B,), -7, dtype=torch.int32, device="cuda"))
    try:
        t_c = time_graph(lambda: lookup_scan_fwd(tok, lens, min_n, max_n, K_DRAFT, None, ws_c, out_c, None, cfg, opts))
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    return t_c, out_c


if __name__ == "__main__":
    sys.exit(main())
