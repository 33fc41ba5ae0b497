"""Diagnosis of the gdn_verify defaults (H200): the tiling sweep that picks ``_default_config``.

    python -m kernels.gdn_verify.diag --sweep [--batches 8,4,1]
    python -m kernels.gdn_verify.diag --precompile [--workers 12]

``--sweep``: kernel tilings (BV, num_warps, VEC, PF, RG, KCVT) per state dtype and batch, timed
side by side in one run (bench's harness: CUDA graph, cold L2, µs per layer, ours lazy with all
T tokens replayed), the default timed again at the end of its row (same-row noise), and an
earlier commit's triton.py (``.baseline/gdn_verify_triton.py``, bench.py's before column) first.
``--precompile``: compiles, in parallel worker processes, every kernel variant that the sweep,
bench.py and the GPU tests launch (Triton's on-disk cache is shared), so a lease is not spent on
serial compiles; then exits.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import time
from pathlib import Path

import torch

from kernels.gdn_verify.bench import DTYPES, H, HV, K, V, case_ours, copy_bandwidth, inputs, load_baseline, time_graph
from kernels.gdn_verify.triton import _default_config

# Candidates (BV, warps, VEC, PF, RG, KCVT) for the rank-1 replay (u logged): only the
# [8 K-lanes x 4 V-lanes] family ((8, 1, 2) and (16, 1, 4): the defaults' rounding at every batch),
# prefetch depth / replay group size (RG=8: one group for the whole replay; fp32 (8,1,2,*,8)
# compiles to 128 registers vs 163 at RG=4) and the k conversion point.
CFGS = {
    name: [(8, 1, 2, 2, 4, 0), (8, 1, 2, 2, 8, 0), (8, 1, 2, 4, 8, 0), (8, 1, 2, 4, 8, 1),
           (8, 1, 2, 2, 8, 1), (16, 1, 4, 4, 8, 0), (16, 1, 4, 4, 8, 1), (16, 1, 4, 2, 8, 0),
           (16, 1, 4, 2, 4, 0)]
    for name in ("fp32", "bf16")
}
# The GPU tests' extra configs (tests/kernels/test_gdn_verify.py GPU_CONFIGS and their family refs).
TEST_CFGS = [(8, 1, 4, 2, 4), (8, 1, 2, 4, 8), (16, 1, 4, 4, 8), (8, 1, 2, 4, 8, 0), (16, 1, 4, 4, 8, 0),
             (8, 1, 2, 2, 4, 0), (8, 1, 4, 2, 4, 1), (8, 1, 2, 2, 8, 0), (16, 1, 4, 2, 8, 0)]


def _compile(job: tuple) -> str:
    """Launch one kernel variant once at real shapes (B=1) so that it lands in Triton's cache."""
    from kernels.gdn_verify import gdn_log_empty
    from kernels.gdn_verify.triton import gdn_verify_fwd

    mode, sd_name, cfg, out_dtype, vk, *rest = job
    log_dtype = DTYPES[rest[0]] if rest else torch.bfloat16
    sd, T = DTYPES[sd_name], 8
    if mode == "old":  # the bench's before column: cfg is the batch size there
        from pathlib import Path

        from kernels.gdn_verify.bench import case_ours, load_baseline

        case_ours(cfg, T, sd, T, fwd=load_baseline(Path(".baseline")))[0]()
        torch.cuda.synchronize()
        return f"old {sd_name} B={cfg}"
    x = inputs(1, T)
    shape = (2, HV, V, K) if vk else (2, HV, K, V)
    state = torch.zeros(shape, device="cuda").to(sd)
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    out = torch.empty(1, T, HV, V, dtype=out_dtype, device="cuda")
    log = gdn_log_empty(2, T, H, K, HV, V, log_dtype, "cuda")
    par = torch.zeros(1, dtype=torch.int32, device="cuda")
    if mode == "lazy":
        gdn_verify_fwd(**x, state=state, init_idx=one, num_k_heads=H, log=log, log_parity=par,
                       num_replay=one, out=out, config=cfg, state_vk=vk)
    elif mode == "commit":
        gdn_verify_fwd(None, None, None, None, None, x["A_log"], x["dt_bias"], state, one, num_k_heads=H,
                       log=log, log_parity=par, num_replay=one, config=cfg, state_vk=vk)
    else:
        tok = torch.zeros(1, T, dtype=torch.int32, device="cuda")
        gdn_verify_fwd(**x, state=state, init_idx=one, num_k_heads=H, tok_idx=tok,
                       out=out if out_dtype != torch.bfloat16 else None, config=cfg, state_vk=vk)
    torch.cuda.synchronize()
    return f"{mode} {sd_name} {cfg} {out_dtype} vk={vk} log={log_dtype}"


