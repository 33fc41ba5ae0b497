"""Issue 6: does the 100K b1 time depend on what the process did before? (one process)

    python -m kernels.verify_attention.diag_state

Times the shipped default (split + combine) and the split kernel alone at 100K keys, batch 1,
T = 1 and 8 (bench.py's harness: CUDA graph, L2 flushed by a read, median of three time_graph
calls), first in a fresh process, then after each kind of earlier GPU work the full table does:
the fp32 reference (bench's error()), vLLM's kernel eagerly and under graphs (if .vllm_ref is
there), torch.cuda.empty_cache(), a 40 GB allocation freed into the caching allocator (it keeps
the segment), and new problems after an empty_cache.  Prints one line per state and T.
"""

from __future__ import annotations

import statistics

import torch

from kernels.verify_attention.bench import HKV, HQ, Problem, load_vllm_unified_attention, make_pool, time_graph

CTX = 100_000


def measure(tag: str, probs: dict[int, Problem], flush: torch.Tensor) -> None:
    for t, prob in probs.items():
        d = [time_graph(prob.ours(), flush) for _ in range(3)]
        s = [time_graph(prob.cuda_variant(combine=False), flush) for _ in range(3)]
        md, ms = statistics.median(d), statistics.median(s)
        print(f"{tag:<28} T={t}: default {md:6.1f} ({min(d):.1f}-{max(d):.1f})  split-only {ms:6.1f}  "
              f"node {md - ms:+5.1f}", flush=True)


@torch.inference_mode()
def main() -> None:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    pool = make_pool(8 * CTX + 64, 16, HKV, 256)  # the main table's 800K-token pool
    probs = {t: Problem(pool, 1, CTX, t, HQ) for t in (1, 8)}
    measure("fresh", probs, flush)
    measure("fresh again", probs, flush)
    for t, prob in probs.items():
        prob.ours()()
        torch.cuda.synchronize()
        print(f"  error T={t} {prob.error():.2e}")
    measure("after error() (fp32 ref)", probs, flush)
    ua = load_vllm_unified_attention()
    if ua is not None:
        for prob in probs.values():
            prob.vllm(*ua)()
        torch.cuda.synchronize()
        measure("after vLLM eager", probs, flush)
        for t, prob in probs.items():
            print(f"  vLLM T={t} {time_graph(prob.vllm(*ua), flush):.1f}")
        measure("after vLLM graphs", probs, flush)
    torch.cuda.empty_cache()
    measure("after empty_cache", probs, flush)
    x = torch.empty(40 << 30, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    del x  # the caching allocator keeps the 40 GB segment: later blocks are carved from it
    measure("after 40 GB alloc/free", probs, flush)
    torch.cuda.empty_cache()
    probs = {t: Problem(pool, 1, CTX, t, HQ) for t in (1, 8)}
    measure("new Problems", probs, flush)


if __name__ == "__main__":
    main()
