// Split-KV verify attention over vLLM 0.32.0's int8 per-token-head paged KV cache (CUDA, sm_90a).
//
// Compiled at run time by NVRTC (kernels/verify_attention/cuda/__init__.py), so it includes no
// header: every special instruction is inline PTX (the launcher puts sm90_bulk.cuh, the mbarrier
// and TMA helpers, in front of this text). Kernels (the launcher's rule picks them; NOTES.md):
// * verify_attn_split_wg: the split kernel, both products on wgmma (any query tile up to 48 rows);
// * verify_attn_decode: the split kernel for tiles of at most 8 rows from 32K keys (T=1 at G=6):
//   TMA page slices, warp streams, every KV head in one CTA;
// * verify_attn_combine / _r / _c / _w: merge the splits' fp32 partials (by split count and by
//   the split kernel that wrote them).
// The mma.sync split kernel of ea506d7 (the first CUDA kernel) was removed once the wgmma kernel
// had beaten it on every row (1344eca); its code and measurements stay in git (HISTORY.md).
// Sized for sm_90 (two 128-thread CTAs per SM fit its 228 KB of shared memory).
//
// Shapes (legend as in reference.py): q [N, Hq, D] bf16/fp16, out [N, Hq, D], the cache as
// records of 2D + 8 bytes per (block, slot, KV head): K int8[D] | K scale f32 | V int8[D] |
// V scale f32. G = Hq / Hkv query heads share one KV head.
//
// What the split kernels share: one CTA per (KV head, query tile, KV split, request) (the decode
// kernel: per (query tile, split, request), every KV head) holds the query rows of its KV head(s)
// (row r = token * G + group) and walks its key range.
// * Loads: each key's record is copied through a 16-byte-aligned window (the record starts 0 or
//   8 bytes into it: the head's shift), so the V half (only 4-byte aligned in memory) costs no
//   narrow copies. Row pitch RP = 2D + 16 bytes keeps the shared-memory reads conflict-free.
// * int8 -> fp16 is exact with the magic-number trick: fp16(0x6400 | (x ^ 0x80)) - 1152. K enters
//   QK as int8 + 1152 with S's accumulator started at -1152 x the fp16 Q row sum.
// * Q is pre-scaled by softmax_scale * log2(e), with its contraction index permuted to match the
//   order in which a thread reads a key's bytes.
// * Per-token scales: K scale multiplies S, V scale multiplies P (before its fp16 rounding).
// * Online softmax, lazy: the running max moves only when a score exceeds it by more than 2^8.
// * Output: one split writes bf16/fp16 out directly; several write fp32 partials (unnormalised
//   accumulator, running max in log2 units, running sum) that a combine kernel merges.
// The key range of each split is computed on the device from seq_lens, so one launch shape
// serves every length (CUDA-graph friendly).

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define DI __device__ __forceinline__

namespace va {

#define NEG_INF __int_as_float(0xff800000u)
// Running max of a row that has seen no visible key yet (verify_attn_split_wg): finite, so
// ex2(-inf - M_EMPTY) = 0 and ex2(M_EMPTY - m) = 0 need no -inf tests; -inf again at the store.
#define M_EMPTY (-1e30f)

DI u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte global -> shared copy, bypassing L1; src_bytes = 0 zero-fills (no read).
DI void cp_async16(u32 dst, u64 src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
DI void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
DI void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

DI u32 lds32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
DI uint2 lds64(u32 addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
DI float lds_f32(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
DI void sts32(u32 addr, u32 v) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v)); }

// D += A B, m16n8k16, fp16 operands, fp32 accumulators.
DI void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

DI u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// 4 int8 -> 2 x f16x2, exact: lo = (byte0, byte1), hi = (byte2, byte3), low half first.
DI void i8x4_to_f16(u32 w, u32& lo, u32& hi) {
  const u32 u = w ^ 0x80808080u;
  const u32 bias = 0x64806480u;  // f16x2 (1152, 1152)
  u32 a = prmt(u, 0x64646464u, 0x4140u);
  u32 b = prmt(u, 0x64646464u, 0x4342u);
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(lo) : "r"(a), "r"(bias));
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(hi) : "r"(b), "r"(bias));
}

DI float f16_lo(u32 h2) {
  float f;
  asm("{ .reg .f16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }" : "=f"(f) : "r"(h2));
  return f;
}
DI float f16_hi(u32 h2) {
  float f;
  asm("{ .reg .f16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "r"(h2));
  return f;
}
// 4 int8 -> 2 x f16x2 holding x + 1152 (exact), lo = (byte0, byte1), hi = (byte2, byte3): the
// caller removes the 1152 elsewhere (the QK accumulator starts at -1152 x the Q row sum).
DI void i8x4_to_f16_biased(u32 w, u32& lo, u32& hi) {
  const u32 u = w ^ 0x80808080u;
  lo = prmt(u, 0x64646464u, 0x4140u);
  hi = prmt(u, 0x64646464u, 0x4342u);
}

DI float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

DI u32 pack_f16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
DI u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <bool BF16>
DI u32 pack_out(float lo, float hi) {
  return BF16 ? pack_bf16(lo, hi) : pack_f16(lo, hi);
}
template <bool BF16>
DI float to_f32(unsigned short h) {
  if (BF16) return __int_as_float(((u32)h) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
}

DI float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
DI u32 shfl_idx(u32 v, int src) { return __shfl_sync(0xffffffffu, v, src); }

// Programmatic dependent launch (sm_90): no-ops when the grid was launched without it.
DI void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
DI void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
DI u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
DI u64 clock64_() {
  u64 t;
  asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(t));
  return t;
}
DI u32 smid() {
  u32 r;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(r));
  return r;
}


// The arguments of both split kernels (verify_attn_split_wg, verify_attn_decode), in the launcher's
// order; some kernels take more after them.
#define VA_SPLIT_ARGS                                                                              \
  const unsigned short* __restrict__ q,  /* [N, Hq, D] */                                          \
  const signed char* __restrict__ kv,    /* the K view's base: record of (block 0, slot 0, head 0) */ \
  const int* __restrict__ block_table,   /* [B, stride_bt] */                                       \
  const int* __restrict__ seq_lens,      /* [B] */                                                  \
  const int* __restrict__ cu_q,          /* [B + 1] */                                              \
  unsigned short* __restrict__ out,      /* [N, Hq, D], written when num_splits == 1 */             \
  float* __restrict__ part_acc,          /* [N, Hq, num_splits, D] when num_splits > 1 */           \
  float* __restrict__ part_ml,           /* [N, Hq, num_splits, 2] */                               \
  double qk_scale_d,                     /* softmax_scale * log2(e) */                              \
  int window,                            /* key k visible from position p iff p - k < window; 0: none */ \
  int num_splits, int num_q_tiles, int block_q, int G, int page, int num_kv_heads,                 \
  int stride_q_tok, int stride_q_head, int stride_o_tok, int stride_o_head,                        \
  int stride_kv_blk, int stride_kv_slot, int stride_kv_head, int stride_bt

// ---- Shared by the split kernels (verify_attn_split_wg, verify_attn_decode) ----

// One (request b, query tile qt) unit of a split kernel: query tokens [q_lo, q_hi) of the request's
// q_len (its first at row q_start of q), rows = (q_hi - q_lo) x G query rows, keys [k_lo, k_hi):
// ctx keys before the request's first query, causal, from the first query's window when window > 0.
struct Unit {
  int q_start, q_len, q_lo, q_hi, rows, ctx, k_lo, k_hi;
};
// False when the tile lies past the request's queries (uniform over a CTA: the kernel returns).
DI bool unit_at(Unit& u, const int* cu_q, const int* seq_lens, int b, int qt, int block_q, int G, int window) {
  u.q_start = cu_q[b];
  u.q_len = cu_q[b + 1] - u.q_start;
  u.q_lo = qt * block_q;
  if (u.q_lo >= u.q_len) return false;
  u.q_hi = min(u.q_lo + block_q, u.q_len);
  u.rows = (u.q_hi - u.q_lo) * G;
  u.ctx = seq_lens[b] - u.q_len;
  u.k_hi = u.ctx + u.q_hi;
  u.k_lo = window > 0 ? max(u.ctx + u.q_lo - window + 1, 0) : 0;
  return true;
}

}  // namespace va

// Threads per CTA and keys per tile (shared with the launcher in __init__.py).
#define VA_THREADS 128
#define VA_BN 64

