// verify_attn_ws: the warp-specialised split kernel for 9..48 query rows per KV head (T > 1).
//
// Appended after verify_attention.cu by the launcher (same namespace va, same helpers, same
// arguments and partials as verify_attn_split_wg). Why another kernel: the wgmma split kernel
// runs two 128-thread CTAs per SM and each warp does every phase of a tile in order (copies,
// K -> fp16 + QK, softmax, V -> fp16 + PV) with three CTA barriers between them; at 48 rows the
// loop is issue-latency bound (2 warps per scheduler, ~0.3 instructions per cycle; NOTES.md
// session 10), 2.8 µs per tile where the copy speed allows ~2.1.
//
// Here one CTA per SM holds one (KV head, query tile, split) unit with three warpgroups:
// * QK0 / QK1 take the unit's 64-key tiles alternately (tile t -> QK t % 2): K int8 -> fp16,
//   S^T = K Q^T on wgmma (as verify_attn_split_wg), scales, mask, the online softmax, and
//   P (times the V scale) into P buffer t % 4 with the reference max of each row beside it.
// * PV takes every tile in order: O^T += V^T P^T (V int8 -> fp16 in registers, as
//   verify_attn_split_wg), then frees the ring stage and (warp 0) issues the copies of tile
//   t + STAGES into it: one TMA bulk copy per key of the record's 16-byte-aligned window
//   (2 D + 16 bytes, as the cp.async ring rows), completing on the stage's mbarrier.
// So three warps share each scheduler and the two softmax chains run side by side.
//
// Two softmax warpgroups keep separate running maxima, so a tile's P may be relative to a lower
// max than the accumulator's: each P buffer carries its rows' reference (pm_s), and PV either
// rescales the accumulator (reference higher) or the P rows in shared memory (lower; rare).
// The maxima are shared through Mpub (shared-memory atomic max of a monotone int image of the
// float) and a version word, so the two groups mostly agree; a stale read costs time, never
// correctness: every P value is <= 2^8 relative to its own reference (lazy max, as the wgmma
// kernel), and PV brings every tile to its own reference before adding it. Each QK group keeps
// its row sums relative to its own final maximum; the epilogue brings both to PV's.
//
// Shared memory: ring [STAGES][BN][RP] | Q [R/8][D/8] core matrices | P [4][R/8][BN/8] core
// matrices | mbarriers full[STAGES], pfull[4], pempty[4] | floats: red [2][5][R] (4 warps' row
// maxima or sums + the published-max snapshot), pm [4][R], Mpub [R] (int image), fin_m [2][R],
// fin_l [2][R], m_s [R] (the Q row-sum bias), pmx [R], ver. Launcher: smem_bytes_ws mirrors it.

namespace va {
DI void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
DI bool bar_or(int id, int n, bool p) {
  u32 r;
  asm volatile(
      "{ .reg .pred a, b;\n setp.ne.u32 a, %1, 0;\n"
      "barrier.cta.red.or.pred b, %2, %3, a;\n selp.u32 %0, 1, 0, b; }\n"
      : "=r"(r) : "r"((u32)p), "r"(id), "r"(n) : "memory");
  return r != 0;
}
// Monotone int image of a float (signed compare order = float order) and back.
DI int f2ord(float f) {
  const int i = __float_as_int(f);
  return i >= 0 ? i : i ^ 0x7FFFFFFF;
}
DI float ord2f(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7FFFFFFF); }
// Register budgets per warpgroup (sm_90 setmaxnreg): 128 each at launch (512 threads, one CTA),
// then QK 152 and PV 104 (256 x 152 + 256 x 104 = 65,536): a PV group holds half the accumulator
// (48 registers at 48 rows) and its V fragments.
// 3D tensor copy (TMA) of one box global -> shared, completing its bytes on the mbarrier; tmap is
// the generic address of a CUtensorMap in global memory (the launcher's, 64-byte aligned).
DI void tma_3d(u32 dst, const void* tmap, int c0, int c1, int c2, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
template <int N>
DI void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
DI void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
}  // namespace va

