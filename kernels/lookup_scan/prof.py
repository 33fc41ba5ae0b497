"""Where the time goes on the issue #7 goal rows: variants timed side by side (bench harness).

    python -m kernels.lookup_scan.prof --precompile [--workers 16]
    python -m kernels.lookup_scan.prof --time [--passes 2]
    python -m kernels.lookup_scan.prof --eager ROW VARIANT     # a few eager launches, for ncu
    python -m kernels.lookup_scan.prof --ab [--sizes ...]      # fold protocols on every bench row

Rows: a = 100K B1 n6-12 (goal <= 3 µs), b = 256K B8 n5-5 (goal >= 2x vLLM), each on both
histories.  Variants: config (bench.SWEEP layout) and kernel switches (triton.lookup_scan_fwd
``opts``); FOLD=0 (no atomic fold, no draft) and SUFFIX_AT_S=1 (suffix read at the buffer's end,
not after the length: the bench's histories are full) are timing only, their proposals are not
checked; every other variant's proposals are compared with the serial reference ('!' = differs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kernels.lookup_scan.bench import K_DRAFT, histories, load_baseline, load_vllm, vllm_runner
from kernels.lookup_scan.reference import naive_lookup_scan
from kernels.timing import time_graph

ROWS = {  # name: (S, B, min_n, max_n)
    "a": (100_000, 1, 6, 12),
    "b": (262_144, 8, 5, 5),
}
_A, _B = (2, 1, 1, 4096, 1, 0), (4, 1, 4, 1024, 1, 0)
_A4, _B4 = (2, 1, 1, 4096, 4, 0), (4, 1, 4, 1024, 4, 0)
_SC = {"SPREAD": 1, "COVER": 1}
# name: (config, opts); timing-only names end in '~'.  Session 4 (2026-11-30): where row a's time goes
# under c5 (whose 100K B1 tier is c1's): the fold (nofold~), the length -> suffix dependency (the
# suffix read at the buffer's end, sfx~; the bench's histories are full so the proposals stand),
# both, FENCE 1; row b: c5's tile and its scan alone.  The session-3 variant lists are in NOTES.md.
_B5 = (1, 4, 4, 1024, 4, 0)
_F2H3 = {**_SC, "FAST": 2, "HIT": 3}
VARIANTS = {
    "a": {
        "c5": (_A4, _SC),
        "nofold~": (_A4, {**_SC, "FOLD": 0}),
        "sfx~": (_A4, {**_SC, "SUFFIX_AT_S": 1}),
        "nofold sfx~": (_A4, {**_SC, "FOLD": 0, "SUFFIX_AT_S": 1}),
        "F1": (_A, _SC),
        # session 6: POLL (per-program slots, a polling last program) over tiles (NV/G/warps): fewer,
        # larger programs leave the poller fewer slots to read
        **{f"poll {nv}/1/{w}": ((nv, 1, w, 4096, 4, 0), {**_SC, "POLL": 1})
           for nv, w in ((2, 1), (4, 1), (2, 2), (4, 2), (2, 4), (4, 4))},
    },
    "b": {
        "c5": (_B5, _F2H3),
        "poll": (_B5, {**_F2H3, "POLL": 1}),
        "nofold~": (_B5, {**_F2H3, "FOLD": 0}),
        "sfx~": (_B5, {**_F2H3, "SUFFIX_AT_S": 1}),
        "c1": (_B4, _SC),
    },
}


# Sweep 2 (2026-11-30, session 4): both goal rows over tiles x switches, all on c1's FENCE 4, SPREAD
# and COVER (cap = the goal row's grid, so COVER holds).  Switches: HIT 1 (min of XORs) / 2 (none) /
# 3 (the first MIN_N tokens), FAST 1 (row-local keys) / 2 (XOR-OR scoring when MIN_N == MAX_N),
# EDGE_ONLY, MAXNREG.  Tiles are (NV, G, warps).
A_TILES = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2), (4, 1, 2)]
A_SWITCHES = {"h0": {}, "h1": {"HIT": 1}, "h3": {"HIT": 3}, "f1h1": {"FAST": 1, "HIT": 1},
              "f1h3": {"FAST": 1, "HIT": 3}, "h3e": {"HIT": 3, "EDGE_ONLY": 1}}  # fmt: skip
B_TILES = [(4, 1, 4), (2, 1, 4), (4, 1, 2), (4, 2, 2), (1, 4, 4), (4, 1, 8), (4, 2, 1), (4, 1, 1)]
B_SWITCHES = {"c1": {}, "f2h1": {"FAST": 2, "HIT": 1}, "f2h3": {"FAST": 2, "HIT": 3}, "f2h0": {"FAST": 2},
              "f2h2": {"FAST": 2, "HIT": 2}, "f1h1r64": {"FAST": 1, "HIT": 1, "MAXNREG": 64}}  # fmt: skip


def sweep2_variants() -> dict[str, dict[str, tuple]]:
    """row -> {name: (config, opts)} for --sweep2."""
    from kernels.lookup_scan.triton import block_tokens

    out: dict[str, dict[str, tuple]] = {}
    for row, tiles, switches in (("a", A_TILES, A_SWITCHES), ("b", B_TILES, B_SWITCHES)):
        S, B, _, _ = ROWS[row]
        out[row] = {}
        for tile in tiles:
            # the goal row's grid; on a's tier (B * S <= 128K) every (B, S) so that COVER always holds
            cap = B * -(-S // block_tokens(tile))
            if row == "a":
                cap = max(cap, (1 << 17) // block_tokens(tile))
            for name, sw in switches.items():
                out[row][f"{'/'.join(map(str, tile))} {name}"] = ((*tile, cap, 4, 0), {**_SC, **sw})
    return out


def sweep2(passes: int, pick_path: str | None) -> None:
    """Time every sweep-2 variant on both goal rows and histories (passes alternate the order),
    before and vLLM in the same rows; pick per row by the rule in NOTES.md (2026-11-30, session 4):
    eligible = identical proposals in every timing; a: lowest mean time; b: lowest worst ratio
    time / vLLM over the two histories.  Writes {"a"|"b": {"tile": [NV, G, warps, cap, ORDER],
    "opts": {...}}} to pick_path (bench.py --auto)."""
    import json
    import statistics

    grid = sweep2_variants()
    times: dict[tuple[str, str, str], list[float]] = {}
    bad: set[tuple[str, str]] = set()
    vllm_t: dict[tuple[str, str], list[float]] = {}
    for p, row, kind, res, t_b, t_v in _cells(grid, passes):
        for name, (t, ok, err, _) in res.items():
            if err:
                print(f"ERR {row} {name}: {err}", flush=True)
            if err or not ok:
                bad.add((row, name))
            if t is not None:
                times.setdefault((row, name, kind), []).append(t)
        vllm_t.setdefault((row, kind), []).append(t_v)
        print(f"sweep2 pass {p + 1} row {row} {kind:6s} before {t_b:.2f} vllm {t_v:.2f}", flush=True)
    picks = {}
    for row in ROWS:
        print(f"\nsweep2 row {row} ({'/'.join(map(str, ROWS[row]))}): µs quote | µs vocab 8 (passes) | score", flush=True)
        scored = []
        for name in grid[row]:
            q, v = times.get((row, name, "quote"), []), times.get((row, name, "lowent"), [])
            if not q or not v:
                continue
            if row == "a":
                score = statistics.mean(q + v)
            else:
                score = max(statistics.mean(q) / statistics.mean(vllm_t[row, "quote"]),
                            statistics.mean(v) / statistics.mean(vllm_t[row, "lowent"]))
            ok = (row, name) not in bad
            scored.append((score, name, ok))
            print(f"  {name:18s} {' '.join(f'{x:.2f}' for x in q)} | {' '.join(f'{x:.2f}' for x in v)} | "
                  f"{score:.3f}{'' if ok else ' !'}", flush=True)
        best = min((s for s in scored if s[2]), default=None)
        if best is not None:
            config, opts = grid[row][best[1]]
            picks[row] = {"tile": [*config[:4], config[5]], "opts": {k: v for k, v in opts.items()}}
            print(f"sweep2 pick {row}: {best[1]} score {best[0]:.3f}; vLLM "
                  + ", ".join(f"{k} {statistics.mean(vllm_t[row, k]):.2f}" for k in ("quote", "lowent")), flush=True)
    if pick_path and len(picks) == 2:
        Path(pick_path).write_text(json.dumps(picks, indent=1))


def _setup(row: str, kind: str):
    S, B, mn, mx = ROWS[row]
    tok_c = histories(kind, B, S, S + B)
    lens_c = torch.full((B,), S, dtype=torch.int32)
    return tok_c, lens_c, tok_c.cuda(), lens_c.cuda(), mn, mx


def _fn(tok, lens, mn, mx, config, opts, out):
    from kernels.lookup_scan.triton import lookup_scan_fwd

    from kernels.lookup_scan.triton import workspace_numel, zero_outputs

    ws = torch.zeros(workspace_numel(tok.shape[0]), dtype=torch.int64, device="cuda")
    # persistent zero outputs (an engine's), allocated here: the launcher's own would add a memset
    # node to every graph replay
    out = out if out is not None else zero_outputs(tok.shape[0], K_DRAFT, "cuda")
    return lambda: lookup_scan_fwd(tok, lens, mn, mx, K_DRAFT, None, ws, out, None, config, opts)


def _compile_one(job) -> str:
    from kernels.lookup_scan.bench import register_auto

    register_auto()  # spawned workers: candidates auto / auto2 from $HH_LOOKUP_AUTO, if set
    try:
        return _compile(job)
    except Exception as e:  # noqa: BLE001 (one variant failing to compile must not stop the rest)
        return f"FAILED {job}: {type(e).__name__}: {str(e)[:300]}"


def _compile(job) -> str:
    if job[0] == "bench":  # ours / before / vLLM launches of a bench row
        from kernels.lookup_scan.bench import precompile_one

        return precompile_one(job[1])
    S, B, mn, mx, config, opts = job
    tok = torch.zeros(B, S, dtype=torch.int32, device="cuda")
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    _fn(tok, lens, mn, mx, config, dict(opts) if opts else None, None)()
    torch.cuda.synchronize()
    return str(job)


def precompile(workers: int, fences=(1, 3, 4), variants: bool = True, candidates=(), sweep2_grid: bool = False) -> None:
    """Variants of the goal rows; every bench row with the rule's config and each FENCE (--ab) or
    each named launcher candidate (bench --candidates), before and vLLM; the GPU tests' launches."""
    import concurrent.futures as cf
    import multiprocessing as mp

    from kernels.lookup_scan.bench import SIZES
    from kernels.lookup_scan.triton import candidate, default_config

    jobs = [(*ROWS[r], *VARIANTS[r][n]) for r in VARIANTS for n in VARIANTS[r]] if variants else []
    if sweep2_grid:
        grid = sweep2_variants()
        jobs += [(*ROWS[r], *grid[r][n]) for r in grid for n in grid[r]]
    for S in SIZES:
        for B in (1, 8):
            for mn, mx in ((5, 5), (6, 12)):
                base = default_config(B, S)
                if not candidates:
                    jobs += [(S, B, mn, mx, (*base[:4], f, base[5]), None) for f in fences]
                jobs += [(S, B, mn, mx, *candidate(c, B, S, mx)) for c in candidates]
                jobs += [("bench", ("lookup", who, S, B, mn, mx, None)) for who in ("old", "vllm")]
    from kernels.lookup_scan.bench import TEST_S, precompile_jobs

    jobs += [("bench", j) for j in precompile_jobs() if j[2] == TEST_S]  # the GPU tests' SWEEP launches
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        res = list(ex.map(_compile_one, jobs))
    for r in res:
        if r.startswith("FAILED"):
            print(r, flush=True)
    print(f"precompiled {len(jobs)} variants in {time.perf_counter() - t0:.0f} s", flush=True)


