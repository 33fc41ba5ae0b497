"""Diagnosis of the lookup scan on the goal rows and the tiles behind the launcher's rule (H200).

    python -m kernels.lookup_scan.diag --stamps [--replays 30]
    python -m kernels.lookup_scan.diag --sweep [--sizes 8192,32768,100000,262144] [--passes 2]
    python -m kernels.lookup_scan.diag --eager ROW KIND      # a few eager launches, for ncu

Rows: a = 100K B1 n6-12 (goal <= 3 µs), b = 256K B8 n5-5 (goal >= 2x vLLM), each on both
histories (bench.histories: "quote", "lowent" = vocab 8).

``--stamps``: %globaltimer stamps (the kernel's STAMPS=1) of the default launch, each replay a
cold one (a graph of the 96 MB memset and the kernel): when programs start, when their length and
their scan are done, when their ticket returns (the polling fold: when the finisher's poll ends),
the finisher's reads and stores.  Medians over replays, µs after the first program's start, and
the launch timed with and without stamps (the stamps' own cost).
``--sweep``: the candidate tiles (SWEEP: each (NV, G, warps, cap) with and without ORDER, the
rule's switches otherwise) on every bench row, the earlier kernel (``--baseline``) and vLLM in the
same rows; passes alternate the tile order.  This is the measurement behind config.RULE's tiers.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kernels.lookup_scan.bench import K_DRAFT, cases, histories, load_baseline, load_vllm, run_launch, vllm_runner
from kernels.lookup_scan.config import Launch, block_tokens, default_launch
from kernels.lookup_scan.reference import naive_lookup_scan
from kernels.lookup_scan.triton import lookup_scan_fwd, workspace_numel, zero_outputs
from kernels.timing import time_graph

ROWS = {"a": (100_000, 1, 6, 12), "b": (262_144, 8, 5, 5)}  # name: (S, B, min_n, max_n)
# Candidate tiles for the per-(B, S) rule (2126580's sweep): the 3236c0e defaults (512- and
# 2048-token tiles, 4 warps), one-warp programs of 256 / 128 / 512 tokens and 1024-token tiles of 4
# warps, each with ORDER off and on.
SWEEP = [Launch(nv, g, w, cap, order=o) for nv, g, w, cap in
         ((1, 1, 4, 2048), (4, 1, 4, 1024), (2, 1, 1, 4096), (1, 1, 1, 8192), (4, 1, 1, 4096), (2, 1, 4, 2048))
         for o in (False, True)]  # fmt: skip


def _row(row: str, kind: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    S, B, mn, mx = ROWS[row]
    return histories(kind, B, S, S + B).cuda(), torch.full((B,), S, dtype=torch.int32, device="cuda"), mn, mx


def stamps(replays: int) -> None:
    scrub = torch.empty(96 << 20, dtype=torch.int8, device="cuda")
    for row in ROWS:
        for kind in ("quote", "lowent"):
            tok, lens, mn, mx = _row(row, kind)
            B, S = tok.shape
            launch = default_launch(B, S, mx)
            P = min(-(-S // block_tokens(launch)), max(8, launch.cap // B))  # the launcher's grid
            st = torch.zeros(B, P, 8, dtype=torch.int64, device="cuda")
            ws = torch.zeros(workspace_numel(B), dtype=torch.int64, device="cuda")
            out = zero_outputs(B, K_DRAFT, "cuda")  # persistent, as the engine's

            def fn(stamped: bool, tok=tok, lens=lens, mn=mn, mx=mx, ws=ws, out=out, st=st) -> object:
                return lookup_scan_fwd(tok, lens, mn, mx, K_DRAFT, None, ws, out, None, None, st if stamped else None)

            t_st, t_plain = time_graph(lambda: fn(True)), time_graph(lambda: fn(False))  # noqa: B023
            g = torch.cuda.CUDAGraph()
            fn(True)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                scrub.zero_()
                fn(True)
            cols: dict[str, list[float]] = {}
            for _ in range(replays):
                st.zero_()
                g.replay()
                torch.cuda.synchronize()
                x = st.cpu().double()
                us = (x - x[..., 0].min()) / 1e3  # [B, P, 8] µs after the first start
                fin = x[..., 4] > 0  # [B, P] the finishers
                vals = {
                    "start med": us[..., 0].median(), "start max": us[..., 0].max(),
                    "len-start med": (us[..., 1] - us[..., 0]).median(),
                    "scan done med": us[..., 2].median(), "scan done max": us[..., 2].max(),
                    "ticket-scan med": (us[..., 3] - us[..., 2]).median(), "ticket max": us[..., 3].max(),
                    "fin ticket": us[..., 3][fin].max(), "fin read": (us[..., 4] - us[..., 3])[fin].max(),
                    "fin store": (us[..., 5] - us[..., 4])[fin].max(), "fin done": us[..., 5][fin].max(),
                }  # fmt: skip
                for k, v in vals.items():
                    cols.setdefault(k, []).append(float(v))
            print(f"stamps row {row} {kind:6s} (P={P}, B={B}) graph µs: plain {t_plain:.2f}, stamped {t_st:.2f} | "
                  + "  ".join(f"{k} {statistics.median(v):.2f}" for k, v in cols.items()), flush=True)


def sweep(sizes: list[int], passes: int, vllm_ref: Path, baseline: Path) -> None:
    mod, old_fwd = load_vllm(vllm_ref), load_baseline(baseline)
    print("sweep: µs per call (bench harness); tile NV/G/warps/cap/order; '!' = proposals differ", flush=True)
    for S, B, mn, mx, kind in cases(sizes):
        tok_c = histories(kind, B, S, S + B)
        lens_c = torch.full((B,), S, dtype=torch.int32)
        d_ref, n_ref = naive_lookup_scan(tok_c, lens_c, mn, mx, K_DRAFT)
        tok, lens = tok_c.cuda(), lens_c.cuda()
        rule = default_launch(B, S, mx)
        res: dict[str, list[str]] = {}
        for p in range(passes):
            for tile in SWEEP if p % 2 == 0 else SWEEP[::-1]:
                launch = rule.with_(nv=tile.nv, g=tile.g, warps=tile.warps, cap=tile.cap, order=tile.order)
                out = (torch.full((B, K_DRAFT), -7, dtype=torch.int64, device="cuda"),
                       torch.full((B,), -7, dtype=torch.int32, device="cuda"))  # fmt: skip
                t = time_graph(run_launch(tok, lens, mn, mx, launch, out))
                ok = torch.equal(out[0].cpu(), d_ref) and torch.equal(out[1].cpu(), n_ref)
                name = f"{tile.nv}/{tile.g}/{tile.warps}/{tile.cap}/{int(tile.order)}"
                res.setdefault(name, []).append(f"{t:.2f}{'' if ok else '!'}")
        ws_b = torch.zeros(workspace_numel(B), dtype=torch.int64, device="cuda")
        t_b = time_graph(lambda: old_fwd(tok, lens, mn, mx, K_DRAFT, None, ws_b, None)) if old_fwd else float("nan")  # noqa: B023
        t_v = time_graph(vllm_runner(mod, tok, lens, mn, mx)[0]) if mod else float("nan")
        print(f"S={S} B={B} n{mn}-{mx} {kind:6s} rule {rule.nv}/{rule.g}/{rule.warps}/{rule.cap}/{int(rule.order)} | "
              f"before {t_b:.2f} vllm {t_v:.2f} | " + "  ".join(f"{k} {' '.join(v)}" for k, v in res.items()), flush=True)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--stamps", action="store_true")
    mode.add_argument("--sweep", action="store_true")
    mode.add_argument("--eager", nargs=2, metavar=("ROW", "KIND"))
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--sizes", default="8192,32768,100000,262144")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--vllm-ref", type=Path, default=Path(".vllm_ref"))
    ap.add_argument("--baseline", type=Path, default=Path(".baseline"))
    args = ap.parse_args()
    if args.stamps:
        stamps(args.replays)
    elif args.sweep:
        sweep([int(x) for x in args.sizes.split(",")], args.passes, args.vllm_ref, args.baseline)
    else:
        tok, lens, mn, mx = _row(*args.eager)
        ws = torch.zeros(workspace_numel(tok.shape[0]), dtype=torch.int64, device="cuda")
        out = zero_outputs(tok.shape[0], K_DRAFT, "cuda")
        for _ in range(4):
            lookup_scan_fwd(tok, lens, mn, mx, K_DRAFT, None, ws, out)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