// NQK: QK groups that take tiles (2; 1 = group 0 takes every tile: a diagnosis variant).
// CPA: the ring is filled by the PV threads' 16-byte cp.async (completion on the stage's mbarrier
// through cp.async.mbarrier.arrive); false: by PV warp 0's TMA boxes through the tensor map.
template <int D, int N8, int STAGES, bool BF16, int NQK = 2, bool CPA = true>
__global__ void __launch_bounds__(512, 1) verify_attn_ws(
    VA_SPLIT_ARGS,
    const void* __restrict__ tmap,  // CUtensorMap over the cache: [blocks][page slots][8-byte words]
    u64* __restrict__ trace_buf,    // [CTAs][8] diagnosis stamps when trace_on (see below)
    int trace_on) {
  using namespace va;
  constexpr int BN = VA_BN;
  constexpr int RP = 2 * D + 16;   // ring row pitch: one key's 16-byte-aligned record window
  constexpr int R = 8 * N8;        // query rows held (padded): the N of both products
  constexpr int QSBO = 2 * D * 8;  // Q: bytes between 8-row groups (K-major, no swizzle)
  constexpr int PSBO = 2 * BN * 8; // P: likewise
  constexpr int PB = R * 2 * BN;   // one P buffer
  constexpr int DW = D / 8;        // output dims per PV warp (two PV groups of 4 warps)
  constexpr int MTD = DW / 16;     // m64 tiles of the PV product
  constexpr int WV = DW / 32;      // 32-bit V words per key row per thread
  static_assert(D == 256, "head size 256 (two PV groups of D / 2 dims, one 32-bit V word per key)");
  static_assert(N8 >= 2 && N8 <= 6, "9..48 query rows");

  extern __shared__ __align__(128) unsigned char wsmem[];
  const u32 kv_s = smem_addr(wsmem);
  const u32 q_s = kv_s + STAGES * BN * RP;
  const u32 p_s = q_s + R * 2 * D;
  const u32 full0 = p_s + 4 * PB, pfull0 = full0 + 8 * STAGES, pempty0 = pfull0 + 32;
  float* const red_s = reinterpret_cast<float*>(wsmem + STAGES * BN * RP + R * 2 * D + 4 * PB + 8 * STAGES + 64);
  float* const pm_s = red_s + 10 * R;          // [4][R]
  int* const mpub_s = reinterpret_cast<int*>(pm_s + 4 * R);  // [R]
  float* const fin_m = reinterpret_cast<float*>(mpub_s + R);  // [2][R]
  float* const fin_l = fin_m + 2 * R;          // [2][R]
  float* const m_s = fin_l + 2 * R;            // [R]
  float* const pmx_s = m_s + R;                // [R] PV's maxima for a P rescale
  volatile int* const ver_s = reinterpret_cast<volatile int*>(pmx_s + R);

  const int tid = threadIdx.x, wg = tid >> 7, tw = tid & 127;
  // Diagnosis (trace_on): [0] CTA start, [1] PV loop end, [2] PV epilogue end (%globaltimer ns),
  // [3] tiles, [4] PV warp 0's cycles waiting for P, [5] / [6] QK group 0 warp 0's cycles waiting
  // for a stage / a free P buffer, [7] PV warp 0's cycles in the end-of-tile barrier + issue.
  u64* const tr = trace_on ? trace_buf + (blockIdx.y * gridDim.x + blockIdx.x) * 8 : nullptr;
  if (tr && tid == 0) tr[0] = globaltimer();
  u64 w_a = 0, w_b = 0, w_c = 0;
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
  const int ctx = un.ctx, k_hi = un.k_hi, k_lo = un.k_lo;
  const int span = max(k_hi - k_lo, 0);
  const int per = ((span + num_splits - 1) / num_splits + BN - 1) / BN * BN;
  const int n_start = k_lo + split * per;
  const int n_end = min(n_start + per, k_hi);
  const int Hq = num_kv_heads * G;
  const int shift = (int)((reinterpret_cast<u64>(kv) + (u64)h * (u64)stride_kv_head) & 15u);

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(full0 + 8 * s, CPA ? 256 : 1);
    for (int s = 0; s < 4; ++s) mbar_init(pfull0 + 8 * s, 128), mbar_init(pempty0 + 8 * s, 256);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    *ver_s = 0;
  }
  if (tid < R) mpub_s[tid] = f2ord(M_EMPTY);

  // ---- PV warp 0 issues the tiles' copies: one TMA box per 16-key group (lanes 0-3), the
  // group's 16 slots (page-aligned: page % 16 == 0) x this head's 528-byte record window, landing
  // as 16 ring rows. Slots of a group past n_end are read too (same page) and masked. The
  // block-table entries of the next tile to issue are looked up one issue ahead.
  // The window's first 8-byte word in a slot (kv is 16-byte aligned: launcher's supported()).
  const int c0 = (h * stride_kv_head - shift) >> 3;
  int nblk = -1, nslot = 0;
  auto lookup = [&](int kb0) {
    const int key = kb0 + 16 * lane;
    nblk = -1, nslot = 0;
    if (lane < BN / 16 && key < n_end) {
      const int lp = (int)((u32)key / (u32)page);
      nslot = key - lp * page;
      nblk = block_table[(i64)b * stride_bt + lp];
    }
  };
  auto issue = [&](int t) {  // tile t (first key < n_end) into stage t % STAGES, PV warp 0 only
    const int kb0 = n_start + t * BN;
    const u32 bar = full0 + 8 * (t % STAGES);
    if (lane == 0) mbar_expect_tx(bar, (u32)(((min(BN, n_end - kb0) + 15) >> 4) * 16 * RP));
    __syncwarp();
    if (nblk >= 0) tma_3d(kv_s + (t % STAGES) * (BN * RP) + lane * 16 * RP, tmap, c0, nslot, nblk, bar);
  };
  // CPA: PV thread pt (of 256) copies 16-byte chunks pt % 4, + 4, ... of key pt / 4's window
  // (keys past n_end zero-filled, no read), then arrives on the stage's mbarrier when they land.
  const int pt = tid - 256, ck = pt >> 2, cs = pt & 3;
  const u64 kvh = reinterpret_cast<u64>(kv) + (u64)(i64)(h * stride_kv_head - shift);
  int cblk = -1, cslot = 0;
  auto lookup_c = [&](int kb0) {
    const int key = kb0 + ck;
    cblk = -1, cslot = 0;
    if (key < n_end) {
      const int lp = (int)((u32)key / (u32)page);
      cslot = key - lp * page;
      cblk = block_table[(i64)b * stride_bt + lp];
    }
  };
  auto issue_c = [&](int t) {
    const u32 dst = kv_s + (t % STAGES) * (BN * RP) + ck * RP;
    const u64 src = kvh + (u64)max(cblk, 0) * (u64)stride_kv_blk + (u64)cslot * (u64)stride_kv_slot;
    const int nb = cblk >= 0 ? 16 : 0;
#pragma unroll
    for (int ch = cs; ch < RP / 16; ch += 4) cp_async16(dst + 16 * ch, src + 16 * ch, nb);
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full0 + 8 * (t % STAGES)) : "memory");
  };
  const int ntiles = n_end > n_start ? (n_end - n_start + BN - 1) / BN : 0;

  // ---- Q's global loads first (the QK groups, 256 threads), as verify_attn_split_wg.
  constexpr int NQ = R * (D / 4) / 256;  // 8-byte items per thread
  constexpr int RS = 256 / (D / 4);      // rows between a thread's items
  static_assert(R * (D / 4) % 256 == 0, "Q items split evenly");
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
  }
  __syncthreads();  // barriers initialised; Q loads in flight
  if (CPA && wg >= 2) {
    const int first = min(STAGES, ntiles);
    for (int t = 0; t < first; ++t) {
      lookup_c(n_start + t * BN);
      issue_c(t);
    }
    if (STAGES < ntiles) lookup_c(n_start + STAGES * BN);
  }
  if (!CPA && wg == 2 && warp == 0) {
    const int first = min(STAGES, ntiles);
    for (int t = 0; t < first; ++t) {
      lookup(n_start + t * BN);
      issue(t);
    }
    if (STAGES < ntiles) lookup(n_start + STAGES * BN);
  }

  if (wg < 2) {
    // Q -> shared memory, fp16, pre-scaled, in verify_attn_split_wg's permuted K-major layout;
    // row sums (of the fp16 values as stored) for the K bias, in red_s (2 warps per row).
    const float qs = (float)qk_scale_d;
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
      const int it = tid + i * 256;
      const int r = it / (D / 4), rem = it % (D / 4);
      const int s = rem >> 2, cc = rem & 3;
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = to_f32<BF16>((unsigned short)(raw[i] >> (16 * e))) * qs;
      const u32 base = q_s + (r >> 3) * QSBO + 2 * s * 128 + (r & 7) * 16 + 4 * cc;
      const u32 lo = pack_f16(v[0], v[1]), hi = pack_f16(v[2], v[3]);
      sts32(base, lo);
      sts32(base + 128, hi);
      float qsum = (f16_lo(lo) + f16_hi(lo)) + (f16_lo(hi) + f16_hi(hi));
#pragma unroll
      for (int m = 1; m < 32; m *= 2) qsum += shfl_xor(qsum, m);
      if (D / 4 == 64) {
        if (lane == 0) red_s[((tid >> 5) & 1) * R + r] = qsum;
      } else if (lane == 0) {
        red_s[r] = qsum, red_s[R + r] = 0.f;
      }
    }
    fence_proxy_async();
  }
  __syncthreads();  // Q and its row sums
  if (tid < R) m_s[tid] = -1152.f * (red_s[tid] + red_s[R + tid]);
  __syncthreads();  // m_s; red_s free

  if (wg < 2) {
    // =========================== QK group wg: tiles wg, wg + 2, ... ===========================
    setmaxnreg_inc<152>();
    const int bid = 1 + wg;
    float* const red = red_s + wg * 5 * R;
    int qpos[N8][2];
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) qpos[j][e] = ctx + q_lo + (8 * j + 2 * c + e) / G;
    float m_r[N8][2], l_r[N8][2];
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) m_r[j][e] = M_EMPTY, l_r[j][e] = 0.f;
    int my_ver = 0;  // warp 0 lane 0: the version of Mpub last adopted
    const u32 qd_lo = wg_desc_lo(q_s, 128);

    for (int t = wg < NQK ? wg : ntiles; t < ntiles; t += NQK) {
      const int kb = n_start + t * BN;
      const int si = t % STAGES, buf = t & 3;
      u64 c0w = tr ? clock64_() : 0;
      mbar_wait(full0 + 8 * si, (t / STAGES) & 1);
      if (tr) w_b += clock64_() - c0w;
      const u32 st = kv_s + si * (BN * RP);

      // S^T = K Q^T (verify_attn_split_wg's product: K as int8 + 1152, bias in the accumulator).
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
        wg_fence();
#pragma unroll
        for (int i = 0; i < 4; ++i) wgmma_rs<N8>(s, a[i], wg_desc_at(qd_lo, QSBO, (kb4 + i) * 256));
      }
      wg_commit();
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
          if (kpos >= n_end) vsc[hh] = 0.f;  // not copied: the ring row's scale is stale
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
      bool up = false;
