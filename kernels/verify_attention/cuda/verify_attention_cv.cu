// verify_attn_cv: the split kernel for 9..48 query rows per KV head (T > 1) with a converter
// warpgroup: the operand conversions leave the math warps, and both products read shared memory.
//
// Appended after verify_attention.cu by the launcher (same namespace va, same helpers, same
// arguments and fp32 partials as verify_attn_split_wg; HH_VERIFY_ATTENTION_MMA=cv). Why: in the
// wgmma split kernel each 128-thread CTA does every phase of a tile in order and its loop is
// issue-latency bound at 2 warps per scheduler (NOTES.md sessions 3, 10): ~848 instructions per
// warp and tile, of which K's and V's gathers and int8 -> fp16 conversions for the
// register-sourced products are ~290 and the copy issue ~60-170. Here one CTA per SM holds one
// (KV head, query tile, split) unit:
// * WG 2 (converter, 4 warps; warp 0 also produces): TMA boxes (a tensor map over the cache)
//   bring 16-slot page groups of this head's 528-byte record windows into a ring of NH
//   half-stages (32 keys each). For each 64-key tile the converter writes K (int8, as it is) into
//   the math group's K buffer in the K-major core-matrix layout of the QK product's A operand, the
//   K and V scales beside it, and V^T as fp16 (exact int8 -> fp16, bytes transposed with prmt) in
//   the layout of the PV product's A operand; then it frees the half-stage at once, so the ring is
//   held only by the copy engine and the converter (~NH - 1 half-stages in flight).
// * WG 0 / WG 1 (math) take the unit's tiles alternately (tile t -> WG t % 2): S^T = K Q^T as one
//   s8 wgmma chain (M = 64 keys, N = Q's two int8 parts: q ~ sq (hi + lo / 254), exact to
//   max |q| / 64516), the scales, mask, the lazy online softmax, P (times the V scale) into the
//   group's P buffer, then O^T += V^T P^T as an fp16 SS wgmma. Each group keeps its own running
//   max and writes its own partial: split 2 * split + wg of 2 * num_splits (the combine merges).
// V^T's M rows are the output dims permuted so that the converter's 16-byte stores are
// conflict-free: row m holds dim 32 (m / 32) + 4 (m % 8) + (m / 8) % 4; the accumulator row
// 64 t + 16 w + g + 8 hh is dim 64 t + 32 (w / 2) + 4 g + 2 (w % 2) + hh (un-permuted at the store).
// Its K index is P's logical key order (verify_attn_split_wg: logical k = 16 w + 2 g + hh <->
// key 16 w + g + 8 hh of the tile).
//
// Shared memory (launcher: smem_bytes_cv): ring [NH][32][528] | V^T [2][D/8][BN/8] fp16 core
// matrices | K [2][BN/8][D/16] int8 core matrices | Q [2R/8][D/16] int8 core matrices | P
// [2][R/8][BN/8] | mbarriers full[NH], empty[NH], kfull[2], kempty[2], vfull[2], vempty[2] |
// floats ks [2][BN], vs [2][BN], red [2][4][R], sq [R].

