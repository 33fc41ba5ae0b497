"""H200 sweep for the split-count rule: ours at fixed split counts per (context, T, batch), with
vLLM's unified_attention and the current default in the same run, and each output's relative
error against the fp32 reference.

    python -m kernels.verify_attention.sweep
"""

from __future__ import annotations

import math

import torch

from kernels.verify_attention import naive_verify_attention
from kernels.verify_attention import triton as va_triton
from kernels.verify_attention.bench import (
    HKV, HQ, D, FLUSH_BYTES, Problem, copy_bandwidth, load_vllm_unified_attention, make_pool,
    time_graph,
)  # fmt: skip

# (ctx, T, batch): split counts to time besides the default.
CASES = [
    (100_000, 1, 4, [17, 33, 66, 99, 132, 264]),
    (100_000, 8, 4, [17, 33, 66, 99, 132, 264]),
    (32_768, 1, 4, [17, 22, 33, 66, 132]),
    (32_768, 8, 4, [17, 22, 33, 66, 132]),
    (100_000, 8, 8, [9, 17, 33, 66]),
    (100_000, 1, 1, [66, 132]),
    (100_000, 8, 1, [66, 132]),
    (32_768, 1, 1, [66]),
    (32_768, 8, 1, [66]),
]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return ((out.float() - ref).norm() / ref.norm()).item()


def main() -> None:
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s", flush=True)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    vllm = load_vllm_unified_attention()
    print(f"vllm ref: {vllm is not None}", flush=True)
    pool = make_pool(8 * 100_000 + 64, 16, HKV, D)
    for ctx, t, b, splits in CASES:
        prob = Problem(pool, b, ctx, t, HQ)
        ref = naive_verify_attention(prob.q, pool, prob.cu_q, prob.seq_lens, prob.block_table,
                                     window_size=prob.win)
        dflt = va_triton.default_num_splits(b, HKV, 1, ctx, torch.device("cuda"))
        cells = []
        if vllm is not None and b > 1:
            cells.append(f"vllm {time_graph(prob.vllm(*vllm), flush):.1f}")
        for s in [None, *[x for x in splits if x != dflt]]:
            kw = {} if s is None else {"num_splits": s}
            fn = prob.ours(**kw) if kw else prob.ours()
            prob.out.fill_(float("nan"))
            fn()
            err = rel(prob.out, ref)
            us = time_graph(fn, flush)
            pct = 100 * prob.int8_bytes / us / 1e3 / bw
            cells.append(f"{'dflt ' + str(dflt) if s is None else s}: {us:.1f} ({pct:.0f}%, e {err:.1e})")
        print(f"ctx={ctx} T={t} b={b} | " + "  ".join(cells), flush=True)
        del prob, ref
        torch.cuda.empty_cache()
    assert math.isfinite(bw)


if __name__ == "__main__":
    main()