def _cells(grid: dict[str, dict[str, tuple]], passes: int):
    """Yield (pass, row, kind, {name: (µs or None, proposals ok, error, registers)}, before µs, vLLM µs) for
    every goal row and history: each variant of grid[row] timed in the same process (order reversed
    on odd passes), then the baseline kernel and vLLM's in the same row.  Timing-only names ('~')
    count as ok."""
    mod, old_fwd = load_vllm(Path(".vllm_ref")), load_baseline(Path(".baseline"))
    for p in range(passes):
        for row in ROWS:
            for kind in ("quote", "lowent"):
                tok_c, lens_c, tok, lens, mn, mx = _setup(row, kind)
                d_ref, n_ref = naive_lookup_scan(tok_c, lens_c, mn, mx, K_DRAFT)
                B = tok.shape[0]
                names = list(grid[row]) if p % 2 == 0 else list(grid[row])[::-1]
                res = {}
                for name in names:
                    config, opts = grid[row][name]
                    out = (torch.full((B, K_DRAFT), -7, dtype=torch.int64, device="cuda"),
                           torch.full((B,), -7, dtype=torch.int32, device="cuda"))
                    try:
                        t = time_graph(_fn(tok, lens, mn, mx, config, opts, out))
                    except Exception as e:  # noqa: BLE001 (e.g. a launch option this Triton lacks: reported)
                        res[name] = (None, False, f"{type(e).__name__}: {str(e)[:100]}", "")
                        continue
                    ok = name.endswith("~") or (torch.equal(out[0].cpu(), d_ref) and torch.equal(out[1].cpu(), n_ref))
                    res[name] = (t, ok, "", _regs())
                ws_b = torch.zeros(2 * B, dtype=torch.int64, device="cuda")
                t_b = time_graph(lambda: old_fwd(tok, lens, mn, mx, K_DRAFT, None, ws_b, None)) if old_fwd else float("nan")  # noqa: B023
                t_v = time_graph(vllm_runner(mod, tok, lens, mn, mx)[0]) if mod else float("nan")
                yield p, row, kind, res, t_b, t_v