namespace va {
DI void bar_sync_n(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
DI bool bar_or_n(int id, int n, bool p) {
  u32 r;
  asm volatile(
      "{ .reg .pred a, b;\n setp.ne.u32 a, %1, 0;\n"
      "barrier.cta.red.or.pred b, %2, %3, a;\n selp.u32 %0, 1, 0, b; }\n"
      : "=r"(r) : "r"((u32)p), "r"(id), "r"(n) : "memory");
  return r != 0;
}
// 3D tensor copy (TMA) of one box global -> shared, completing its bytes on the mbarrier; tmap is
// the generic address of a CUtensorMap in global memory (the launcher's, 64-byte aligned).
DI void tma3d(u32 dst, const void* tmap, int c0, int c1, int c2, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
// The same box into L2 only (no shared memory, no barrier): a later tma3d of it hits L2.
DI void tma3d_prefetch(const void* tmap, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n"
               ::"l"(tmap), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
template <int N>
DI void maxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
DI void maxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
DI uint4 lds128(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
DI void sts128(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d));
}

// D[64 x 8 N8] += A[64 x 16] (descriptor) B[16 x 8 N8] (descriptor), fp16 in, fp32 out, both
// K-major.
template <int N8>
DI void wgmma_ss(float (&d)[N8][4], u64 da, u64 db);
// D[64 x 16 N8] (+)= A[64 x 32] B[32 x 16 N8], int8 in, int32 out, both from shared memory
// (K-major, no swizzle); acc = 0: D = A B.
template <int N8>
DI void wgmma_s8(int (&d)[2 * N8][4], u64 da, u64 db, int acc);
template <>
DI void wgmma_ss<2>(float (&d)[2][4], u64 da, u64 db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
      : "l"(da), "l"(db));
}
template <>
DI void wgmma_ss<3>(float (&d)[3][4], u64 da, u64 db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n24k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, %12, %13, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3])
      : "l"(da), "l"(db));
}
template <>
DI void wgmma_ss<4>(float (&d)[4][4], u64 da, u64 db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db));
}
template <>
DI void wgmma_ss<5>(float (&d)[5][4], u64 da, u64 db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n40k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19}, %20, %21, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3])
      : "l"(da), "l"(db));
}
template <>
DI void wgmma_ss<6>(float (&d)[6][4], u64 da, u64 db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, %24, %25, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3])
      : "l"(da), "l"(db));
}
template <>
DI void wgmma_s8<2>(int (&d)[4][4], u64 da, u64 db, int acc) {
  asm volatile(
      "{ .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p;\n}\n"
      : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]),
        "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]),
        "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]),
        "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3])
      : "l"(da), "l"(db), "r"(acc));
}
template <>
DI void wgmma_s8<3>(int (&d)[6][4], u64 da, u64 db, int acc) {
  asm volatile(
      "{ .reg .pred p;\n setp.ne.b32 p, %26, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n48k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, %24, %25, p;\n}\n"
      : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]),
        "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]),
        "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]),
        "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]),
        "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]),
        "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3])
      : "l"(da), "l"(db), "r"(acc));
}
template <>
DI void wgmma_s8<4>(int (&d)[8][4], u64 da, u64 db, int acc) {
  asm volatile(
      "{ .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p;\n}\n"
      : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]),
        "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]),
        "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]),
        "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]),
        "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]),
        "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3]),
        "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3]),
        "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3])
      : "l"(da), "l"(db), "r"(acc));
}
template <>
DI void wgmma_s8<5>(int (&d)[10][4], u64 da, u64 db, int acc) {
  asm volatile(
      "{ .reg .pred p;\n setp.ne.b32 p, %42, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n80k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p;\n}\n"
      : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]),
        "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]),
        "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]),
        "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]),
        "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]),
        "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3]),
        "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3]),
        "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3]),
        "+r"(d[8][0]), "+r"(d[8][1]), "+r"(d[8][2]), "+r"(d[8][3]),
        "+r"(d[9][0]), "+r"(d[9][1]), "+r"(d[9][2]), "+r"(d[9][3])
      : "l"(da), "l"(db), "r"(acc));
}
template <>
DI void wgmma_s8<6>(int (&d)[12][4], u64 da, u64 db, int acc) {
  asm volatile(
      "{ .reg .pred p;\n setp.ne.b32 p, %50, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p;\n}\n"
      : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]),
        "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]),
        "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]),
        "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]),
        "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]),
        "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3]),
        "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3]),
        "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3]),
        "+r"(d[8][0]), "+r"(d[8][1]), "+r"(d[8][2]), "+r"(d[8][3]),
        "+r"(d[9][0]), "+r"(d[9][1]), "+r"(d[9][2]), "+r"(d[9][3]),
        "+r"(d[10][0]), "+r"(d[10][1]), "+r"(d[10][2]), "+r"(d[10][3]),
        "+r"(d[11][0]), "+r"(d[11][1]), "+r"(d[11][2]), "+r"(d[11][3])
      : "l"(da), "l"(db), "r"(acc));
}
}  // namespace va

