"""Issue 6's goal rows in an engine's memory life cycle (H200).

    python -m kernels.verify_attention.goal [--page 1616] [--layers 16] [--rounds 5] [--json PATH]

Graphs captured after allocator events read every streaming kernel ~12% slower on the H200
(NOTES.md, sessions 5, 9, 10: the same graph flips between ~60 and ~67 µs at 100K T=1 b1 after
a 40 GB allocation is made and freed, with contiguous and random block tables alike). A serving
engine does not make such events: vLLM allocates one KV tensor per attention layer at start-up,
filling the memory left after the weights, then captures its graphs and replays them. bench.py's
table (table.py) keeps that order on one pool; this script also fills the GPU as vLLM does:

1. the device's copy bandwidth (bench.copy_bandwidth: 2 GiB, freed), the flush buffer;
2. ``--layers`` int8 per-token-head pools of equal size filling all but ``--reserve-gb`` of the
   free memory (Qwen3.8-27B: 16 full-attention layers; ``--page`` 1,616 tokens per block, vLLM's
   block size for this model with an fp32 GDN state and 7 draft tokens, or 16);
3. the problems on the middle layer's pool (random block tables, as bench.Problem), each run
   once eagerly for its error against the fp32 reference, then every graph captured (ours
   through the public default path, and vLLM 0.32.0's ``unified_attention`` as its TRITON_ATTN
   backend calls it: the anchor, in the same process);
4. ``--rounds`` rounds, each replaying every graph ``--reps`` times (L2 flushed by a read before
   each replay, as bench.time_graph): the row's time is the median over rounds of the per-round
   medians, and the spread over rounds is printed beside it.

Nothing is allocated or freed between the captures and the last replay.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kernels.verify_attention.bench import (
    D, FLUSH_BYTES, HKV, HQ, Problem, copy_bandwidth, load_vllm_unified_attention, make_pool,
)  # fmt: skip
from kernels.verify_attention.reference import Int8KVCache
from kernels.verify_attention.table import providers, time_entries

# (context, query tokens per request, requests): the two goal rows, then batch 4 (scales with bytes).
CASES = ((100_000, 8, 1), (100_000, 1, 1), (100_000, 8, 4), (100_000, 1, 4))


def record_bytes(hkv: int, d: int) -> int:
    """Bytes of one token in a layer's pool: per KV head K int8 x D, its fp32 scale, V, its scale."""
    return hkv * 2 * (d + 4)


def layer_tokens(free_bytes: int, layers: int, reserve_bytes: int, hkv: int, d: int) -> int:
    """Tokens per layer pool when `layers` equal pools fill all but `reserve_bytes` of free memory.
    A pool must hold 4x the largest case's keys (bench.py's pools do too): the problems draw their
    pages at random from the whole pool, as an engine's block tables do after some churn."""
    tokens = (free_bytes - reserve_bytes) // layers // record_bytes(hkv, d)
    if tokens < 4 * max(c[0] * c[2] for c in CASES):
        raise ValueError(f"{layers} pools in {free_bytes / 1e9:.1f} GB leave {tokens} tokens per layer: "
                         "too few for the goal rows (lower --layers or --reserve-gb)")
    return tokens


def layer_pools(layers: int, page: int, reserve_bytes: int) -> list[Int8KVCache]:
    free, _ = torch.cuda.mem_get_info()
    tokens = layer_tokens(free, layers, reserve_bytes, HKV, D)
    return [make_pool(tokens, page, HKV, D) for _ in range(layers)]


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page", type=int, default=1616, help="tokens per block (vLLM's for this model: 1616)")
    ap.add_argument("--layers", type=int, default=16, help="per-layer pools filling the GPU")
    ap.add_argument("--reserve-gb", type=float, default=10.0, help="memory left free (references, graphs)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30, help="replays per graph and round")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    bw = copy_bandwidth()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    vllm = None if args.no_vllm else load_vllm_unified_attention()
    if vllm is None and not args.no_vllm:
        raise SystemExit("vLLM reference files not found: set VLLM_REF_DIR (see bench.py's docstring)")
    pools = layer_pools(args.layers, args.page, int(args.reserve_gb * 2**30))
    pool = pools[len(pools) // 2]
    gb = pool.raw.untyped_storage().nbytes() / 1e9
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s; {args.layers} layer pools of "
          f"{gb:.2f} GB (page {args.page}); the problems on layer {len(pools) // 2}", flush=True)

    # Every provider run once (its error), then every graph captured, then the rounds (table.py).
    opts = argparse.Namespace(no_mma=True, triton=False, no_sdpa=True)
    probs: dict[str, Problem] = {}
    entries = []
    for ctx, t, b in CASES:
        label = f"ctx={ctx} T={t} b={b} page={args.page}"
        probs[label] = Problem(pool, b, ctx, t, HQ)
        entries += providers(probs[label], label, opts, vllm, None)
    time_entries(entries, flush, rounds=args.rounds, reps=args.reps)

    print(f"\n{'case':<34} {'vllm us':>9} {'ours us':>8} {'ours rounds':>13} {'GB/s':>6} {'% copy':>7} "
          f"{'vs vllm':>8}  err ours / vllm")
    by = {(e.label, e.provider): e for e in entries}
    rows = []
    for label, prob in probs.items():
        o, v = by[(label, "ours")], by.get((label, "vllm"))
        ours = statistics.median(o.times)
        base = statistics.median(v.times) if v is not None else float("nan")
        gbs = prob.int8_bytes / ours / 1e3
        print(f"{label:<34} {base:9.1f} {ours:8.1f} {min(o.times):>6.1f}-{max(o.times):<6.1f} {gbs:6.0f} "
              f"{100 * gbs / bw:6.1f}% {base / ours:7.1f}x  {o.err:.1e} / {v.err if v else float('nan'):.1e}",
              flush=True)
        rows += [{"case": label, "provider": e.provider, "err": e.err, "us": statistics.median(e.times),
                  "rounds": e.times, "bytes": e.nbytes, "copy_GBps": bw} for e in (o, v) if e is not None]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