def time_rows(passes: int) -> None:
    regs = {}
    for p, row, kind, res, t_b, t_v in _cells(VARIANTS, passes):
        cell = {n: f"ERR({e})" if e else f"{t:.2f}{'' if ok else '!'}" for n, (t, ok, e, _) in res.items()}
        regs.update({(row, n): r for n, (*_, r) in res.items() if kind == "quote"})
        print(f"pass {p + 1} row {row} {kind:6s} before {t_b:.2f} vllm {t_v:.2f} | "
              + "  ".join(f"{k} {cell[k]}" for k in VARIANTS[row]), flush=True)
    print("registers (quote launch): " + "  ".join(f"{r}:{n} {v}" for (r, n), v in regs.items()), flush=True)


def stamp_rows(replays: int = 30, names: tuple[str, ...] = ("c5",)) -> None:
    """%globaltimer stamps (STAMPS=1) of the named candidates' launches (default c5) on both goal
    rows and histories, each replay a cold one (a graph of the 96 MB memset and the kernel): when
    programs start, when their length and their scan are done, when their ticket returns (POLL: the
    finisher's poll ends, both stamps), and the finisher's max and draft reads.
    Medians over replays, µs after the first program's start; time_graph of the kernel with and
    without stamps beside them (the stamps' own cost)."""
    import statistics

    from kernels.lookup_scan.triton import block_tokens, candidate, lookup_scan_fwd, workspace_numel, zero_outputs

    scrub = torch.empty(96 << 20, dtype=torch.int8, device="cuda")
    for row, name in ((r, n) for r in ("a", "b") for n in names):
        for kind in ("quote", "lowent"):
            _, _, tok, lens, mn, mx = _setup(row, kind)
            # the named launcher default at this row (c5 there = VARIANTS[row]["c5"])
            config, opts = candidate(name, tok.shape[0], tok.shape[1], mx)
            B = tok.shape[0]
            P = min(-(-tok.shape[1] // block_tokens(config)), max(8, config[3] // B))  # the launcher's grid
            st = torch.zeros(B, P, 8, dtype=torch.int64, device="cuda")
            ws = torch.zeros(workspace_numel(B), dtype=torch.int64, device="cuda")
            sw = {**opts, "STAMPS": 1}
            out = zero_outputs(B, K_DRAFT, "cuda")

            def fn(sw=sw, ws=ws, st=st, tok=tok, lens=lens, mn=mn, mx=mx, out=out):
                return lookup_scan_fwd(tok, lens, mn, mx, K_DRAFT, None, ws, out, None, config, sw, stamps=st)

            t_st = time_graph(fn)
            t_plain = time_graph(_fn(tok, lens, mn, mx, config, opts, None))
            g = torch.cuda.CUDAGraph()
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                scrub.zero_()
                fn()
            cols: dict[str, list[float]] = {}
            for _ in range(replays):
                st.zero_()
                g.replay()
                torch.cuda.synchronize()
                x = st.cpu().double()
                t0 = x[..., 0].min()
                us = (x - t0) / 1e3  # [B, P, 8] µs after the first start
                fin = x[..., 4] > 0  # [B, P] the finishers
                vals = {
                    "start med": us[..., 0].median(), "start max": us[..., 0].max(),
                    "len-start med": (us[..., 1] - us[..., 0]).median(),
                    "scan done med": us[..., 2].median(), "scan done max": us[..., 2].max(),
                    "ticket-scan med": (us[..., 3] - us[..., 2]).median(),
                    "ticket max": us[..., 3].max(),
                    "fin ticket": us[..., 3][fin].max(), "fin max read": (us[..., 4] - us[..., 3])[fin].max(),
                    "fin draft read": (us[..., 5] - us[..., 4])[fin].max(), "fin done": us[..., 5][fin].max(),
                }
                for k, v in vals.items():
                    cols.setdefault(k, []).append(float(v))
            print(f"stamps {name} row {row} {kind:6s} (P={P}, B={B}) graph µs: plain {t_plain:.2f}, stamped {t_st:.2f} | "
                  + "  ".join(f"{k} {statistics.median(v):.2f}" for k, v in cols.items()), flush=True)


def _regs() -> str:
    from kernels.lookup_scan.triton import LAST_KERNEL

    k = LAST_KERNEL[0]
    try:
        return f"{k.n_regs}r/{k.n_spills}s"
    except Exception:  # noqa: BLE001 (a Triton without the attributes: the timing still stands)
        return "?"


def eager(row: str, kind: str, name: str) -> None:
    _, _, tok, lens, mn, mx = _setup(row, kind)
    config, opts = VARIANTS[row][name]
    fn = _fn(tok, lens, mn, mx, config, opts, None)
    for _ in range(4):
        fn()
    torch.cuda.synchronize()


def ab(sizes, fences=(1, 3, 4), passes: int = 2) -> None:
    """Every bench row: the rule's config with each FENCE (fold protocol), before and vLLM in the
    same row; passes alternate the variant order."""
    from kernels.lookup_scan.bench import cases
    from kernels.lookup_scan.triton import default_config

    mod, old_fwd = load_vllm(Path(".vllm_ref")), load_baseline(Path(".baseline"))
    print("ab: µs per call; FENCE f = the rule's config with the fold protocol f; '!' = proposals differ", flush=True)
    for case in cases(sizes):
        S, B, mn, mx, kind = case
        tok_c = histories(kind, B, S, S + B)
        lens_c = torch.full((B,), S, dtype=torch.int32)
        d_ref, n_ref = naive_lookup_scan(tok_c, lens_c, mn, mx, K_DRAFT)
        tok, lens = tok_c.cuda(), lens_c.cuda()
        base = default_config(B, S)
        res = {f: [] for f in fences}
        for p in range(passes):
            for f in (fences if p % 2 == 0 else fences[::-1]):
                config = (*base[:4], f, base[5])
                out = (torch.full((B, K_DRAFT), -7, dtype=torch.int64, device="cuda"),
                       torch.full((B,), -7, dtype=torch.int32, device="cuda"))
                t = time_graph(_fn(tok, lens, mn, mx, config, None, out))
                ok = torch.equal(out[0].cpu(), d_ref) and torch.equal(out[1].cpu(), n_ref)
                res[f].append(f"{t:.2f}{'' if ok else '!'}")
        ws_b = torch.zeros(2 * B, dtype=torch.int64, device="cuda")
        t_b = time_graph(lambda: old_fwd(tok, lens, mn, mx, K_DRAFT, None, ws_b, None)) if old_fwd else float("nan")  # noqa: B023
        t_v = time_graph(vllm_runner(mod, tok, lens, mn, mx)[0]) if mod else float("nan")
        print(f"ab S={S} B={B} n{mn}-{mx} {kind:6s} cfg {'/'.join(map(str, base))} | before {t_b:.2f} vllm {t_v:.2f} | "
              + "  ".join(f"F{f} {' '.join(res[f])}" for f in fences), flush=True)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--eager", nargs=3, metavar=("ROW", "KIND", "VARIANT"))
    ap.add_argument("--ab", action="store_true")
    ap.add_argument("--sizes", default="8192,32768,100000,262144")
    ap.add_argument("--fences", default="1,3,4", help="--ab / --precompile: FENCE values")
    ap.add_argument("--no-variants", action="store_true", help="--precompile: only the --ab and GPU-test launches")
    ap.add_argument("--candidates", default="", help="--precompile: bench rows of these triton.CANDIDATES, not --fences")
    ap.add_argument("--stamps", action="store_true", help="%%globaltimer stamps of c5 on both goal rows")
    ap.add_argument("--stamp-candidates", default="c5", help="--stamps: these triton.CANDIDATES")
    ap.add_argument("--sweep2", action="store_true", help="goal rows over tiles x switches (with --precompile: compile them)")
    ap.add_argument("--pick", default=None, help="--sweep2: write the picks here (bench.py --auto)")
    ap.add_argument("--auto", default=None, help="a --sweep2 pick file: registers candidates auto, auto2")
    args = ap.parse_args()
    from kernels.lookup_scan.bench import register_auto

    register_auto(args.auto)
    fences = tuple(int(x) for x in args.fences.split(","))
    if args.precompile:
        cands = tuple(c for c in args.candidates.split(",") if c)
        precompile(args.workers, fences, not args.no_variants, cands, args.sweep2)
    elif args.sweep2:
        sweep2(args.passes, args.pick)
    if args.ab:
        ab([int(x) for x in args.sizes.split(",")], fences)
    if args.time:
        time_rows(args.passes)
    if args.stamps:
        stamp_rows(names=tuple(c for c in args.stamp_candidates.split(",") if c))
    if args.eager:
        eager(*args.eager)


if __name__ == "__main__":
    sys.exit(main())