// Merge the splits' partials below 32 splits (the launcher's rule; the first combine, ea506d7's):
// one CTA of 256 threads per (token, query head). The partials were just written and sit in L2,
// so the cost is latency: the splits are spread over SG = 256 / (D/4) thread groups (4 at D=256)
// that each walk S / SG of them with independent loads, and the groups' sums are added in shared
// memory. combine_w's lanes would idle at few splits (H200, drafter w=2048 T=8 b4: 30.8 vs 25.5 µs).
template <int D, bool BF16>
__global__ void __launch_bounds__(256) verify_attn_combine(
    unsigned short* __restrict__ out,     // [N, Hq, D]
    const float* __restrict__ part_acc,   // [N, Hq, S, D]
    const float* __restrict__ part_ml,    // [N, Hq, S, 2]
    int num_splits, int Hq, int stride_o_tok, int stride_o_head) {
  using namespace va;
  // Launched with programmatic dependent launch (after verify_attn_decode), this CTA may start
  // while the split kernel still runs: wait for its completion (and its partials) first; without
  // PDL this is a no-op.
  griddep_wait();
  constexpr int L = D / 4;        // threads per split group (4 dims each)
  constexpr int SG = 256 / L;     // split groups
  __shared__ float red[8];
  __shared__ float4 acc_s[SG][L];
  __shared__ float den_s[SG];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rowi = blockIdx.x;
  const int tok = rowi / Hq, hq = rowi - (rowi / Hq) * Hq;
  const float* ml = part_ml + (i64)rowi * num_splits * 2;

  float mmax = NEG_INF;
  for (int s = tid; s < num_splits; s += 256) mmax = fmaxf(mmax, ml[2 * s]);
#pragma unroll
  for (int o = 16; o; o >>= 1) mmax = fmaxf(mmax, shfl_xor(mmax, o));
  if (lane == 0) red[warp] = mmax;
  __syncthreads();
  mmax = red[0];
#pragma unroll
  for (int w = 1; w < 8; ++w) mmax = fmaxf(mmax, red[w]);

  const int sg = tid / L, d4 = tid - (tid / L) * L;
  const float* pa = part_acc + (i64)rowi * num_splits * D + 4 * d4;
  float den = 0.f;
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = sg; s < num_splits; s += SG) {
    const float m = ml[2 * s];
    const float l = ml[2 * s + 1];
    const float4 v = *reinterpret_cast<const float4*>(pa + (i64)s * D);
    // m = -inf: no visible key in that split (its accumulator is zero or, if empty, unwritten).
    const float w = m == NEG_INF ? 0.f : ex2(m - mmax);
    den += w * l;
    if (w > 0.f) a.x += w * v.x, a.y += w * v.y, a.z += w * v.z, a.w += w * v.w;
  }
  acc_s[sg][d4] = a;
  if (d4 == 0) den_s[sg] = den;
  __syncthreads();
  if (sg == 0) {
#pragma unroll
    for (int k = 1; k < SG; ++k) {
      const float4 v = acc_s[k][d4];
      a.x += v.x, a.y += v.y, a.z += v.z, a.w += v.w;
      den += den_s[k];
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    uint2 pk;
    pk.x = pack_out<BF16>(a.x * inv, a.y * inv);
    pk.y = pack_out<BF16>(a.z * inv, a.w * inv);
    *reinterpret_cast<uint2*>(out + (i64)tok * stride_o_tok + (i64)hq * stride_o_head + 4 * d4) = pk;
  }
}

// The part of the row and column-block combines they share, for one CTA of 256 threads: SG split
// groups of 256 / SG threads, each thread one 16-byte column `pa` of split 0's partial row (split
// s at pa + s D). Issues chunk 0's loads (U splits per group) before the (max, sum) pairs of all
// splits are read into ml_s and the row max is reduced (red: 8 floats; `tr`: stamp t_ml after
// that barrier), then adds the chunks' weighted columns into a and the weighted sums into den.
template <int D, int SG, int U, int MLS>
DI void combine_row_chunks(const float* pa, const float2* ml, int num_splits, float2* ml_s, float* red,
                           bool tr, u64& t_ml, float4& a, float& den) {
  using namespace va;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sg = tid / (256 / SG);  // compile-time divisor
  float4 v[U];
  auto issue = [&](int c0) {  // chunk c0: splits sg + (c0 + k) SG
    const float* const p0 = pa + (i64)(sg + c0 * SG) * D;  // + k SG D: immediate offsets
#pragma unroll
    for (int k = 0; k < U; ++k) {
      v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (sg + (c0 + k) * SG < num_splits) v[k] = *reinterpret_cast<const float4*>(p0 + k * SG * D);
    }
  };
  issue(0);
  float mmax = NEG_INF;
  for (int s = tid; s < MLS + U * SG; s += 256) {
    const float2 t = s < num_splits ? ml[s] : make_float2(NEG_INF, 0.f);
    ml_s[s] = t;
    mmax = fmaxf(mmax, t.x);
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) mmax = fmaxf(mmax, shfl_xor(mmax, o));
  if (lane == 0) red[warp] = mmax;
  __syncthreads();
  if (tr) t_ml = globaltimer();
  mmax = red[0];
#pragma unroll
  for (int w = 1; w < 8; ++w) mmax = fmaxf(mmax, red[w]);
  for (int c0 = 0;;) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
      // m = -inf: no visible key in that split (or past num_splits): weight 0, data not used.
      const float2 t = ml_s[sg + (c0 + k) * SG];
      const float w = t.x == NEG_INF ? 0.f : ex2(t.x - mmax);
      den += w * t.y;
      if (w > 0.f) a.x += w * v[k].x, a.y += w * v[k].y, a.z += w * v[k].z, a.w += w * v[k].w;
    }
    c0 += U;
    if (c0 * SG >= num_splits) break;  // uniform over the CTA
    issue(c0);
  }
}

// Merge for the wgmma kernel, one CTA per (token, query head) row: the rule from 32 to 256 splits
// since session 5 (combine_w below merges past 256). Why: on the H200 the
// combine_w node costs ~10 µs over the split kernel alone at 100K b1, T=1 and T=8 alike (an empty
// node: 1.3 µs), although it reads 1.6 / 12.6 MB; its lanes are splits 1 KB apart, so each of its
// 16-byte loads is 32 lines (32 L1 wavefronts per instruction). Measured (H200, same run): 100K
// T=8 b1 93.6 -> 89.8 µs, T=1 b1 unchanged (72.7: its node cost is not this kernel's work; HISTORY.md).
// Here the 256 threads are SG = 1024 / D split groups of D / 4 threads, each thread one 16-byte
// column of the row: every load is coalesced (a group reads a whole 1 KB partial row). All loads
// of a chunk of U splits per group (the partial columns and their (max, sum)) are issued before
// the row max is known, so a call with S <= U x SG splits (68 at D = 256) is one L2 round trip,
// one barrier for the max and one shared-memory reduction over the groups. The (max, sum) pairs
// are loaded once per CTA (thread s, with the max) and read back from shared memory: 128
// registers for two CTAs per SM, no spills (ptxas 13.0).
template <int D, bool BF16>
__global__ void __launch_bounds__(256, 2) verify_attn_combine_r(
    unsigned short* __restrict__ out,     // [N, Hq, D]
    const float* __restrict__ part_acc,   // [N, Hq, S, D]
    const float* __restrict__ part_ml,    // [N, Hq, S, 2]
    int num_splits, int Hq, int stride_o_tok, int stride_o_head) {
  using namespace va;
  griddep_wait();  // see verify_attn_combine
  constexpr int L = D / 4;     // threads per split group (one float4 column each)
  constexpr int SG = 256 / L;  // split groups: 4 at D = 256, 8 at D = 128
  constexpr int U = 17;        // splits per group and chunk, all loads in flight
  constexpr int MLS = 256;     // splits at most (launcher: ROW_COMBINE_MAX_SPLITS)
  __shared__ float red[8];
  __shared__ float4 acc_s[SG][L];
  __shared__ float den_s[SG];
  __shared__ float2 ml_s[MLS + U * SG];  // (max, sum) per split; (-inf, 0) past num_splits
  const int tid = threadIdx.x;
  const int rowi = blockIdx.x;
  const int sg = tid / L, d4 = tid % L;  // compile-time divisor
  const float2* const ml = reinterpret_cast<const float2*>(part_ml) + (i64)rowi * num_splits;
  const float* const pa = part_acc + (i64)rowi * num_splits * D + 4 * d4;
  float den = 0.f;
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
  u64 t_ml;
  combine_row_chunks<D, SG, U, MLS>(pa, ml, num_splits, ml_s, red, false, t_ml, a, den);
  acc_s[sg][d4] = a;
  if (d4 == 0) den_s[sg] = den;
  __syncthreads();
  if (sg == 0) {
#pragma unroll
    for (int k = 1; k < SG; ++k) {
      const float4 t = acc_s[k][d4];
      a.x += t.x, a.y += t.y, a.z += t.z, a.w += t.w;
      den += den_s[k];
    }
    const int tok = rowi / Hq, hq = rowi - (rowi / Hq) * Hq;
    const float inv = den > 0.f ? 1.f / den : 0.f;
    uint2 pk;
    pk.x = pack_out<BF16>(a.x * inv, a.y * inv);
    pk.y = pack_out<BF16>(a.z * inv, a.w * inv);
    *reinterpret_cast<uint2*>(out + (i64)tok * stride_o_tok + (i64)hq * stride_o_head + 4 * d4) = pk;
  }
}