#pragma unroll
      for (int j = 0; j < N8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) up |= fmaxf(s[j][e], s[j][2 + e]) > m_r[j][e] + 8.f;
      if (warp == 0 && lane == 0) up |= *ver_s != my_ver;  // the other group raised a maximum
      c0w = tr ? clock64_() : 0;
      if (t >= 4) mbar_wait(pempty0 + 8 * buf, ((t >> 2) - 1) & 1);  // PV is done with tile t - 4
      if (tr) w_c += clock64_() - c0w;
      const u32 pb = p_s + buf * PB;
      if (bar_or(bid, 128, up)) {
        // Row max over the group's 64 keys; warp 0 adds the published maxima (one snapshot).
#pragma unroll
        for (int j = 0; j < N8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float mx = fmaxf(s[j][e], s[j][2 + e]);
            mx = fmaxf(mx, shfl_xor(mx, 4));
            mx = fmaxf(mx, shfl_xor(mx, 8));
            mx = fmaxf(mx, shfl_xor(mx, 16));
            const int row = 8 * j + 2 * c + e;
            if (g == 0) red[warp * R + row] = mx;
          }
        // The snapshot of Mpub after the version it is taken at (a raise publishes its maxima,
        // then bumps the version; a group adopts at its next slow tile whenever the version moved
        // since its last snapshot, its own raises included, so the groups converge).
        if (warp == 0) {
          if (lane == 0) my_ver = *ver_s;
          __syncwarp();
          if (g == 0)
#pragma unroll
            for (int j = 0; j < N8; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) red[4 * R + 8 * j + 2 * c + e] = ord2f(mpub_s[8 * j + 2 * c + e]);
        }
        bar_sync(bid, 128);
        bool raised = false;
#pragma unroll
        for (int j = 0; j < N8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int row = 8 * j + 2 * c + e;
            const float tmax = fmaxf(fmaxf(red[row], red[R + row]), fmaxf(red[2 * R + row], red[3 * R + row]));
            const float mp = red[4 * R + row];
            const float mo = m_r[j][e];
            const float base = fmaxf(mo, mp);
            const float mn = tmax > base + 8.f ? tmax : base;
            const float alpha = mn == mo ? 1.f : ex2(mo - mn);
            m_r[j][e] = mn;
            const float p0 = ex2(s[j][e] - mn);
            const float p1 = ex2(s[j][2 + e] - mn);
            l_r[j][e] = l_r[j][e] * alpha + (p0 + p1);
            sts32(pb + j * PSBO + (2 * warp + (g >> 2)) * 128 + (2 * c + e) * 16 + 4 * (g & 3),
                  pack_f16(p0 * vsc[0], p1 * vsc[1]));
            if (warp == 0 && g == 0) {
              pm_s[buf * R + row] = mn;
              if (mn > mp) atomicMax(mpub_s + row, f2ord(mn)), raised = true;
            }
          }
        if (warp == 0 && __any_sync(0xffffffffu, raised)) {
          __syncwarp();  // the lanes' atomicMax before the bump
          if (lane == 0) atomicAdd((int*)ver_s, 1);
        }
      } else {
#pragma unroll
        for (int j = 0; j < N8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p0 = ex2(s[j][e] - m_r[j][e]);
            const float p1 = ex2(s[j][2 + e] - m_r[j][e]);
            l_r[j][e] += p0 + p1;
            sts32(pb + j * PSBO + (2 * warp + (g >> 2)) * 128 + (2 * c + e) * 16 + 4 * (g & 3),
                  pack_f16(p0 * vsc[0], p1 * vsc[1]));
            if (warp == 0 && g == 0) pm_s[buf * R + 8 * j + 2 * c + e] = m_r[j][e];
          }
      }
      fence_proxy_async();
      mbar_arrive(pfull0 + 8 * buf);
    }

    // Row sums over the group's warps, with the group's final maxima, for PV's epilogue. The
    // barrier first: a warp may still read red (its last tile's maxima) while another is here.
    bar_sync(bid, 128);
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float l = l_r[j][e];
        l += shfl_xor(l, 4);
        l += shfl_xor(l, 8);
        l += shfl_xor(l, 16);
        const int row = 8 * j + 2 * c + e;
        if (g == 0) red[warp * R + row] = l;
        if (warp == 0 && g == 0) fin_m[wg * R + row] = m_r[j][e];
      }
    bar_sync(bid, 128);
    if (tw < R) fin_l[wg * R + tw] = (red[tw] + red[R + tw]) + (red[2 * R + tw] + red[3 * R + tw]);
    if (tr && tid == 0) tr[5] = w_b, tr[6] = w_c;
    __syncthreads();  // fin_m / fin_l -> PV
    return;
  }

  // ================================= PV group: every tile ==================================
  setmaxnreg_dec<104>();
  const int pv = wg - 2;  // PV group: output dims [pv D / 2, (pv + 1) D / 2)
  float macc[N8][2];  // the accumulator's reference max per row (same in every PV warp)