// NH: ring half-stages of 32 keys (5 at D = 256, 48 rows: 222 KB with the rest). NCV: converter
// warpgroups (1: 384 threads; 2: 512, converter cw serving the math group of its tiles). MODE:
// 0, or a read-and-handshake probe for timing only (1: the math groups skip both products and the
// softmax; 2: the converters skip every copy and conversion; 3: both, the stream alone).
#define CREG 40   // NCV = 2: converter registers (2 x MREG + 2 x CREG = 512)
#define MREG 216  // NCV = 2: math registers
template <int D, int N8, int NH, bool BF16, int NCV = 1, int MODE = 0>
__global__ void __launch_bounds__(128 * (2 + NCV), 1) verify_attn_cv(
    VA_SPLIT_ARGS,
    const void* __restrict__ tmap,  // CUtensorMap over the cache: [blocks][page slots][8-byte words]
    int pf) {                       // L2 prefetch distance in half-stages (0: none; <= 8)
  using namespace va;
  constexpr int BN = VA_BN;         // keys per tile (one math group's QK / PV step)
  constexpr int HB = BN / 2;        // keys per ring half-stage (two 16-slot TMA boxes)
  constexpr int RP = 2 * D + 16;    // ring row pitch: one key's 16-byte-aligned record window
  constexpr int R = 8 * N8;         // query rows held (padded)
  constexpr int SB8 = (D / 16) * 128;  // int8 K-major operands (K, Q): bytes between 8-row groups
  constexpr int PSBO = 2 * BN * 8;  // P (fp16, K-major): bytes between 8-row groups
  constexpr int VSBO = 2 * BN * 8;  // V^T (fp16, K-major): bytes between 8-dim groups
  constexpr int VT = D * BN * 2;    // one V^T buffer
  constexpr int K8 = BN * D;        // one int8 K buffer
  constexpr int MTD = D / 64;       // m64 tiles of the PV product
  static_assert(D == 256, "head size 256");
  static_assert(N8 >= 2 && N8 <= 6, "9..48 query rows");

  extern __shared__ __align__(128) unsigned char wsmem[];
  const u32 ring_s = smem_addr(wsmem);
  const u32 vt_s = ring_s + NH * HB * RP;
  const u32 k8_s = vt_s + 2 * VT;
  const u32 q8_s = k8_s + 2 * K8;
  const u32 p_s = q8_s + 2 * R * D;
  const u32 full0 = p_s + 2 * R * 2 * BN, empty0 = full0 + 8 * NH, kfull0 = empty0 + 8 * NH;
  const u32 kempty0 = kfull0 + 16, vfull0 = kempty0 + 16, vempty0 = vfull0 + 16;
  float* const ks_s = reinterpret_cast<float*>(wsmem + (vempty0 + 16 - ring_s));  // [2][BN]
  float* const vs_s = ks_s + 2 * BN;                                               // [2][BN]
  float* const red_s = vs_s + 2 * BN;                                              // [2][4][R]
  float* const sq_s = red_s + 8 * R;                                               // [R]

  const int tid = threadIdx.x, wg = tid >> 7, tw = tid & 127;
  const int warp = tw >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;

  int bx = blockIdx.x;
  const int h = bx % num_kv_heads;
  bx /= num_kv_heads;
  const int qt = bx % num_q_tiles;
  const int split = bx / num_q_tiles;
  const int b = blockIdx.y;

  Unit un;
  if (!unit_at(un, cu_q, seq_lens, b, qt, block_q, G, window)) return;  // uniform over the CTA
  const int q_start = un.q_start, q_lo = un.q_lo, q_hi = un.q_hi, rows = un.rows;
  const int ctx = un.ctx, k_hi = un.k_hi;
  // Tiles start on 16-key groups (a TMA box is 16 slots of one page); keys below the window's
  // first are masked by the window test.
  const int k_lo = un.k_lo & ~15;
  const int span = max(k_hi - k_lo, 0);
  const int per = ((span + num_splits - 1) / num_splits + BN - 1) / BN * BN;
  const int n_start = k_lo + split * per;
  const int n_end = min(n_start + per, k_hi);
  const int ntiles = n_end > n_start ? (n_end - n_start + BN - 1) / BN : 0;
  const int nhalf = 2 * ntiles;
  const int Hq = num_kv_heads * G;
  const int shift = (int)((reinterpret_cast<u64>(kv) + (u64)h * (u64)stride_kv_head) & 15u);

  if (tid == 0) {
    for (int s = 0; s < NH; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, 4);
    for (int s = 0; s < 2; ++s) {
      mbar_init(kfull0 + 8 * s, 4), mbar_init(kempty0 + 8 * s, 4);
      mbar_init(vfull0 + 8 * s, 4), mbar_init(vempty0 + 8 * s, 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }

  // ---- Producer state (converter warp 0): block ids of 16-key groups in lane registers, 32
  // groups (16 half-stages) per batch: bt0 = batch cb, bt1 = batch cb + 1, loaded a batch ahead.
  const int c0 = (h * stride_kv_head - shift) >> 3;  // the window's first 8-byte word in a slot
  const int* const bt_row = block_table + (i64)b * stride_bt;
  auto group_blk = [&](int gi) -> int {  // block of 16-key group gi (0 past n_end: a dummy read)
    const int key = n_start + 16 * gi;
    return key < n_end ? bt_row[(u32)key / (u32)page] : 0;
  };
  int bt0 = 0, bt1 = 0, cb = 0;
  // Half-stage u's two boxes (lanes 0, 1 of the producer warp; all 32 lanes call it).
  auto box = [&](int u, int& blk, int& slot) {
    const int gi = 2 * u + (lane & 1);
    const int v = shfl_idx((u32)((gi >> 5) != cb ? bt1 : bt0), gi & 31);
    const int key = n_start + 16 * gi;
    blk = key < n_end ? v : 0;
    slot = key < n_end ? (int)((u32)key % (u32)page) : 0;
  };
  auto issue = [&](int u) {  // half-stage u into ring slot u % NH
    if (2 * u >= 32 * (cb + 1)) {  // entering batch cb + 1 (u grows by one per call)
      bt0 = bt1, ++cb;
      bt1 = group_blk(32 * (cb + 1) + lane);
    }
    int blk, slot;
    box(u, blk, slot);
    const u32 bar = full0 + 8 * (u % NH);
    if (lane == 0) mbar_expect_tx(bar, 2 * 16 * RP);
    __syncwarp();
    if (lane < 2) tma3d(ring_s + (u % NH) * (HB * RP) + lane * 16 * RP, tmap, c0, slot, blk, bar);
    if (pf > 0 && u + pf < nhalf) {
      box(u + pf, blk, slot);
      if (lane < 2) tma3d_prefetch(tmap, c0, slot, blk);
    }
  };

  // ---- Q's global loads first (the math groups, 256 threads), as verify_attn_split_wg.
  constexpr int NQ = R * (D / 4) / 256;  // 8-byte items per thread
  constexpr int RS = 256 / (D / 4);      // rows between a thread's items
  static_assert(R * (D / 4) % 256 == 0 && D / 4 == 64, "Q items split evenly, a row over two warps");
  u64 raw[NQ];
  if (wg < 2) {
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
  } else if (warp == 0) {
    bt0 = group_blk(lane);
    bt1 = group_blk(32 + lane);
  }
  __syncthreads();  // barriers initialised; Q loads in flight
  if (wg == 2 && warp == 0)
    for (int u = 0; u < min(NH, nhalf); ++u) issue(u);

  // ---- Q -> two int8 parts per row r (pre-scaled by softmax_scale log2 e): q ~ sq (hi + lo / 254)
  // with sq = max |q| / 127, exact to max |q| / 64516 (fp16's step is 2^-11 of the value). The QK
  // product is then one s8 wgmma of N = 2 R: columns r (hi) and R + r (lo) of the same thread.
  const float qs = (float)qk_scale_d;
  if (wg < 2) {
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
      const int r = (tid + i * 256) / (D / 4);
      float mx = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) mx = fmaxf(mx, fabsf(to_f32<BF16>((unsigned short)(raw[i] >> (16 * e))) * qs));
#pragma unroll
      for (int m = 1; m < 32; m *= 2) mx = fmaxf(mx, shfl_xor(mx, m));
      if (lane == 0) red_s[((tid >> 5) & 1) * R + r] = mx;
    }
  }
  __syncthreads();  // row maxima
  if (wg < 2) {
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
      const int it = tid + i * 256;
      const int r = it / (D / 4), rem = it % (D / 4);
      const float mx = fmaxf(red_s[r], red_s[R + r]);
      const float sc = mx / 127.f, inv = mx > 0.f ? 127.f / mx : 0.f;
      u32 hw = 0, lw = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float v = to_f32<BF16>((unsigned short)(raw[i] >> (16 * e))) * qs;
        const float hi = rintf(v * inv);
        const float lo = fminf(fmaxf(rintf((v - hi * sc) * inv * 254.f), -127.f), 127.f);
        hw |= ((u32)(int)hi & 0xFFu) << (8 * e);
        lw |= ((u32)(int)lo & 0xFFu) << (8 * e);
      }
      // element (n, k) of a K-major no-swizzle int8 operand: (n / 8) SB8 + (k / 16) 128 + (n % 8) 16 + k % 16
      const u32 at = (rem >> 2) * 128 + 4 * (rem & 3);
      sts32(q8_s + (r >> 3) * SB8 + (r & 7) * 16 + at, hw);
      sts32(q8_s + ((R + r) >> 3) * SB8 + ((R + r) & 7) * 16 + at, lw);
      if (rem == 0) sq_s[r] = sc;
    }
    fence_proxy_async();
  }
  __syncthreads();  // Q's two parts and their scales; red_s free

  if (wg >= 2) {
    // ========================== converter cw: tiles cw, cw + NCV, ... ==========================
    if (NCV == 1) maxnreg_dec<56>(); else maxnreg_dec<CREG>();
    const int cw = wg - 2;
    const int col = lane + 32 * (warp & 1);  // this thread's V word column (dims 4 col .. + 3)
    const int qb = 2 * (warp >> 1);          // its logical 8-key groups in a half: 4 hf + qb + 0, 1
    int nx = min(NH, nhalf);                 // producer (cw 0, warp 0): next half-stage to issue
    for (int t = cw; t < ntiles; t += NCV) {
      const int bb = t & 1;
      const u32 kbuf = k8_s + bb * K8, vtb = vt_s + bb * VT;
      if (t >= 2) mbar_wait(kempty0 + 8 * bb, ((t >> 1) + 1) & 1);  // math group done with t - 2's K
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int u = 2 * t + hf;
        mbar_wait(full0 + 8 * (u % NH), (u / NH) & 1);
        if (MODE >= 2) continue;
        const u32 row = ring_s + (u % NH) * (HB * RP) + lane * RP + shift;  // key 32 hf + lane's record
        const int key = HB * hf + lane;
        // K int8 -> the K-major core-matrix layout of the QK product's A operand (keys on M).
#pragma unroll
        for (int k = 0; k < D / 64; ++k) {
          const int ch = warp + 4 * k;  // dims 16 ch .. 16 ch + 15
          const uint2 x = lds64(row + 16 * ch), y = lds64(row + 16 * ch + 8);
          sts128(kbuf + (key >> 3) * SB8 + ch * 128 + (key & 7) * 16, x.x, x.y, y.x, y.y);
        }
        if (warp == 0) ks_s[bb * BN + key] = lds_f32(row + D);
        if (warp == 1) vs_s[bb * BN + key] = lds_f32(row + 2 * D + 4);
      }
      fence_proxy_async();  // K (generic stores) -> the QK wgmma's reads
      __syncwarp();
      if (lane == 0) mbar_arrive(kfull0 + 8 * bb);
      if (t >= 2) mbar_wait(vempty0 + 8 * bb, ((t >> 1) + 1) & 1);  // PV of t - 2 done
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int u = 2 * t + hf;
        const u32 st = ring_s + (u % NH) * (HB * RP) + shift + D + 4 + 4 * col;
#pragma unroll
        for (int qq = 0; qq < 2; ++qq) {
          if (MODE >= 2) break;
          const int qg = 4 * hf + qb + qq;  // logical keys 8 qg .. 8 qg + 7
          u32 w[8];
#pragma unroll
          for (int r = 0; r < 8; ++r) {  // logical key 8 qg + r = key 16 (qg / 2) + 4 (qg % 2) + r / 2 + 8 (r % 2)
            const int key = 16 * (qg >> 1) + 4 * (qg & 1) + (r >> 1) + 8 * (r & 1) - HB * hf;
            w[r] = lds32(st + key * RP);
          }
          // 4x4 byte transposes: o[jb][half] = byte jb of keys 4 half .. 4 half + 3.
          u32 o[4][2];
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const u32 t0 = prmt(w[4 * hh], w[4 * hh + 1], 0x5140u), t1 = prmt(w[4 * hh], w[4 * hh + 1], 0x7362u);
            const u32 t2 = prmt(w[4 * hh + 2], w[4 * hh + 3], 0x5140u), t3 = prmt(w[4 * hh + 2], w[4 * hh + 3], 0x7362u);
            o[0][hh] = prmt(t0, t2, 0x5410u), o[1][hh] = prmt(t0, t2, 0x7632u);
            o[2][hh] = prmt(t1, t3, 0x5410u), o[3][hh] = prmt(t1, t3, 0x7632u);
          }
#pragma unroll
          for (int jb = 0; jb < 4; ++jb) {
            u32 a0, a1, a2, a3;
            i8x4_to_f16(o[jb][0], a0, a1);
            i8x4_to_f16(o[jb][1], a2, a3);
            sts128(vtb + (4 * (col >> 3) + jb) * VSBO + qg * 128 + (col & 7) * 16, a0, a1, a2, a3);
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * (u % NH));
        // The producer refills, in order, every ring slot whose half-stage is at most u (with two
        // converters, the other one's slots too: it waits for their release).
        if (cw == 0 && warp == 0)
          for (; nx < nhalf && nx - NH <= u; ++nx) {
            mbar_wait(empty0 + 8 * (nx % NH), ((nx / NH) + 1) & 1);  // half-stage nx - NH released
            issue(nx);
          }
      }
      fence_proxy_async();  // V^T (generic stores) -> the PV wgmma's reads
      __syncwarp();
      if (lane == 0) mbar_arrive(vfull0 + 8 * bb);
    }
    // The producer's last refills (slots released after its own last tile: the other converter's).
    if (cw == 0 && warp == 0)
      for (; nx < nhalf; ++nx) {
        mbar_wait(empty0 + 8 * (nx % NH), ((nx / NH) + 1) & 1);
        issue(nx);
      }
    return;
  }

  // ================================ math group wg: tiles wg, wg + 2, ... ================================
  if (NCV == 1) maxnreg_inc<224>(); else maxnreg_inc<MREG>();
  const int bid = 1 + wg;
  float* const red = red_s + wg * 4 * R;
  const u32 kbuf = k8_s + wg * K8, vtb = vt_s + wg * VT, pbuf = p_s + wg * (R * 2 * BN);
  const float* const ksb = ks_s + wg * BN;
  const float* const vsb = vs_s + wg * BN;
  float sq[N8][2], m_r[N8][2], l_r[N8][2];