// Merge after verify_attn_decode (the rule from 32 to 256 splits; launched with PDL, DC = 64), one
// CTA per (token, query head, DC-dim column block): the row combine above with the row's D dims
// spread over D / DC CTAs. Why: at T=1 b1 the row combine is 24 CTAs on 24 of 132 SMs, each
// pulling a whole row's partials (132 splits x 1 KB) through one SM; here 4x as many SMs share the
// bytes: after the decode kernel, with PDL, 58.7 vs 61.1 µs (row + PDL) at 100K b1, 103.8 vs 106.2
// at 200K b1 (H200, session 9). After the wgmma kernel it gained nothing (session 5).
// Same arithmetic as the row combine (fp32, one L2 round trip for a chunk of U x SG splits, the
// (max, sum) pairs once per CTA in shared memory); the groups' sums are added by a tree over the
// SG = 1024 / DC split groups. DC = D is the row combine's grid. trace_on: thread 0 stores
// %globaltimer at CTA start, after the (max, sum) barrier, after all partials are summed, at the
// end, the SM id and the SM clocks from start to end in trace_buf[CTA][0..5] (diag_combine.py).
template <int D, int DC, bool BF16>
__global__ void __launch_bounds__(256) verify_attn_combine_c(
    unsigned short* __restrict__ out,     // [N, Hq, D]
    const float* __restrict__ part_acc,   // [N, Hq, S, D]
    const float* __restrict__ part_ml,    // [N, Hq, S, 2]
    int num_splits, int Hq, int stride_o_tok, int stride_o_head,
    u64* __restrict__ trace_buf,          // [CTAs][8] when trace_on
    int trace_on) {
  using namespace va;
  static_assert(DC >= 16 && DC <= D && D % DC == 0, "column block");
  const bool tr = trace_on && threadIdx.x == 0;
  u64 t0 = 0, t1 = 0, t2 = 0, c0 = 0;
  if (tr) t0 = globaltimer(), c0 = clock64_();
  griddep_wait();  // see verify_attn_combine
  constexpr int NC = D / DC;             // column blocks per row
  constexpr int L = DC / 4;              // threads per split group (one float4 column each)
  constexpr int SG = 256 / L;            // split groups: 4 at DC = 256, 16 at 64, 32 at 32
  constexpr int U = (68 + SG - 1) / SG;  // splits per group and chunk: one chunk >= 68 splits
  constexpr int MLS = 256;               // splits at most (launcher: ROW_COMBINE_MAX_SPLITS)
  __shared__ float red[8];
  __shared__ float4 acc_s[SG][L];
  __shared__ float den_s[SG];
  __shared__ float2 ml_s[MLS + U * SG];  // (max, sum) per split; (-inf, 0) past num_splits
  const int tid = threadIdx.x;
  const int rowi = blockIdx.x / NC, cb = blockIdx.x - rowi * NC;  // compile-time divisor
  const int sg = tid / L, d4 = tid % L;
  const float2* const ml = reinterpret_cast<const float2*>(part_ml) + (i64)rowi * num_splits;
  const float* const pa = part_acc + (i64)rowi * num_splits * D + cb * DC + 4 * d4;
  float den = 0.f;
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
  combine_row_chunks<D, SG, U, MLS>(pa, ml, num_splits, ml_s, red, tr, t1, a, den);
  acc_s[sg][d4] = a;
  if (d4 == 0) den_s[sg] = den;
  __syncthreads();
  if (tr) t2 = globaltimer();
#pragma unroll
  for (int h = SG / 2; h >= 1; h >>= 1) {  // tree over the groups: log2(SG) steps
    if (sg < h) {
      const float4 t = acc_s[sg + h][d4];
      a.x += t.x, a.y += t.y, a.z += t.z, a.w += t.w;
      acc_s[sg][d4] = a;
      if (d4 == 0) den += den_s[sg + h], den_s[sg] = den;
    }
    __syncthreads();
  }
  if (sg == 0) {
    den = den_s[0];
    const int tok = rowi / Hq, hq = rowi - (rowi / Hq) * Hq;
    const float inv = den > 0.f ? 1.f / den : 0.f;
    uint2 pk;
    pk.x = pack_out<BF16>(a.x * inv, a.y * inv);
    pk.y = pack_out<BF16>(a.z * inv, a.w * inv);
    *reinterpret_cast<uint2*>(out + (i64)tok * stride_o_tok + (i64)hq * stride_o_head + cb * DC + 4 * d4) = pk;
  }
  if (tr) {
    u64* const t = trace_buf + (i64)blockIdx.x * 8;
    t[0] = t0, t[1] = t1, t[2] = t2, t[3] = globaltimer(), t[4] = smid(), t[5] = clock64_() - c0;
  }
}

// Merge for the wgmma kernel: one warp per (token, query head, 8 output dims), lane = split
// group. Why: verify_attn_combine walks the splits in a loop of dependent L2 round trips (~17 per
// thread at 66 splits), and at T=1 it has only N x Hq = 24 CTAs: it cost ~12 µs of the 77 µs call
// at 100K T=1 b1 (H200, session 4). Here every lane issues all loads of its splits (up to 4 per
// batch: 32 bytes of acc + m, l each) before using any, so a call is ~one L2 round trip, and the
// max, the sum and the accumulator are reduced with warp shuffles: no shared memory, no barrier.
// The rule past 256 splits (the row combine keeps every split's (max, sum) in shared memory).
template <int D, bool BF16>
__global__ void __launch_bounds__(128) verify_attn_combine_w(
    unsigned short* __restrict__ out,     // [N, Hq, D]
    const float* __restrict__ part_acc,   // [N, Hq, S, D]
    const float* __restrict__ part_ml,    // [N, Hq, S, 2]
    int num_splits, int Hq, int stride_o_tok, int stride_o_head, int rows_total) {
  using namespace va;
  griddep_wait();  // see verify_attn_combine
  constexpr int CH = D / 8;  // 8-dim chunks per row
  const int lane = threadIdx.x & 31;
  const int wi = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (wi >= rows_total * CH) return;  // uniform over the warp
  const int rowi = wi / CH, ch = wi - (wi / CH) * CH;
  const float* ml = part_ml + (i64)rowi * num_splits * 2;
  const float* pa = part_acc + (i64)rowi * num_splits * D + 8 * ch;
  float mmax = NEG_INF, den = 0.f, a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = 0.f;
  for (int s0 = 0; s0 < num_splits; s0 += 4 * 32) {  // one batch up to 128 splits
    float m[4], l[4];
    float4 v[4][2];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int s = s0 + i * 32 + lane;
      m[i] = NEG_INF, l[i] = 0.f;
      v[i][0] = v[i][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (s < num_splits) {
        const float2 t = *reinterpret_cast<const float2*>(ml + 2 * s);
        m[i] = t.x, l[i] = t.y;
        v[i][0] = *reinterpret_cast<const float4*>(pa + (i64)s * D);
        v[i][1] = *reinterpret_cast<const float4*>(pa + (i64)s * D + 4);
      }
    }
    float bm = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
#pragma unroll
    for (int o = 16; o; o >>= 1) bm = fmaxf(bm, shfl_xor(bm, o));
    const float mn = fmaxf(mmax, bm);
    // Rescale what earlier batches summed (only with > 128 splits); m = -inf: no visible key.
    const float r = mmax == mn ? 1.f : ex2(mmax - mn);
    den *= r;
#pragma unroll
    for (int k = 0; k < 8; ++k) a[k] *= r;
    mmax = mn;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float w = m[i] == NEG_INF ? 0.f : ex2(m[i] - mmax);
      den += w * l[i];
      const float vv[8] = {v[i][0].x, v[i][0].y, v[i][0].z, v[i][0].w,
                           v[i][1].x, v[i][1].y, v[i][1].z, v[i][1].w};
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] += w > 0.f ? w * vv[k] : 0.f;
    }
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    den += shfl_xor(den, o);
#pragma unroll
    for (int k = 0; k < 8; ++k) a[k] += shfl_xor(a[k], o);
  }
  if (lane == 0) {
    const int tok = rowi / Hq, hq = rowi - (rowi / Hq) * Hq;
    const float inv = den > 0.f ? 1.f / den : 0.f;
    uint4 pk;
    pk.x = pack_out<BF16>(a[0] * inv, a[1] * inv);
    pk.y = pack_out<BF16>(a[2] * inv, a[3] * inv);
    pk.z = pack_out<BF16>(a[4] * inv, a[5] * inv);
    pk.w = pack_out<BF16>(a[6] * inv, a[7] * inv);
    *reinterpret_cast<uint4*>(out + (i64)tok * stride_o_tok + (i64)hq * stride_o_head + 8 * ch) = pk;
  }
}