#pragma unroll
  for (int j = 0; j < N8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) macc[j][e] = M_EMPTY;
  float acc[MTD][N8][4];
#pragma unroll
  for (int t = 0; t < MTD; ++t)
#pragma unroll
    for (int j = 0; j < N8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][j][i] = 0.f;
  const u32 pd_lo = wg_desc_lo(p_s, 128);

  for (int t = 0; t < ntiles; ++t) {
    const int si = t % STAGES, buf = t & 3;
    u64 c0w = tr ? clock64_() : 0;
    mbar_wait(pfull0 + 8 * buf, (t >> 2) & 1);
    if (tr) w_a += clock64_() - c0w;
    mbar_wait(full0 + 8 * si, (t / STAGES) & 1);  // complete already (QK waited): visibility
    const u32 st = kv_s + si * (BN * RP);
    // Bring the tile's P and the accumulator to one reference per row.
    bool down = false;
#pragma unroll
    for (int j = 0; j < N8; ++j) {
      const float2 rf = *reinterpret_cast<const float2*>(pm_s + buf * R + 8 * j + 2 * c);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float r = e ? rf.y : rf.x;
        if (r > macc[j][e]) {
          const float al = ex2(macc[j][e] - r);
#pragma unroll
          for (int u = 0; u < MTD; ++u) acc[u][j][e] *= al, acc[u][j][2 + e] *= al;
          macc[j][e] = r;
        } else if (r < macc[j][e]) {
          down = true;
        }
      }
    }
    if (bar_or(3, 256, down)) {  // rare: some rows of P are relative to a lower maximum
      if (pv == 0 && warp == 0 && g == 0)
#pragma unroll
        for (int j = 0; j < N8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) pmx_s[8 * j + 2 * c + e] = macc[j][e];
      bar_sync(3, 256);
      const u32 pb = p_s + buf * PB;
      for (int w = tid - 256; w < R * BN / 2; w += 256) {  // 32-bit words of the P buffer
        const int off = 4 * w;
        const int row = (off / PSBO) * 8 + (off % 128) / 16;
        const float f = ex2(fminf(pm_s[buf * R + row] - pmx_s[row], 0.f));
        if (f != 1.f) {
          const u32 v = lds32(pb + off);
          sts32(pb + off, pack_f16(f16_lo(v) * f, f16_hi(v) * f));
        }
      }
      fence_proxy_async();
      bar_sync(3, 256);
    }

    const u32 v0 = st + shift + D + 4 + (4 * pv + warp) * DW + 4 * g;
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
          i8x4_to_f16(prmt(w0, w1, 0x5140u), hv[0], hv[1]);
          i8x4_to_f16(prmt(w0, w1, 0x7362u), hv[2], hv[3]);
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int f = 4 * wd + jj;
            af[f % MTD][f / MTD + 2 * kp] = hv[jj];
          }
        }
      }
      wg_fence();