#pragma unroll
  for (int j = 0; j < N8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) m_r[j][e] = M_EMPTY, l_r[j][e] = 0.f, sq[j][e] = sq_s[8 * j + 2 * c + e];
  float acc[MTD][N8][4];
#pragma unroll
  for (int t = 0; t < MTD; ++t)
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][j][i] = 0.f;
  int si[2 * N8][4];
#pragma unroll
  for (int j = 0; j < 2 * N8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) si[j][i] = 0;
  const u32 kd_lo = wg_desc_lo(kbuf, 128), qd_lo = wg_desc_lo(q8_s, 128);
  const u32 pd_lo = wg_desc_lo(pbuf, 128), vd_lo = wg_desc_lo(vtb, 128);

  for (int t = wg; t < ntiles; t += 2) {
    const int kb = n_start + t * BN;
    const u32 par = (t >> 1) & 1;
    mbar_wait(kfull0 + 8 * wg, par);
    if (MODE == 1 || MODE == 3) {  // probe: hand the buffers straight back
      __syncwarp();
      if (lane == 0) mbar_arrive(kempty0 + 8 * wg);
      mbar_wait(vfull0 + 8 * wg, par);
      __syncwarp();
      if (lane == 0) mbar_arrive(vempty0 + 8 * wg);
      continue;
    }

    // ---- S^T = K Q^T in int8: keys on M (warp w: keys 16 w + g, + 8), Q's two parts on N.
    // The descriptor words are made opaque per tile: hoisted out of the loop, the 48 64-bit
    // descriptors of both products were kept in registers and spilled (ptxas 13.0).
    u32 kd = kd_lo, qd = qd_lo, pd = pd_lo, vd = vd_lo;
    asm volatile("" : "+r"(kd), "+r"(qd), "+r"(pd), "+r"(vd));
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk)
      wgmma_s8<N8>(si, wg_desc_at(kd, SB8, kk * 256), wg_desc_at(qd, SB8, kk * 256), kk);
    wg_commit();
    float ksc[2], vsc[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int key = warp * 16 + g + 8 * hh;
      ksc[hh] = ksb[key];
      vsc[hh] = vsb[key];
    }
    wg_wait<0>();
    __syncwarp();
    if (lane == 0) mbar_arrive(kempty0 + 8 * wg);  // this warp's part of the K buffer is read

    // s[j][2 hh + e]: key 16 w + g + 8 hh, query row 8 j + 2 c + e, in log2 units.
    float s[N8][4];
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        s[j][i] = fmaf((float)si[N8 + j][i], 1.f / 254.f, (float)si[j][i]) * (sq[j][i & 1] * ksc[i >> 1]);
    const bool need_mask = kb + BN > n_end || kb + BN - 1 > ctx + q_lo ||
                           (window > 0 && kb < ctx + q_hi - window);
    if (need_mask) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int kpos = kb + warp * 16 + g + 8 * hh;
        if (kpos >= n_end) vsc[hh] = 0.f;  // a dummy or another unit's key: its scale may be anything