// ---------------------------------------------------------------------------------------------
// verify_attn_split_wg: the split kernel with both products on wgmma (sm_90a), A operand from
// registers (the int8 -> fp16 conversion writes it directly), B operand from shared memory.
//
// Why (1344eca, against ea506d7's mma.sync kernel): at 48 query rows the mma.sync kernel moved ~190 KB of shared memory per 64-key tile and
// CTA, half of it Q re-read by each of the 4 warps (ldmatrix), and issued 192 mma.sync + 72
// ldmatrix per warp per tile; at 8 warps per SM the latency was not hidden (ncu: "wait" stalls,
// tensor pipe 32%). A wgmma m64nNk16 reads its B operand once for the whole warpgroup, so Q and P
// are read from shared memory once per tile instead of four times, and 16 wgmma per product
// replace the mma.sync / ldmatrix streams (no even/odd accumulator copy for S either).
// * S^T = K Q^T: keys on M (warp w owns keys 16w..16w+15 of the tile, as before), query rows on N
//   (N = 8 N8: T=1 with G=6 is n8, not an m16 padded to 16 rows). The K word a thread reads is its
//   A fragment (contraction index d permuted as before). B = Q, K-major, no swizzle.
// * O^T = V^T P^T: D on M (m64 tile t of warp w = its m16 tile t of before, same permuted output
//   dims), query rows on N, keys on K. A = V from registers (prmt pairs as before); B = P, K-major.
//   The key order inside each 16-key chunk is permuted so that a thread's two S values of one row
//   (keys g and g + 8) are adjacent in P: logical k = 2 g + hh <-> key g + 8 hh. So the A fragment
//   of V needs keys (c, c + 8) for logical k (2c, 2c + 1) and (c + 4, c + 12) for (2c + 8, 2c + 9).
// * No-swizzle K-major shared layout (the wgmma "core matrix" is 8 rows x 16 bytes, 128 bytes
//   contiguous): element (n, k) at (n / 8) * SBO + (k / 8) * 128 + (n % 8) * 16 + (k % 8) * 2, so
//   LBO (next 8 k) = 128 bytes and SBO (next 8 rows) = 16 K bytes.
// * The thread's accumulator columns (query rows 8 j + 2 c + e) are the same in S^T and O^T, so
//   the softmax rescale factor never leaves the thread; the row sum stays a per-thread partial
//   (reduced once, in the epilogue).
// ---------------------------------------------------------------------------------------------
namespace va {

DI void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DI void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
DI void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy shared stores (Q, P) -> visible to wgmma's reads (async proxy).
DI void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Shared-memory matrix descriptor, no swizzle: start address, LBO, SBO (all >> 4).
DI u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

// The same descriptor as two words built once per kernel: lo = start >> 4 | LBO, hi = SBO; a
// constant byte offset then costs one 32-bit add (the start field cannot carry: shared addresses
// are < 2^18). wg_desc per product cost six uniform instructions per wgmma (192 per 48-row tile).
DI u32 wg_desc_lo(u32 addr, u32 lbo) { return ((addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16); }
DI u64 wg_desc_at(u32 lo, u32 sbo, u32 off) { return ((u64)(sbo >> 4) << 32) | (u64)(lo + (off >> 4)); }

// D[64 x 8 N8] += A[64 x 16] (registers, this warp's 16 rows) B[16 x 8 N8] (descriptor), fp32.
template <int N8>
DI void wgmma_rs(float (&d)[N8][4], const u32 (&a)[4], u64 desc);
template <>
DI void wgmma_rs<1>(float (&d)[1][4], const u32 (&a)[4], u64 desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
DI void wgmma_rs<2>(float (&d)[2][4], const u32 (&a)[4], u64 desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, %12, 1, 1, 1, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
DI void wgmma_rs<3>(float (&d)[3][4], const u32 (&a)[4], u64 desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n24k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, "
      "{%12, %13, %14, %15}, %16, 1, 1, 1, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
DI void wgmma_rs<4>(float (&d)[4][4], const u32 (&a)[4], u64 desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, 1, 1, 1, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
DI void wgmma_rs<5>(float (&d)[5][4], const u32 (&a)[4], u64 desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n40k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19}, "
      "{%20, %21, %22, %23}, %24, 1, 1, 1, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
DI void wgmma_rs<6>(float (&d)[6][4], const u32 (&a)[4], u64 desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, "
      "{%24, %25, %26, %27}, %28, 1, 1, 1, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
}  // namespace va

// Template parameters: D head size (128 or 256); N8 query n8 tiles (rows <= 8 N8, padded to 8 N8);
// STAGES ring depth; BF16 q/out dtype (else fp16); DYN: tiles handed out by a per-unit counter
// (see "Dynamic tiles" below; the launcher's rule at one n8 tile), else static splits.
// trace_on: per-CTA %globaltimer stamps into trace_buf[CTA][0..7] (diag.py; off in every product
// launch): 0 start, 1 first tile landed, 2 loop end, 3 end, 4 tiles, 5 SM id, 6 first copies
// issued, 7 Q stored.
template <int D, int N8, int STAGES, bool BF16, bool DYN>
__global__ void __launch_bounds__(VA_THREADS, 2) verify_attn_split_wg(
    VA_SPLIT_ARGS,
    int* __restrict__ tile_ctr,            // DYN: [B, num_q_tiles, num_kv_heads], zero between calls
    u64* __restrict__ trace_buf,           // [CTAs][8] %globaltimer stamps when trace_on (diag.py)
    int trace_on) {

  using namespace va;
  u64* const trace = trace_on ? trace_buf : nullptr;
  // CTA start stamp stored at once (kept live across the loop it cost 48-row registers: spilled).
  if (trace && threadIdx.x == 0) trace[(blockIdx.y * gridDim.x + blockIdx.x) * 8] = globaltimer();
  constexpr int BN = VA_BN;
  constexpr int NW = VA_THREADS / 32;  // one warpgroup
  constexpr int RP = 2 * D + 16;       // shared row pitch of one key's window (bytes)
  constexpr int R = 8 * N8;            // query rows held (padded): the N of both products
  constexpr int QSBO = 2 * D * 8;      // Q: bytes between 8-row groups (K-major, no swizzle)
  constexpr int PSBO = 2 * BN * 8;     // P: likewise
  constexpr int DW = D / NW;           // output dims per warp in the PV product
  constexpr int MTD = DW / 16;         // m64 tiles of the PV product (this warp's m16 slice each)
  constexpr int WV = DW / 32;          // 32-bit V words per key row per thread
  static_assert(D == 128 || D == 256, "head size 128 or 256");
  static_assert(N8 >= 1 && N8 <= 6, "1..48 query rows");

  extern __shared__ __align__(128) unsigned char wsmem[];
  const u32 kv_s = smem_addr(wsmem);
  const u32 q_s = kv_s + STAGES * BN * RP;  // [R / 8][D / 8] core matrices of 8 x 16 bytes
  const u32 p_s = q_s + R * 2 * D;          // [R / 8][BN / 8] core matrices
  float* red_s = reinterpret_cast<float*>(wsmem + STAGES * BN * RP + R * 2 * D + R * 2 * BN);  // [NW][R]
  float* m_s = red_s + NW * R;                                                                // [R]
  int* idx_s = reinterpret_cast<int*>(m_s + R);  // DYN: tile index ring [8]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;

  int bx = blockIdx.x;
  const int h = bx % num_kv_heads;
  bx /= num_kv_heads;
  const int qt = bx % num_q_tiles;
  const int split = bx / num_q_tiles;
  const int b = blockIdx.y;

  Unit un;
  if (!unit_at(un, cu_q, seq_lens, b, qt, block_q, G, window)) return;  // uniform over the CTA
  const int q_start = un.q_start, q_lo = un.q_lo, q_hi = un.q_hi;
  const int rows = un.rows;
  const int ctx = un.ctx, k_hi = un.k_hi, k_lo = un.k_lo;
  const int span = max(k_hi - k_lo, 0);
  // Static: split s owns keys [n_start, n_end), its tiles in order. DYN: every split of the unit
  // (request, query tile, KV head) covers [k_lo, k_hi) and takes 64-key tiles by index.
  const int per = ((span + num_splits - 1) / num_splits + BN - 1) / BN * BN;
  const int n_start = DYN ? k_lo : k_lo + split * per;
  const int n_end = DYN ? k_hi : min(n_start + per, k_hi);
  const int Hq = num_kv_heads * G;
  const int shift = (int)((reinterpret_cast<u64>(kv) + (u64)h * (u64)stride_kv_head) & 15u);

  // ---- Dynamic tiles (DYN). With one wave of equal static splits the kernel ends with the
  // slowest CTA (the DRAM share of the CTAs is not equal); here each CTA takes tile indices of its
  // unit from an atomic counter, so CTAs that stream faster take more tiles and all end within
  // about one tile of each other. Tile t of this CTA has index split + t * num_splits for
  // t <= STAGES (no atomic before the first copies), then (STAGES + 1) * num_splits + the counter.
  // Thread 0 takes the counter two tiles ahead of the lookup (the atomic's latency is hidden by
  // one tile of work): in iteration it it publishes the index of tile it + STAGES + 1 in idx_s
  // (read after the next barrier) and takes the one of tile it + STAGES + 2 while the last was
  // valid, so every CTA takes exactly one failing index; the CTA that takes the unit's last failing
  // index resets the counter to 0, so the next launch (a CUDA-graph replay) starts from 0.
  // Indices only grow along a CTA's sequence, so the first invalid tile ends its loop.
  int* const ctr = tile_ctr + ((i64)b * num_q_tiles + qt) * num_kv_heads + h;
  const int total = (span + BN - 1) / BN;           // tiles of the unit
  const int first_dyn = (STAGES + 1) * num_splits;  // index of the first counter-given tile
  int grab = 0;                                     // thread 0: last counter value taken
  auto tile_kb = [&](int t) -> int {               // first key of tile t (>= n_end: none)
    if (!DYN) return n_start + t * BN;
    const int idx = t <= STAGES ? split + t * num_splits : idx_s[t & 7];
    return idx < total ? k_lo + idx * BN : n_end;
  };
  if (DYN && tid == 0) grab = atomicAdd(ctr, 1);  // index of tile STAGES + 1

  // ---- K/V tile loads (kb0 = the tile's first key, < n_end): 16-byte cp.async of each key's
  // record window into the STAGES-deep ring, one tile ahead of its use.
  auto lookup = [&](int kb0, int& blk, int& slot) {
    const int key = kb0 + warp * 16 + (lane & 15);
    blk = -1, slot = 0;
    if (key < n_end) {
      const int lp = (int)((u32)key / (u32)page);  // unsigned: ~2/3 of a signed division
      slot = key - lp * page;
      blk = block_table[(i64)b * stride_bt + lp];
    }
  };
  // A key's window is kvh + 16 off (kvh = the head's 16-byte-aligned window base; blocks and
  // slots are 16-byte multiples, and the pool is < 64 GB: cuda.supported), so lanes exchange one
  // 32-bit offset per key (one shuffle and one IMAD.WIDE per copy, was two shuffles and ~7
  // instructions of 64-bit selects). Tiles wholly below n_end (all but a unit's last) copy
  // without the per-key bound checks (uniform branch).
  auto issue = [&](int tile, int kb0, int blk, int slot) {
    constexpr int CK = D / 8;
    constexpr int KPR = 32 / CK;
    const int kb = kb0 + warp * 16;
    const u32 off = blk >= 0 ? (u32)blk * (u32)(stride_kv_blk >> 4) + (u32)slot * (u32)(stride_kv_slot >> 4) : 0u;
    const u64 kvh = reinterpret_cast<u64>(kv) + (u64)(i64)(h * stride_kv_head - shift);
    const u32 dst = kv_s + (tile % STAGES) * (BN * RP) + warp * 16 * RP;
    const int kl = lane / CK, ch = lane % CK;
    const u64 base = kvh + ch * 16;
    if (kb0 + BN <= n_end) {
#pragma unroll
      for (int r = 0; r < 16 / KPR; ++r) {
        const int kk = r * KPR + kl;
        cp_async16(dst + kk * RP + ch * 16, base + ((u64)shfl_idx(off, kk) << 4), 16);
      }
      if (lane < 16) cp_async16(dst + lane * RP + CK * 16, kvh + ((u64)off << 4) + CK * 16, 16);
    } else {
#pragma unroll
      for (int r = 0; r < 16 / KPR; ++r) {
        const int kk = r * KPR + kl;
        const bool ok = kb + kk < n_end;
        cp_async16(dst + kk * RP + ch * 16, base + ((u64)shfl_idx(off, kk) << 4), ok ? 16 : 0);
      }
      if (lane < 16) cp_async16(dst + lane * RP + CK * 16, kvh + ((u64)off << 4) + CK * 16, blk >= 0 ? 16 : 0);
    }
  };

  // ---- Q's global loads go out first, before the block-table lookups and the first tile's
  // copies: issued after them they queue behind every CTA's copy burst in DRAM (verify_attn_decode
  // lost ~4 µs the same way, session 9). Converted below, once the first copies are in flight.
  // Item i of this thread is row r0 + RS i (query token r / G, head h G + r % G), dims 4 rem..+3:
  // the (token, head) pair is walked, one division in all (a division per item, with its 64-bit
  // address, was ~50 instructions per item: ~1,200 per thread at 48 rows).
  constexpr int NQ = R * (D / 4) / VA_THREADS;  // 8-byte items per thread
  constexpr int RS = VA_THREADS / (D / 4);      // rows between a thread's items
  static_assert(R * (D / 4) % VA_THREADS == 0 && VA_THREADS % (D / 4) == 0, "Q items split evenly");
  u64 raw[NQ];
  {
    const int r0 = tid / (D / 4), rem = tid % (D / 4);
    int qt_tok = r0 / G, grp = r0 - qt_tok * G;
    const unsigned short* qp = q + (i64)(q_start + q_lo + qt_tok) * stride_q_tok +
                               (i64)(h * G + grp) * stride_q_head + 4 * rem;
    const i64 step = (i64)RS * stride_q_head, wrap = (i64)stride_q_tok - (i64)G * stride_q_head;
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
      raw[i] = r0 + RS * i < rows ? *reinterpret_cast<const u64*>(qp) : 0;
      grp += RS;
      qp += step;
      while (grp >= G) grp -= G, qp += wrap;
    }
  }

  int nblk, nslot;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    const int kb0 = tile_kb(s);
    lookup(kb0, nblk, nslot);
    if (kb0 < n_end) issue(s, kb0, nblk, nslot);
    cp_async_commit();
  }
  int next_kb = tile_kb(STAGES - 1);  // the tile looked up, copied in the next iteration
  // Diagnosis stamps (trace only): 6 = the first tiles' copies issued, 7 = Q in shared memory.
  if (trace && tid == 0) trace[(blockIdx.y * gridDim.x + blockIdx.x) * 8 + 6] = globaltimer();
  lookup(next_kb, nblk, nslot);

  // ---- Q -> shared memory, fp16, pre-scaled, d permuted within each 16-chunk to match the K
  // words a thread reads (physical d = 16 s + 4 cc + e -> logical k = 16 s + 2 cc + e, e < 2, or
  // 16 s + 8 + 2 cc + e - 2), stored in the K-major core-matrix layout (raw[] loaded above).
  {
    const float qs = (float)qk_scale_d;
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
      const int it = tid + i * VA_THREADS;
      const int r = it / (D / 4), rem = it % (D / 4);
      const int s = rem >> 2, cc = rem & 3;
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = to_f32<BF16>((unsigned short)(raw[i] >> (16 * e))) * qs;
      const u32 base = q_s + (r >> 3) * QSBO + 2 * s * 128 + (r & 7) * 16 + 4 * cc;
      const u32 lo = pack_f16(v[0], v[1]), hi = pack_f16(v[2], v[3]);
      sts32(base, lo);
      sts32(base + 128, hi);
      // Row sum of the fp16 Q as stored (the K bias below): the 64 items of row r are those of
      // 64 consecutive threads (two warps), reduced by shuffles, the two warps' halves in red_s.
      float qsum = (f16_lo(lo) + f16_hi(lo)) + (f16_lo(hi) + f16_hi(hi));
#pragma unroll
      for (int m = 1; m < 32; m *= 2) qsum += shfl_xor(qsum, m);
      static_assert(D / 4 == 64 || D / 4 == 32, "a row's items span two warps or one");
      if (D / 4 == 64) {
        if (lane == 0) red_s[(warp & 1) * R + r] = qsum;
      } else if (lane == 0) {
        red_s[r] = qsum, red_s[R + r] = 0.f;
      }
    }
    fence_proxy_async();  // the loop's first __syncthreads then orders these before wgmma reads
    __syncthreads();      // red_s: Q row sums
    // m_s (free until the epilogue) holds -1152 x the row sum: S's accumulator starts there, so
    // K enters the QK product as int8 + 1152 (the magic-number fp16, no subtraction per pair).
    if (tid < R) m_s[tid] = -1152.f * (red_s[tid] + red_s[R + tid]);
    if (trace && tid == 0) trace[(blockIdx.y * gridDim.x + blockIdx.x) * 8 + 7] = globaltimer();
  }

  // This thread's query rows in both accumulators: 8 j + 2 c + e.
  int qpos[N8][2];
#pragma unroll
  for (int j = 0; j < N8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) qpos[j][e] = ctx + q_lo + (8 * j + 2 * c + e) / G;

  float m_r[N8][2], l_r[N8][2];  // running max (log2 units; every thread holds the same) and
                                 // this thread's partial row sum
#pragma unroll
  for (int j = 0; j < N8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) m_r[j][e] = M_EMPTY, l_r[j][e] = 0.f;
  float acc[MTD][N8][4];
#pragma unroll
  for (int t = 0; t < MTD; ++t)
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][j][i] = 0.f;

  const u32 qd_lo = wg_desc_lo(q_s, 128), pd_lo = wg_desc_lo(p_s, 128);  // Q, P descriptors
  int ntiles = 0;  // tiles done (trace)
  for (int it = 0;; ++it) {
    const int kb = tile_kb(it);  // idx_s of tile it was published >= 2 barriers ago
    if (kb >= n_end) break;      // uniform over the CTA
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile `it` landed; every warp is done with tile it - 1 (and its P reads)
    if (trace && it == 0 && tid == 0) trace[(blockIdx.y * gridDim.x + blockIdx.x) * 8 + 1] = globaltimer();
    if (next_kb < n_end) issue(it + STAGES - 1, next_kb, nblk, nslot);
    cp_async_commit();
    next_kb = tile_kb(it + STAGES);
    lookup(next_kb, nblk, nslot);
    if (DYN && tid == 0) {
      const int idx = first_dyn + grab;  // tile it + STAGES + 1
      idx_s[(it + STAGES + 1) & 7] = idx;
      if (idx < total) grab = atomicAdd(ctr, 1);  // tile it + STAGES + 2
    }
    ++ntiles;

    const u32 st = kv_s + (it % STAGES) * (BN * RP);

    // ---- S^T = K Q^T: s[j][2 hh + e] is key 16 w + g + 8 hh, query row 8 j + 2 c + e.
    // K enters as int8 + 1152 (i8x4_to_f16_biased): the accumulator starts at -1152 x the fp16
    // Q row sum (m_s, from the prologue), so S comes out unbiased. The bias term is ~20-30x S in
    // int8 units; fp32 accumulation keeps S to ~1e-4 of it (the K scale then shrinks it further).
    float s[N8][4];
#pragma unroll
    for (int j = 0; j < N8; ++j) {
      const float2 nb = *reinterpret_cast<const float2*>(m_s + 8 * j + 2 * c);
      s[j][0] = nb.x, s[j][1] = nb.y, s[j][2] = nb.x, s[j][3] = nb.y;
    }
    const u32 k0 = st + (warp * 16 + g) * RP + shift + 4 * c;
#pragma unroll
    for (int kb4 = 0; kb4 < D / 16; kb4 += 4) {
      u32 a[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        i8x4_to_f16_biased(lds32(k0 + 16 * (kb4 + i)), a[i][0], a[i][2]);
        i8x4_to_f16_biased(lds32(k0 + 8 * RP + 16 * (kb4 + i)), a[i][1], a[i][3]);
      }
      wg_fence();  // A registers (and, first time, S) written by this thread
#pragma unroll
      for (int i = 0; i < 4; ++i) wgmma_rs<N8>(s, a[i], wg_desc_at(qd_lo, QSBO, (kb4 + i) * 256));
    }
    wg_commit();

    // Scales of this thread's two keys (read while the products run).
    float ksc[2], vsc[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const u32 row = st + (warp * 16 + g + 8 * hh) * RP + shift;
      ksc[hh] = lds_f32(row + D);
      vsc[hh] = lds_f32(row + 2 * D + 4);
    }
    wg_wait<0>();

#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] *= ksc[i >> 1];
    const bool need_mask = kb + BN > n_end || kb + BN - 1 > ctx + q_lo ||
                           (window > 0 && kb < ctx + q_hi - window);
    if (need_mask) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int kpos = kb + warp * 16 + g + 8 * hh;
#pragma unroll
        for (int j = 0; j < N8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int qp = qpos[j][e];
            const bool vis = kpos < n_end && kpos <= qp && (window <= 0 || qp - kpos < window);
            if (!vis) s[j][2 * hh + e] = NEG_INF;
          }
      }
    }
    // Lazy max: the running max moves only when a score exceeds it by
    // more than 2^8. Each thread checks its own scores; a CTA-wide vote (the barrier that was
    // there anyway) skips the row-max exchange, alpha and the rescale on the tiles where no row
    // moves (all but the first few): the fast path computes exactly what the slow one would
    // (mn = mo, alpha = 1). m_r starts at M_EMPTY (finite), so p = ex2(s - m) needs no -inf test.
    bool up = false;
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) up |= fmaxf(s[j][e], s[j][2 + e]) > m_r[j][e] + 8.f;
    if (__syncthreads_or(up)) {  // also: every warp is past its reads of red_s (last slow tile)
      // Row max over this warp's 16 keys (lanes of one c), then across the 4 warps.
#pragma unroll
      for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float mx = fmaxf(s[j][e], s[j][2 + e]);
          mx = fmaxf(mx, shfl_xor(mx, 4));
          mx = fmaxf(mx, shfl_xor(mx, 8));
          mx = fmaxf(mx, shfl_xor(mx, 16));
          if (g == 0) red_s[warp * R + 8 * j + 2 * c + e] = mx;
        }
      __syncthreads();  // row maxima of all warps

