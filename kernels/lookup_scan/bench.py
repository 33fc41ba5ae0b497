"""Benchmark: lookup drafting on the GPU (CUDA-graph replay, L2 flushed before each).

    python -m kernels.lookup_scan.bench [--sizes ...] [--vllm-ref .vllm_ref] [--baseline .baseline]
    python -m kernels.lookup_scan.bench --precompile [--workers 16]

The table: --sizes x B 1/8 x n 5-5/6-12 x quote/vocab 8, every provider's proposals compared with
the serial reference.  ``--precompile`` compiles every launch this bench and the GPU tests make in
parallel processes (Triton's on-disk cache is shared), then exits.  The tile sweep behind the
launcher's rule and the per-program stamps are diag.py's.

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
import sys
import time
from pathlib import Path

import torch
import triton

from kernels.lookup_scan import lookup_scan, naive_lookup_scan
from kernels.lookup_scan.config import LARGE, LARGE_SHORT, RULE, Launch
from kernels.lookup_scan.triton import lookup_scan_fwd, workspace_numel, zero_outputs
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
TEST_S = 50_001  # tests/kernels/test_lookup_scan.py::test_rule_launches_gpu (odd capacity)
# Every launch the rule can pick (tests/kernels/test_lookup_scan.py runs each at TEST_S).
RULE_LAUNCHES: tuple[Launch, ...] = (*(launch for _, launch in RULE), LARGE, LARGE_SHORT)


def cases(sizes) -> list[tuple[int, int, int, int, str]]:
    """Bench rows in table order: (S, B, min_n, max_n, data kind)."""
    return [(S, B, mn, mx, kind) for S in sizes for B in (1, 8) for mn, mx in ((5, 5), (6, 12))
            for kind in ("quote", "lowent")]


def run_launch(tok, lens, mn, mx, launch: Launch, out=None):
    """One launch of the given configuration (own workspace) as a closure: diag.py's sweep, the
    precompile of the tests' launches."""
    ws = torch.zeros(workspace_numel(tok.shape[0]), dtype=torch.int64, device="cuda")
    return lambda: lookup_scan_fwd(tok, lens, mn, mx, K_DRAFT, None, ws, out, None, launch)


def precompile_jobs() -> list[tuple]:
    """One job per launch configuration this bench and the GPU tests make (ours, before, vLLM)."""
    jobs = set()
    for S in SIZES:
        for B in (1, 8):
            for mn, mx in ((5, 5), (6, 12)):
                for who in ("ours", "old", "vllm"):
                    jobs.add(("lookup", who, S, B, mn, mx, None))
    for mn, mx in ((5, 5), (6, 12)):
        for launch in RULE_LAUNCHES:
            jobs.add(("lookup", "launch", TEST_S, 8, mn, mx, launch))
    return sorted(jobs, key=str)


def precompile_one(job: tuple) -> str:
    _, who, S, B, mn, mx, var = job
    tok = torch.zeros(B, S, dtype=torch.int32, device="cuda")
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    if who == "launch":
        run_launch(tok, lens, mn, mx, var)()
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


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--precompile", action="store_true", help="compile every launch in parallel, then exit")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--vllm-ref", type=Path, default=Path(".vllm_ref"))
    ap.add_argument("--baseline", type=Path, default=Path(".baseline"))
    args = ap.parse_args()
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
    dummy = torch.zeros(1, device="cuda")
    print(f"launch floor in this harness (one empty Triton kernel): {time_graph(lambda: _empty_kernel[(1,)](dummy)):.2f} µs")
    print(f"\nlookup scan, k={K_DRAFT}; µs per call (CUDA graph, cold L2: memset-flushed, flush time subtracted); ref = serial torch on CPU, ms")
    print(f"{'hist':>7} {'B':>2} {'n':>5} {'data':>6} | {'ours':>7} | {'before':>7} | {'vllm':>7} | {'ref ms':>8} "
          f"| vllm/ours | before/ours | same")
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
                    print(f"{S:>7} {B:>2} {min_n:>2}-{max_n:<2} {kind:>6} | {t_ours:7.2f} | {t_b:7.2f} | {t_v:7.2f} | "
                          f"{t_ref:8.2f} | {t_v / t_ours:8.2f}x | {t_b / t_ours:10.2f}x | {same} "
                          f"(matched {int((n_ref > 0).sum())}/{B})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