#pragma unroll
        for (int j = 0; j < N8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int qp = ctx + q_lo + (8 * j + 2 * c + e) / G;  // (mask tiles only: no registers kept)
            const bool vis = kpos < n_end && kpos <= qp && (window <= 0 || qp - kpos < window);
            if (!vis) s[j][2 * hh + e] = NEG_INF;
          }
      }
    }
    // Lazy max (verify_attn_split_wg): the running max moves only when a score exceeds it by
    // more than 2^8; a group-wide vote skips the row-max exchange on the tiles where no row moves.
    bool up = false;
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) up |= fmaxf(s[j][e], s[j][2 + e]) > m_r[j][e] + 8.f;
    // The vote is also the barrier after which every warp of the group is past its last PV
    // (P may be overwritten) and past its reads of red (last slow tile).
    if (bar_or_n(bid, 128, up)) {
#pragma unroll
      for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float mx = fmaxf(s[j][e], s[j][2 + e]);
          mx = fmaxf(mx, shfl_xor(mx, 4));
          mx = fmaxf(mx, shfl_xor(mx, 8));
          mx = fmaxf(mx, shfl_xor(mx, 16));
          if (g == 0) red[warp * R + 8 * j + 2 * c + e] = mx;
        }
      bar_sync_n(bid, 128);
      float al[N8][2];
      bool rescale = false;