      // ---- online softmax; P (times the V scale) -> shared memory as fp16, keys g and g + 8
      // packed at logical k = 16 w + 2 g.
      float al[N8][2];
      bool rescale = false;
#pragma unroll
      for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int row = 8 * j + 2 * c + e;
          float tmax = red_s[row];
#pragma unroll
          for (int w = 1; w < NW; ++w) tmax = fmaxf(tmax, red_s[w * R + row]);
          const float mo = m_r[j][e];
          const float mn = tmax > mo + 8.f ? tmax : mo;  // M_EMPTY stays while tmax = -inf
          const float alpha = mn == mo ? 1.f : ex2(mo - mn);  // 0 from M_EMPTY
          m_r[j][e] = mn;
          const float p0 = ex2(s[j][e] - mn);
          const float p1 = ex2(s[j][2 + e] - mn);
          l_r[j][e] = l_r[j][e] * alpha + (p0 + p1);
          al[j][e] = alpha;
          rescale |= alpha != 1.f;
          sts32(p_s + j * PSBO + (2 * warp + (g >> 2)) * 128 + (2 * c + e) * 16 + 4 * (g & 3),
                pack_f16(p0 * vsc[0], p1 * vsc[1]));
        }
      if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
        for (int t = 0; t < MTD; ++t)