def precompile_jobs() -> list[tuple]:
    """Variants launched by bench.py, the sweep and the GPU tests."""
    bf, f32 = torch.bfloat16, torch.float32
    jobs = set()
    for name, sd in DTYPES.items():
        for B in (1, 8):
            cfg = _default_config(B, sd)
            jobs.add(("lazy", name, cfg, bf, False))  # bench
            for mode in ("lazy", "eager"):  # GPU tests (fp32 outputs)
                jobs.add((mode, name, cfg, f32, False))
        jobs.add(("eager", name, _default_config(3, sd, True), bf, True))  # bench: vs vLLM's layout
        for cfg in CFGS.get(name, []):
            jobs.add(("lazy", name, cfg, bf, False))
        if Path(".baseline/gdn_verify_triton.py").exists():
            for B in (1, 8):
                jobs.add(("old", name, B, bf, False))
    for mode in ("lazy", "eager", "commit"):  # test_real_shapes_log_variants_gpu
        jobs.add((mode, "bf16", _default_config(3, torch.bfloat16, True), f32, True))
        jobs.add((mode, "fp32", _default_config(3, f32), f32, False, "fp32"))
    for name in ("fp32", "bf16"):
        for cfg in TEST_CFGS:
            for mode in ("lazy", "eager", "commit"):
                jobs.add((mode, name, cfg, f32, False))
    return sorted(jobs, key=str)


def precompile(workers: int) -> None:
    jobs = precompile_jobs()
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for done in ex.map(_compile, jobs):
            pass
    print(f"precompiled {len(jobs)} gdn_verify variants in {time.perf_counter() - t0:.0f} s "
          f"({workers} processes)", flush=True)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sweep", action="store_true")
    mode.add_argument("--precompile", action="store_true")
    ap.add_argument("--batches", default="8,4,1")
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--workers", type=int, default=12)
    args = ap.parse_args()
    if args.precompile:
        precompile(args.workers)
        return
    T = args.T
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"copy bandwidth (read+write) {bw / 1e12:.2f} TB/s", flush=True)
    print("sweep: ours lazy r=T, µs per layer (CUDA graph, cold L2); config BV/warps/VEC/PF/RG/KCVT; "
          "before = the .baseline kernel, same row", flush=True)
    old_fn = load_baseline(Path(".baseline"))
    for B in (int(b) for b in args.batches.split(",")):
        for name, cfgs in CFGS.items():
            sd = DTYPES[name]
            cells = []
            if old_fn is not None:
                cells.append(f"before {time_graph(case_ours(B, T, sd, T, fwd=old_fn)[0]):.1f}")
            for cfg in [*cfgs, _default_config(B, sd)]:
                try:
                    t = time_graph(case_ours(B, T, sd, T, config=cfg)[0])
                    cells.append(f"{'/'.join(map(str, cfg))} {t:.1f}")
                except Exception as e:  # noqa: BLE001 (a config the compiler rejects)
                    cells.append(f"{'/'.join(map(str, cfg))} ERR {type(e).__name__}")
            dflt = "/".join(map(str, _default_config(B, sd)))
            print(f"B={B} {name} (default {dflt}) | " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
