"""Read-only ceiling probe for the CUDA split kernel's access pattern (bench.py --node-costs).

A kernel that reads exactly the bytes the default split kernel reads, through the same block
table, with the same grid (KV head x query tile x split, request), the same static key ranges
and the same 16-byte-aligned windows of 2D + 16 bytes per (key, head) record, and does nothing
with them (an xor per load, one conditional store per CTA). Its time is what this access
pattern allows on the device (ramp, tail, page gathers, address translation of the pool), so
the split kernel's % of copy can be read against it rather than against a flat copy.

Why loads instead of the split kernel's cp.async ring: no shared-memory carve-up to mirror;
each thread keeps all 33 loads of a 128-key step in flight (67.6 KB per CTA, as the 48-row
kernel's 2-stage ring), and the next step's block-table lookups overlap them. The CTA gets the
split kernel's dynamic shared memory so the same two CTAs share an SM. D = 256 only (33
windows per record).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.verify_attention import cuda as vc

D = 256
WINDOWS = (2 * D + 16) // 16  # 16-byte windows per record: 33

SOURCE = r"""
typedef unsigned long long u64;
#define W 33     // 16-byte windows per (key, head) record window at D = 256
#define KEYS 128 // keys per step: one lookup per thread

__device__ __forceinline__ uint4 ldcg16(u64 a) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
  return v;
}

extern "C" __global__ void __launch_bounds__(128, 2) va_probe_read(
    const signed char* kv, const int* block_table, const int* seq_lens, const int* cu_q,
    int num_splits, int num_q_tiles, int block_q, int page, int num_kv_heads,
    int stride_kv_blk, int stride_kv_slot, int stride_kv_head, int stride_bt, unsigned* sink) {
  __shared__ u64 off_s[2][KEYS];
  const int tid = threadIdx.x;
  int bx = blockIdx.x;
  const int h = bx % num_kv_heads;
  bx /= num_kv_heads;
  const int qt = bx % num_q_tiles, split = bx / num_q_tiles, b = blockIdx.y;
  const int q_len = cu_q[b + 1] - cu_q[b];
  const int q_lo = qt * block_q;
  if (q_lo >= q_len) return;
  const int q_hi = min(q_lo + block_q, q_len);
  const int k_hi = seq_lens[b] - q_len + q_hi;  // no window: keys [0, k_hi)
  const int per = ((k_hi + num_splits - 1) / num_splits + 63) / 64 * 64;
  const int n_start = split * per, n_end = min(n_start + per, k_hi);
  const u64 head = (u64)kv + (u64)h * stride_kv_head;
  const u64 base = head - (head & 15u);  // the window starts 0 or 8 bytes before the record
  const int* bt = block_table + (long long)b * stride_bt;
  auto lookup = [&](int kb, int buf) {
    const int key = kb + tid;
    u64 a = 0;
    if (key < n_end) {
      const int lp = key / page;
      a = base + (u64)bt[lp] * (u64)stride_kv_blk + (u64)(key - lp * page) * stride_kv_slot;
    }
    off_s[buf][tid] = a;
  };
  unsigned acc = 0;
  int buf = 0;
  if (n_start < n_end) lookup(n_start, 0);
  __syncthreads();
  for (int kb = n_start; kb < n_end; kb += KEYS) {
    uint4 v[W];
#pragma unroll
    for (int u = 0; u < W; ++u) {
      const int idx = tid + 128 * u, k = idx / W, w = idx - k * W;
      const u64 a = off_s[buf][k];
      v[u] = a ? ldcg16(a + 16 * w) : make_uint4(0, 0, 0, 0);
    }
    if (kb + KEYS < n_end) lookup(kb + KEYS, buf ^ 1);  // while this step's loads fly
#pragma unroll
    for (int u = 0; u < W; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    __syncthreads();
    buf ^= 1;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; practically never taken
}
"""


def probe(
    k: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q: torch.Tensor,
    t: int,
    num_q_heads: int,
    num_splits: int | None = None,
) -> Callable[[], None]:
    """A launcher of the probe for a problem the default split kernel would run (D = 256, no
    window): its split count (or ``num_splits``), grid and dynamic shared memory (``k``: the K
    view of the cache)."""
    if k.shape[3] != D + 4:
        raise ValueError("the probe is written for D = 256")
    batch, hkv = seq_lens.shape[0], k.shape[2]
    block_q, n_qt, _, n8 = vc._tile(num_q_heads // hkv, t)
    sms = torch.cuda.get_device_properties(k.device).multi_processor_count
    ctx = int(seq_lens.max())
    splits = num_splits or vc.num_splits_for(batch, hkv, n_qt, ctx, sms)
    smem = vc.smem_bytes_wg(D, n8, vc.pick_stages(D, n8, vc.smem_bytes_wg))
    kernel = vc._compiled("va_probe_read", smem, SOURCE)
    sink = torch.zeros(1, dtype=torch.int32, device=k.device)

    def run() -> None:
        kernel(
            grid=(hkv * n_qt * splits, batch, 1), block=(128, 1, 1),
            args=[k, block_table, seq_lens, cu_q, splits, n_qt, block_q, k.shape[1], hkv,
                  k.stride(0), k.stride(1), k.stride(2), block_table.stride(0), sink],
            shared_mem=smem,
        )  # fmt: skip

    return run