#pragma unroll
          for (int j = 0; j < N8; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[t][j][i] *= al[j][i & 1];
      }
    } else {
#pragma unroll
      for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p0 = ex2(s[j][e] - m_r[j][e]);
          const float p1 = ex2(s[j][2 + e] - m_r[j][e]);
          l_r[j][e] += p0 + p1;
          sts32(p_s + j * PSBO + (2 * warp + (g >> 2)) * 128 + (2 * c + e) * 16 + 4 * (g & 3),
                pack_f16(p0 * vsc[0], p1 * vsc[1]));
        }
    }
    fence_proxy_async();
    __syncthreads();  // P of all warps

    // ---- O^T += V^T P^T over this warp's D/4 output dims: per 16-key chunk kk, one wgmma per
    // m64 tile. Logical k (2c, 2c+1) = keys (c, c + 8), (2c + 8, 2c + 9) = keys (c + 4, c + 12).
    const u32 v0 = st + shift + D + 4 + warp * DW + 4 * g;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      u32 af[MTD][4];
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) {
        const int key = 16 * kk + c + 4 * kp;
#pragma unroll
        for (int wd = 0; wd < WV; ++wd) {
          const u32 w0 = lds32(v0 + key * RP + 32 * wd);
          const u32 w1 = lds32(v0 + (key + 8) * RP + 32 * wd);
          u32 hv[4];
          i8x4_to_f16(prmt(w0, w1, 0x5140u), hv[0], hv[1]);  // d +0, +1 of keys (key, key + 8)
          i8x4_to_f16(prmt(w0, w1, 0x7362u), hv[2], hv[3]);  // d +2, +3
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int f = 4 * wd + jj;  // -> m64 tile f % MTD, row half f / MTD
            af[f % MTD][f / MTD + 2 * kp] = hv[jj];
          }
        }
      }
      wg_fence();  // A registers (and, after a rescale, acc) written by this thread
#pragma unroll
      for (int t = 0; t < MTD; ++t) wgmma_rs<N8>(acc[t], af[t], wg_desc_at(pd_lo, PSBO, kk * 256));
    }
    wg_commit();
    wg_wait<0>();  // P may be overwritten (after the next __syncthreads); acc readable
  }
  cp_async_wait<0>();
  // The combine kernel, when launched with programmatic dependent launch, may start its CTAs
  // from here on (it waits for this grid's completion and memory before reading the partials).
  griddep_launch_dependents();
  if (DYN && tid == 0 && grab == max(total - first_dyn, 0) + num_splits - 1)
    atomicExch(ctr, 0);  // the unit's last (failing) counter value: reset for the next launch
  u64* const tr = trace ? trace + (blockIdx.y * gridDim.x + blockIdx.x) * 8 : nullptr;
  if (tr && tid == 0) tr[2] = globaltimer(), tr[4] = ntiles, tr[5] = smid();

  // ---- epilogue: row sums over the 8 lanes of one c and the warps; running max from warp 0
#pragma unroll
  for (int j = 0; j < N8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_r[j][e];
      l += shfl_xor(l, 4);
      l += shfl_xor(l, 8);
      l += shfl_xor(l, 16);
      const int row = 8 * j + 2 * c + e;
      if (g == 0) red_s[warp * R + row] = l;
      if (warp == 0 && g == 0) m_s[row] = m_r[j][e] == M_EMPTY ? NEG_INF : m_r[j][e];
    }
  __syncthreads();

  // The 86a6d8f epilogue, written out: calling a shared store helper here changed the 48-row
  // kernel's main loop (ptxas 13.0: a parameter reloaded per tile, other register moves) and the
  // H200 run of a164f83..0deae12 timed T=8 2-3% slower than 86a6d8f (HISTORY.md).
#pragma unroll
  for (int j = 0; j < N8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 8 * j + 2 * c + e;
      if (row >= rows) continue;
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) l += red_s[w * R + row];
      const int t = row / G, grp = row - (row / G) * G;
      const i64 tok = q_start + q_lo + t;
      const int hq = h * G + grp;
      if (num_splits == 1) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        unsigned short* o = out + tok * stride_o_tok + (i64)hq * stride_o_head + warp * DW + 4 * g;
#pragma unroll
        for (int wd = 0; wd < WV; ++wd) {
          float v[4];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int f = 4 * wd + jj;
            v[jj] = acc[f % MTD][j][2 * (f / MTD) + e] * inv;
          }
          uint2 pk;
          pk.x = pack_out<BF16>(v[0], v[1]);
          pk.y = pack_out<BF16>(v[2], v[3]);
          *reinterpret_cast<uint2*>(o + 32 * wd) = pk;
        }
      } else {
        const i64 pr = (tok * Hq + hq) * num_splits + split;
        float* pa = part_acc + pr * D + warp * DW + 4 * g;
#pragma unroll
        for (int wd = 0; wd < WV; ++wd) {
          float4 v;
          v.x = acc[(4 * wd + 0) % MTD][j][2 * ((4 * wd + 0) / MTD) + e];
          v.y = acc[(4 * wd + 1) % MTD][j][2 * ((4 * wd + 1) / MTD) + e];
          v.z = acc[(4 * wd + 2) % MTD][j][2 * ((4 * wd + 2) / MTD) + e];
          v.w = acc[(4 * wd + 3) % MTD][j][2 * ((4 * wd + 3) / MTD) + e];
          *reinterpret_cast<float4*>(pa + 32 * wd) = v;
        }
        if (warp == 0 && g == 0) {
          part_ml[pr * 2] = m_s[row];
          part_ml[pr * 2 + 1] = l;
        }
      }
    }
  if (tr && tid == 0) tr[3] = globaltimer();
}

// ---------------------------------------------------------------------------------------------
// verify_attn_decode: the split kernel for at most 8 query rows per KV head (plain decode, T=1 at
// G=6; T=2 at G=4). One CTA per (request, split) holds every KV head: a producer warp streams the
// CTA's 16-key chunks as whole page slices (16 slots x all heads: 33,280 contiguous bytes at
// Qwen3.8's shapes) with TMA bulk copies into a STAGES-deep shared ring (full / empty
// mbarriers), and 8 consumer warps compute: warp w takes KV head w % HKV of every (8 / HKV)-th
// chunk. No CTA barrier in the loop.
//
// Why: at T=1 the wgmma kernel's split kernel alone takes ~63 µs at 100K b1 (~78% of copy), as
// does its read-only probe, while a read-only probe of exactly this shape (one CTA per SM, TMA
// copies of whole page slices, a 6-deep ring of 33 KB) read the same bytes in 52 µs (94.7%,
// session 5's ceiling_stream probe, e2d4049). Three earlier versions of this kernel without the
// copy engine (fragments loaded into registers; per-warp cp.async rings, one head per CTA; the
// same with every head in one CTA) took 97.6 / 63.2 / 70.0 µs for the split kernel (H200,
// HISTORY.md, session 8).
// * Chunks: absolute 16-key blocks (page sizes are multiples of 16, so a chunk is one page's
//   slice); the CTA of split s takes chunks s + j num_splits (j < STAGES), then batches of 4 from
//   a per-request counter and single chunks at the tail, so all CTAs sweep the context together
//   and end together. Keys past k_hi or before k_lo in a chunk are copied (their page exists)
//   and masked.
// * S^T = K Q^T with mma.sync m16n8k16 (keys g, g + 8 on M, query rows on N = 8): in k-step j
//   thread (g, t) reads the 4 bytes at 16 j + 4 t of keys g and g + 8, its A fragment once the
//   contraction index is permuted (physical dims 16 j + 4 t + 0..3 = logical 2t, 2t+1, 2t+8,
//   2t+9); Q^T's B fragments (pre-scaled fp16, permuted alike, per head) are read from shared
//   memory. K enters as int8 + 1152 with S's accumulator starting at -1152 x the fp16 Q row sum
//   (as in verify_attn_split_wg).
// * P^T for the PV product comes from S^T's accumulator by one movmatrix (8x8 transpose) per 8
//   keys. O^T = V^T P^T (dims on M, query rows on N): thread (g, t) reads the 4 bytes at 4 g + 32 i
//   of V for keys 2t, 2t+1, 2t+8, 2t+9, pairs keys with one prmt and converts exactly; m16 tile
//   2 i + p holds dims 32 i + 4 g + 2 p (+1 in rows g + 8), so a thread's output row holds 4
//   contiguous dims per i.
// * Online softmax per warp (row max over the 8 lanes of a query-row pair by shuffles), lazy as in
//   the other kernels (the max moves only by more than 2^8); at the end each head's warps merge in
//   shared memory (over the ring) and write one partial (or the output when num_splits == 1).
// ---------------------------------------------------------------------------------------------
namespace va {

// 8x8 transpose of 16-bit values across the warp: in, thread (g, t) holds row g, cols 2t, 2t+1;
// out, row g of the transpose (cols 2t, 2t+1 = rows 2t, 2t+1 of the input at col g).
DI u32 movmatrix_t(u32 a) {
  u32 r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(a));
  return r;
}
}  // namespace va