#pragma unroll
      for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int row = 8 * j + 2 * c + e;
          const float tmax = fmaxf(fmaxf(red[row], red[R + row]), fmaxf(red[2 * R + row], red[3 * R + row]));
          const float mo = m_r[j][e];
          const float mn = tmax > mo + 8.f ? tmax : mo;
          const float alpha = mn == mo ? 1.f : ex2(mo - mn);
          m_r[j][e] = mn;
          const float p0 = ex2(s[j][e] - mn);
          const float p1 = ex2(s[j][2 + e] - mn);
          l_r[j][e] = l_r[j][e] * alpha + (p0 + p1);
          al[j][e] = alpha;
          rescale |= alpha != 1.f;
          sts32(pbuf + j * PSBO + (2 * warp + (g >> 2)) * 128 + (2 * c + e) * 16 + 4 * (g & 3),
                pack_f16(p0 * vsc[0], p1 * vsc[1]));
        }
      if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
        for (int tt = 0; tt < MTD; ++tt)
#pragma unroll
          for (int j = 0; j < N8; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[tt][j][i] *= al[j][i & 1];
      }
    } else {
#pragma unroll
      for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p0 = ex2(s[j][e] - m_r[j][e]);
          const float p1 = ex2(s[j][2 + e] - m_r[j][e]);
          l_r[j][e] += p0 + p1;
          sts32(pbuf + j * PSBO + (2 * warp + (g >> 2)) * 128 + (2 * c + e) * 16 + 4 * (g & 3),
                pack_f16(p0 * vsc[0], p1 * vsc[1]));
        }
    }
    fence_proxy_async();
    bar_sync_n(bid, 128);  // P of all the group's warps
    mbar_wait(vfull0 + 8 * wg, par);

    // ---- O^T += V^T P^T: m64 tile tt = V^T rows 64 tt.., per 16-key chunk kk one wgmma each.
    wg_fence();  // acc written by this thread (a rescale)
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int tt = 0; tt < MTD; ++tt)
        wgmma_ss<N8>(acc[tt], wg_desc_at(vd, VSBO, tt * 8 * VSBO + kk * 256), wg_desc_at(pd, PSBO, kk * 256));
    wg_commit();
    wg_wait<0>();
    __syncwarp();
    if (lane == 0) mbar_arrive(vempty0 + 8 * wg);
  }

  // ---- epilogue: row sums over the 8 lanes of one c and the group's warps; this group's partial
  // is split 2 * split + wg of 2 * num_splits.
  bar_sync_n(bid, 128);  // every warp is past its reads of red