#pragma unroll
      for (int u = 0; u < MTD; ++u)
        wgmma_rs<N8>(acc[u], af[u], wg_desc_at(pd_lo, PSBO, buf * PB + kk * 256));
    }
    wg_commit();
    wg_wait<0>();
    mbar_arrive(pempty0 + 8 * buf);
    c0w = tr ? clock64_() : 0;
    if (t + STAGES < ntiles) {
      bar_sync(3, 256);  // every PV warp is done reading stage si
      if (CPA) {
        issue_c(t + STAGES);
        if (t + STAGES + 1 < ntiles) lookup_c(n_start + (t + STAGES + 1) * BN);
      } else if (pv == 0 && warp == 0) {
        issue(t + STAGES);
        if (t + STAGES + 1 < ntiles) lookup(n_start + (t + STAGES + 1) * BN);
      }
    }
    if (tr) w_b += clock64_() - c0w;
  }
  if (tr && tid == 256) tr[1] = globaltimer(), tr[3] = ntiles, tr[4] = w_a, tr[7] = w_b;
  griddep_launch_dependents();
  __syncthreads();  // fin_m / fin_l from both QK groups

  // ---- epilogue (verify_attn_split_wg's stores): row sums of both groups at PV's reference.
#pragma unroll
  for (int j = 0; j < N8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 8 * j + 2 * c + e;
      if (row >= rows) continue;
      const float mr = macc[j][e];
      const float l = fin_l[row] * ex2(fin_m[row] - mr) + fin_l[R + row] * ex2(fin_m[R + row] - mr);
      const int tk = row / G, grp = row - (row / G) * G;
      const i64 tok = q_start + q_lo + tk;
      const int hq = h * G + grp;
      if (num_splits == 1) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        unsigned short* o = out + tok * stride_o_tok + (i64)hq * stride_o_head + (4 * pv + warp) * DW + 4 * g;
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
        float* pa = part_acc + pr * D + (4 * pv + warp) * DW + 4 * g;
#pragma unroll
        for (int wd = 0; wd < WV; ++wd) {
          float4 v;
          v.x = acc[(4 * wd + 0) % MTD][j][2 * ((4 * wd + 0) / MTD) + e];
          v.y = acc[(4 * wd + 1) % MTD][j][2 * ((4 * wd + 1) / MTD) + e];
          v.z = acc[(4 * wd + 2) % MTD][j][2 * ((4 * wd + 2) / MTD) + e];
          v.w = acc[(4 * wd + 3) % MTD][j][2 * ((4 * wd + 3) / MTD) + e];
          *reinterpret_cast<float4*>(pa + 32 * wd) = v;
        }
        if (pv == 0 && warp == 0 && g == 0) {
          part_ml[pr * 2] = mr == M_EMPTY ? NEG_INF : mr;
          part_ml[pr * 2 + 1] = l;
        }
      }
    }
  if (tr && tid == 256) tr[2] = globaltimer();
}