// Shared memory (launcher: smem_bytes_decode): the ring [STAGES][16 slots][HKV records of 2 D + 8
// bytes] (or the merge scratch if larger), each head's Q^T fragments [HKV][D / 16][32] x 8 bytes,
// the mbarriers full[STAGES], empty[STAGES], the stages' chunk indices [STAGES]. After the loop
// the first region holds the consumer warps' (max, sum) [8][8][2] and accumulators [8][8][D] for
// the merge of each head's warps. (A switch copying one contiguous chunk range per CTA, as the
// probe does, measured no faster: b481143. A merge inside the kernel after a per-request arrival
// counter measured no faster than the combine kernel: 4131fb8, removed in b109856. Read-only
// probe modes (the consumers released each chunk unread) were removed with the diagnosis tools
// that used them; they stay at 980f645.)
template <int D, int STAGES, int HKV, bool BF16>
__global__ void __launch_bounds__(288, 1) verify_attn_decode(
    VA_SPLIT_ARGS,
    int* __restrict__ tile_ctr,           // [B] chunk-batch counters, zero between launches
    u64* __restrict__ trace_buf,          // [CTAs][8] %globaltimer stamps when trace_on (diag)
    int trace_on) {
  using namespace va;
  // Stamps: 0 CTA start, 1 producer done issuing, 2 consumers done, 3 partials written, 4 SM id,
  // 5 chunks the CTA copied.
  u64* const tr = trace_on ? trace_buf + (blockIdx.y * gridDim.x + blockIdx.x) * 8 : nullptr;
  if (tr && threadIdx.x == 0) tr[0] = globaltimer();
  constexpr int NI = D / 32;              // 32-dim blocks
  constexpr int KS = D / 16;              // k-steps of QK = m16 tiles of PV
  constexpr int NWD = 8;                  // consumer warps; warp NWD is the producer
  constexpr int SUB = NWD / HKV;          // consumer warps per KV head
  constexpr int REC = 2 * D + 8;          // one (slot, head) record
  constexpr int SLOTB = HKV * REC;        // one slot: the ring's row pitch
  constexpr int STAGE = 16 * SLOTB;       // one chunk: 16 slots
  static_assert(D == 128 || D == 256, "head size 128 or 256");
  static_assert(NWD % HKV == 0, "1, 2, 4 or 8 KV heads");
  constexpr int SCR = NWD * 8 * (D + 2) * 4;  // merge scratch
  constexpr int R0 = STAGES * STAGE > SCR ? STAGES * STAGE : SCR;
  extern __shared__ __align__(128) unsigned char dsmem[];
  const u32 ring0 = smem_addr(dsmem);
  const u32 qf_all = ring0 + R0;  // [HKV][KS][32] uint2
  const u32 full0 = qf_all + HKV * KS * 256, empty0 = full0 + 8 * STAGES;
  volatile int* const idx_s = reinterpret_cast<volatile int*>(dsmem + R0 + HKV * KS * 256 + 16 * STAGES);  // [STAGES]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int h = warp % HKV, sub = warp / HKV;  // consumers (warp < NWD)
  const int qt = blockIdx.x % num_q_tiles;
  const int split = blockIdx.x / num_q_tiles;
  const int b = blockIdx.y;

  Unit un;
  if (!unit_at(un, cu_q, seq_lens, b, qt, block_q, G, window)) return;  // uniform over the CTA
  const int q_start = un.q_start, q_lo = un.q_lo, q_hi = un.q_hi;
  const int rows = un.rows;  // <= 8 (launcher)
  const int ctx = un.ctx, k_hi = un.k_hi, k_lo = un.k_lo;
  const int c_lo = k_lo >> 4;  // chunks are absolute 16-key blocks: one page's slice each
  const int n_chunks = k_hi > k_lo ? ((k_hi - 1) >> 4) - c_lo + 1 : 0;
  const int Hq = num_kv_heads * G;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, HKV);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the mbarriers: the producer starts copying while the consumers load Q

  float m_r[2] = {M_EMPTY, M_EMPTY}, l_r[2] = {0.f, 0.f};
  float acc[KS][4];