#pragma unroll
  for (int j = 0; j < N8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_r[j][e];
      l += shfl_xor(l, 4);
      l += shfl_xor(l, 8);
      l += shfl_xor(l, 16);
      if (g == 0) red[warp * R + 8 * j + 2 * c + e] = l;
    }
  bar_sync_n(bid, 128);
  const int ns2 = 2 * num_splits;
#pragma unroll
  for (int j = 0; j < N8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 8 * j + 2 * c + e;
      if (row >= rows) continue;
      const float l = (red[row] + red[R + row]) + (red[2 * R + row] + red[3 * R + row]);
      const int tk = row / G, grp = row - (row / G) * G;
      const i64 tok = q_start + q_lo + tk;
      const int hq = h * G + grp;
      const i64 pr = (tok * Hq + hq) * ns2 + 2 * split + wg;
      float* pa = part_acc + pr * D + 32 * (warp >> 1) + 4 * g + 2 * (warp & 1);
#pragma unroll
      for (int tt = 0; tt < MTD; ++tt)
        *reinterpret_cast<float2*>(pa + 64 * tt) = make_float2(acc[tt][j][e], acc[tt][j][2 + e]);
      if (warp == 0 && g == 0) {
        part_ml[pr * 2] = m_r[j][e] == M_EMPTY ? NEG_INF : m_r[j][e];
        part_ml[pr * 2 + 1] = l;
      }
    }
}