#pragma unroll
  for (int i = 0; i < KS; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;

  if (warp == NWD) {
    // ---- producer. Chunks: first split + j num_splits (j < STAGES, no atomic before the first
    // copies), then batches of 4 consecutive chunks (single ones at the tail, below) from the
    // request's counter (dynamic, as the wgmma kernel's DYN tiles: CTAs that stream faster take
    // more; with static chunks the CTAs' ends spread over ~10 µs at 100K b1, H200). The lanes
    // look a batch's page slices up at once; lane 0 posts each chunk's index and copy once its
    // stage's previous chunk is consumed, then SUB sentinels (-1) end the consumers' loops.
    const int* const bt_row = block_table + (i64)b * stride_bt;
    int k = 0;  // chunks posted
    auto post = [&](int ci, u64 src) {  // lane 0
      const int st = k % STAGES;
      if (k >= STAGES) mbar_wait(empty0 + 8 * st, ((k / STAGES) - 1) & 1);
      idx_s[st] = ci;
      if (ci >= 0) {
        mbar_expect_tx(full0 + 8 * st, STAGE);
        bulk_g2s(ring0 + st * STAGE, src, STAGE, full0 + 8 * st);
      } else {
        mbar_arrive(full0 + 8 * st);  // the release orders idx_s before the consumers' acquire
      }
      ++k;
    };
    auto post_batch = [&](int c0, int step, int cnt) {  // chunks c0 + i step, i < cnt <= 32
      const int c = c0 + lane * step;
      u64 src = 0;
      if (lane < cnt && c < n_chunks) {
        const int kb = (c_lo + c) << 4;
        const int p = (int)((u32)kb / (u32)page);
        src = reinterpret_cast<u64>(kv) + (u64)((i64)bt_row[p] * stride_kv_blk + (i64)(kb - p * page) * stride_kv_slot);
      }
      for (int i = 0; i < cnt; ++i) {
        const u64 sk = ((u64)shfl_idx((u32)(src >> 32), i) << 32) | shfl_idx((u32)src, i);
        if (lane == 0 && c0 + i * step < n_chunks) post(c0 + i * step, sk);
      }
    };
    // Grabs 0 .. n4 - 1 take 4 chunks each, the next ones single chunks (the last ~2 per CTA):
    // a batch of 4 is ~4 µs of one SM's share of the stream at 100K b1, so with batches only the
    // CTAs' ends spread over ~4 µs (H200 stamps, session 9); single chunks at the tail end them
    // within about one chunk. Every grab below `ok` is whole; each CTA ends on one failing grab.
    int* const ctr = tile_ctr + b;
    const int first_dyn = STAGES * num_splits;
    const int n_dyn = max(n_chunks - first_dyn, 0);
    const int n4 = max(n_dyn - 2 * num_splits, 0) / 4;  // batches of 4
    const int ok = n4 + (n_dyn - 4 * n4);                // successful grabs: batches, then singles
    int g = 0;
    if (lane == 0) g = atomicAdd(ctr, 1);  // in flight while the static chunks are posted
    post_batch(split, num_splits, STAGES);
    g = shfl_idx((u32)g, 0);
    while (g < ok) {
      int g2 = 0;
      if (lane == 0) g2 = atomicAdd(ctr, 1);  // the next grab, in flight meanwhile
      if (g < n4) post_batch(first_dyn + 4 * g, 1, 4);
      else post_batch(first_dyn + 4 * n4 + (g - n4), 1, 1);
      g = shfl_idx((u32)g2, 0);
    }
    // The unit's last failing grab resets the counter for the next launch (graph replay).
    if (lane == 0 && g == ok + num_splits - 1) atomicExch(ctr, 0);
    if (lane == 0)
      for (int i = 0; i < SUB; ++i) post(-1, 0);
    if (tr && lane == 0) tr[1] = globaltimer(), tr[5] = k;
  } else {
  // ---- consumers: Q^T fragments -> shared memory (fp16, pre-scaled, dims permuted as the K
  // reads are), then a barrier of the 8 consumer warps only (named barrier 1).
  {
    // Every load first, then the conversions: one memory round trip per thread, not QE dependent
    // ones (the loop's stores kept the compiler from hoisting them; each trip queues behind the
    // producer's first ring of bulk copies).
    constexpr int QE = HKV * KS * 32 / (NWD * 32);
    static_assert(HKV * KS * 32 % (NWD * 32) == 0, "Q fragments per consumer thread");
    const float qs = (float)qk_scale_d;
    uint2 raw[QE];
#pragma unroll
    for (int i = 0; i < QE; ++i) {
      const int e = tid + i * NWD * 32;
      const int hq0 = (e / (KS * 32)) * G, j = (e >> 5) % KS, rg = (e & 31) >> 2, rt = e & 3;
      raw[i] = make_uint2(0u, 0u);
      if (rg < rows) {
        const int tk = rg / G, grp = rg - tk * G;
        raw[i] = *reinterpret_cast<const uint2*>(
            q + (i64)(q_start + q_lo + tk) * stride_q_tok + (i64)(hq0 + grp) * stride_q_head + 16 * j + 4 * rt);
      }
    }
#pragma unroll
    for (int i = 0; i < QE; ++i) {
      const int e = tid + i * NWD * 32;
      // rows past `rows` loaded zeros: they stay zero (0 x qs)
      sts32(qf_all + 8 * e, pack_f16(to_f32<BF16>((unsigned short)(raw[i].x & 0xffffu)) * qs,
                                     to_f32<BF16>((unsigned short)(raw[i].x >> 16)) * qs));
      sts32(qf_all + 8 * e + 4, pack_f16(to_f32<BF16>((unsigned short)(raw[i].y & 0xffffu)) * qs,
                                         to_f32<BF16>((unsigned short)(raw[i].y >> 16)) * qs));
    }
  }
  asm volatile("bar.sync 1, %0;\n" ::"n"(NWD * 32) : "memory");

    // Row sums of the fp16 Q as stored (the K bias): lane (g, t) adds row g's values of its head's
    // fragments, then the 4 lanes of g; this thread's S columns are query rows 2t, 2t+1.
    const u32 qf_s = qf_all + h * (KS * 256);
    float qr = 0.f;
#pragma unroll
    for (int j = 0; j < KS; ++j) {
      const uint2 fr = lds64(qf_s + 8 * (j * 32 + lane));
      qr += (f16_lo(fr.x) + f16_hi(fr.x)) + (f16_lo(fr.y) + f16_hi(fr.y));
    }
    qr += shfl_xor(qr, 1);
    qr += shfl_xor(qr, 2);
    const float nb0 = -1152.f * __shfl_sync(0xffffffffu, qr, 8 * t);
    const float nb1 = -1152.f * __shfl_sync(0xffffffffu, qr, 8 * t + 4);

    // ---- consumer: chunks k = sub, sub + SUB, ... of this CTA, head h.
    for (int k = sub;; k += SUB) {
      const int st = k % STAGES;
      mbar_wait(full0 + 8 * st, (k / STAGES) & 1);
      const int ci = idx_s[st];
      if (ci < 0) break;  // the producer's sentinel
      const u32 rec0 = ring0 + st * STAGE + h * REC;  // key kk's record: rec0 + kk * SLOTB
      const int kb = (c_lo + ci) << 4;

      // S^T: s[2 hh + e] = key g + 8 hh, query row 2 t + e.
      float s[4] = {nb0, nb1, nb0, nb1};
      const u32 k0 = rec0 + g * SLOTB + 4 * t;
#pragma unroll
      for (int j = 0; j < KS; ++j) {
        const uint2 qb = lds64(qf_s + 8 * (j * 32 + lane));
        const u32 w0 = lds32(k0 + 16 * j);
        const u32 w1 = lds32(k0 + 8 * SLOTB + 16 * j);
        u32 a[4];
        i8x4_to_f16_biased(w0, a[0], a[2]);
        i8x4_to_f16_biased(w1, a[1], a[3]);
        mma16816(s, a, qb.x, qb.y);
      }
      const float ks0 = lds_f32(rec0 + g * SLOTB + D), ks1 = lds_f32(rec0 + (g + 8) * SLOTB + D);
      float vs0 = lds_f32(rec0 + g * SLOTB + 2 * D + 4), vs1 = lds_f32(rec0 + (g + 8) * SLOTB + 2 * D + 4);
      s[0] *= ks0, s[1] *= ks0, s[2] *= ks1, s[3] *= ks1;
      const bool need_mask = kb + 16 > k_hi || kb + 15 > ctx + q_lo || (window > 0 && kb < ctx + q_hi - window);
      if (need_mask) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int kpos = kb + g + 8 * hh;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int qp = ctx + q_lo + (2 * t + e) / G;
            const bool vis = kpos < k_hi && kpos <= qp && (window <= 0 || qp - kpos < window);
            if (!vis) s[2 * hh + e] = NEG_INF;
          }
          // Records outside [k_lo, k_hi) may hold anything (their scales too): P x 0, not P x NaN.
          if (kpos >= k_hi || kpos < k_lo) (hh ? vs1 : vs0) = 0.f;
        }
      }
      const float c0 = fmaxf(s[0], s[2]), c1 = fmaxf(s[1], s[3]);
      if (__any_sync(0xffffffffu, c0 > m_r[0] + 8.f || c1 > m_r[1] + 8.f)) {
        float t0 = c0, t1 = c1;
#pragma unroll
        for (int m = 4; m < 32; m *= 2) t0 = fmaxf(t0, shfl_xor(t0, m)), t1 = fmaxf(t1, shfl_xor(t1, m));
        const float mn0 = t0 > m_r[0] + 8.f ? t0 : m_r[0];
        const float mn1 = t1 > m_r[1] + 8.f ? t1 : m_r[1];
        const float al0 = mn0 == m_r[0] ? 1.f : ex2(m_r[0] - mn0);
        const float al1 = mn1 == m_r[1] ? 1.f : ex2(m_r[1] - mn1);
        m_r[0] = mn0, m_r[1] = mn1;
        l_r[0] *= al0, l_r[1] *= al1;
#pragma unroll
        for (int i = 0; i < KS; ++i) acc[i][0] *= al0, acc[i][1] *= al1, acc[i][2] *= al0, acc[i][3] *= al1;
      }
      const float p0 = ex2(s[0] - m_r[0]), p1 = ex2(s[1] - m_r[1]);
      const float p2 = ex2(s[2] - m_r[0]), p3 = ex2(s[3] - m_r[1]);
      l_r[0] += p0 + p2, l_r[1] += p1 + p3;
      const u32 b0 = movmatrix_t(pack_f16(p0 * vs0, p1 * vs0));  // keys 2t, 2t+1 of query row g
      const u32 b1 = movmatrix_t(pack_f16(p2 * vs1, p3 * vs1));  // keys 2t+8, 2t+9
      // O^T += V^T P^T: m16 tile 2 i + p, rows g / g + 8 = dims 32 i + 4 g + 2 p / + 1.
      const u32 v0 = rec0 + D + 4 + 4 * g + 2 * t * SLOTB;  // key 2t
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const u32 x0 = lds32(v0 + 32 * i), x1 = lds32(v0 + SLOTB + 32 * i);                // keys 2t, 2t+1
        const u32 y0 = lds32(v0 + 8 * SLOTB + 32 * i), y1 = lds32(v0 + 9 * SLOTB + 32 * i);  // 2t+8, 2t+9
        u32 e[4], f[4];
        i8x4_to_f16(prmt(x0, x1, 0x5140u), e[0], e[1]);  // dims +0, +1 of keys 2t, 2t+1
        i8x4_to_f16(prmt(x0, x1, 0x7362u), e[2], e[3]);  // dims +2, +3
        i8x4_to_f16(prmt(y0, y1, 0x5140u), f[0], f[1]);  // keys 2t+8, 2t+9
        i8x4_to_f16(prmt(y0, y1, 0x7362u), f[2], f[3]);
        const u32 a0[4] = {e[0], e[1], f[0], f[1]};
        const u32 a1[4] = {e[2], e[3], f[2], f[3]};
        mma16816(acc[2 * i], a0, b0, b1);
        mma16816(acc[2 * i + 1], a1, b0, b1);
      }
      __syncwarp();  // every lane is done with the stage
      if (lane == 0) mbar_arrive(empty0 + 8 * st);
    }
  }
  // The combine kernel, when launched with programmatic dependent launch, may start its CTAs
  // from here on (it waits for this grid's completion and memory before reading the partials).
  griddep_launch_dependents();
  __syncthreads();  // every chunk copied was consumed: the merge scratch overlays the ring
  if (tr && tid == 0) tr[2] = globaltimer(), tr[4] = smid();

  // ---- merge each head's warps, then one partial row (or the output) per query row.
  float* const ml_s = reinterpret_cast<float*>(dsmem);  // [NWD][8][2]
  float* const acc_s = ml_s + NWD * 8 * 2;              // [NWD][8][D]
  if (warp < NWD) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_r[e];
      l += shfl_xor(l, 4);
      l += shfl_xor(l, 8);
      l += shfl_xor(l, 16);
      const int row = 2 * t + e;
      if (g == 0) ml_s[(warp * 8 + row) * 2] = m_r[e], ml_s[(warp * 8 + row) * 2 + 1] = l;
#pragma unroll
      for (int i = 0; i < NI; ++i)
        *reinterpret_cast<float4*>(acc_s + (warp * 8 + row) * D + 32 * i + 4 * g) =
            make_float4(acc[2 * i][e], acc[2 * i][2 + e], acc[2 * i + 1][e], acc[2 * i + 1][2 + e]);
    }
  }
  __syncthreads();
  for (int it = tid; it < HKV * 8 * (D / 4); it += blockDim.x) {
    const int hm = it / (8 * (D / 4)), row = (it / (D / 4)) % 8, d4 = it % (D / 4);
    if (row >= rows) continue;
    float mx = M_EMPTY;
#pragma unroll
    for (int w = hm; w < NWD; w += HKV) mx = fmaxf(mx, ml_s[(w * 8 + row) * 2]);
    float l = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = hm; w < NWD; w += HKV) {
      const float wt = ex2(ml_s[(w * 8 + row) * 2] - mx);  // a warp without keys: 0 (or 1 x 0)
      l += wt * ml_s[(w * 8 + row) * 2 + 1];
      const float4 x = *reinterpret_cast<const float4*>(acc_s + (w * 8 + row) * D + 4 * d4);
      a.x += wt * x.x, a.y += wt * x.y, a.z += wt * x.z, a.w += wt * x.w;
    }
    const int tk = row / G, grp = row - tk * G;
    const i64 tok = (i64)q_start + q_lo + tk;
    const int hq = hm * G + grp;
    if (num_splits == 1) {
      const float inv = l > 0.f ? 1.f / l : 0.f;
      uint2 pk;
      pk.x = pack_out<BF16>(a.x * inv, a.y * inv);
      pk.y = pack_out<BF16>(a.z * inv, a.w * inv);
      *reinterpret_cast<uint2*>(out + tok * stride_o_tok + (i64)hq * stride_o_head + 4 * d4) = pk;
    } else {
      const i64 pr = (tok * Hq + hq) * num_splits + split;
      *reinterpret_cast<float4*>(part_acc + pr * D + 4 * d4) = a;
      if (d4 == 0) part_ml[pr * 2] = mx == M_EMPTY ? NEG_INF : mx, part_ml[pr * 2 + 1] = l;
    }
  }
  if (tr) {
    __syncthreads();
    if (tid == 0) tr[3] = globaltimer();
  }
}
