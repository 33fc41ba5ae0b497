// Lookup-drafting scan as one thread-block cluster per request (sm_90; NVRTC, no headers).
//
// Why a cluster: at 100K tokens and batch 1 the Triton kernel's scan is done ~1 µs into the launch,
// but its one-launch fold then costs three dependent global round trips (a contended ticket RMW,
// the max, the winner's draft: ~1.5 µs, prof.py --stamps).  Inside a cluster the fold is a
// hardware barrier and distributed-shared-memory stores: each CTA stages its slice of the history
// in shared memory (so its best match's draft is a shared-memory read), writes (best, draft) into
// its own slot of rank 0's shared memory, arrives at the cluster barrier and exits; rank 0 waits,
// picks the max and stores the proposal.  No global atomics, no workspace.
//
// Work split: CTA `rank` of request b owns end positions e in [rank * CHUNK, (rank + 1) * CHUNK),
// CHUNK = ceil((S - 1) / C) rounded up to 4 tokens, fixed by the buffer's capacity S, so the slice
// (HALO tokens before it, KD after it) is loaded before the length arrives (one DRAM trip for both).
// Score of e: m(e) = #{leading j < MAX_N : h[e - j] == h[L - 1 - j]}, capped at e + 1; a match iff
// m >= MIN_N and e <= L - 2; packed (m << 26 | e + 1), whose max is the longest n, then the most
// recent position: the serial rule of reference.py (same packing as triton.py).
//
// Compile-time parameters (-D): LS_C cluster CTAs, LS_THREADS, LS_MIN_N, LS_MAX_N, LS_K (drafts),
// LS_HAS_REQ (req_idx given), LS_REQ64 / LS_LEN64 (int64 req_idx / seq_lens, else int32).

typedef unsigned int u32;
typedef long long i64;

#define DI __device__ __forceinline__
#define POS_BITS 26
#define HALO (((LS_MAX_N - 1) + 3) / 4 * 4)  // tokens staged before the slice: h[e - j], j < MAX_N
#define KD ((LS_K + 3) / 4 * 4)               // tokens staged after it: the draft of its last position
#define WARPS (LS_THREADS / 32)

DI u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

DI u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Address of the same shared variable in CTA `rank` of the cluster.
DI u32 map_rank(u32 addr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}

DI void st_cluster(u32 addr, int v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

DI void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
DI void cluster_arrive_release() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
DI void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// 16-byte global -> shared copy; src_bytes < 16 zero-fills the rest (0: nothing is read).
DI void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

DI int warp_max(int v) {  // scores are >= 0: unsigned max
  u32 r;
  asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"((u32)v));
  return (int)r;
}

DI int load_index(const void* p, i64 i, bool wide) {
  return wide ? (int)__ldg((const i64*)p + i) : __ldg((const int*)p + i);
}

extern "C" __global__ void __cluster_dims__(LS_C, 1, 1) __launch_bounds__(LS_THREADS, 1)
lookup_scan_cluster(const int* __restrict__ tokens,  // [R, s_tok] int32 histories
                    const void* __restrict__ req_idx,  // [B] rows to serve (LS_HAS_REQ)
                    const void* __restrict__ seq_lens,  // [R] history lengths
                    i64* __restrict__ drafts,          // [B, LS_K] out
                    int* __restrict__ num_valid,       // [B] out
                    int s_tok, int S, int chunk) {
  // sh: [HALO + chunk + KD] tokens of the slice; slot_best / slot_draft: used in rank 0 only
  extern __shared__ __align__(16) int sh[];
  __shared__ int slot_best[LS_C];
  __shared__ int slot_draft[LS_C][KD];
  __shared__ int warp_best[WARPS];
  const u32 rank = cluster_rank();
  const int b = blockIdx.x / LS_C;
  const int tid = threadIdx.x;
  // Phase 1 of the cluster barrier: every CTA has started before anyone writes into rank 0.
  cluster_arrive_relaxed();

  const i64 row = LS_HAS_REQ ? (i64)load_index(req_idx, b, LS_REQ64) : (i64)b;
  const int* h = tokens + row * (i64)s_tok;
  const int e0 = (int)rank * chunk;  // first end position of the slice
  const int lo = e0 - HALO;          // first staged token (a multiple of 4: vectors are all < 0 or all >= 0)
  const int n_vec = (HALO + chunk + KD) / 4;
  const u32 sh0 = smem_addr(sh);
  for (int v = tid; v < n_vec; v += LS_THREADS) {  // independent of the length: all in flight at once
    const int p = lo + 4 * v;
    const int valid = p < 0 ? 0 : min(max(S - p, 0), 4);
    cp_async16(sh0 + 16u * v, valid ? (const void*)(h + p) : (const void*)h, 4 * valid);
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");

  const int L = load_index(seq_lens, row, LS_LEN64);
  int s[LS_MAX_N];  // the suffix, last token first; s[j] is only compared when j <= e <= L - 2
#pragma unroll
  for (int j = 0; j < LS_MAX_N; ++j) s[j] = L - 1 - j >= 0 ? __ldg(h + L - 1 - j) : -1;
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();

  // Scan: four end positions per thread and step (one 16-byte shared load); the extension past the
  // last token runs only on its hits (quoting histories: almost never).
  int best = 0;
  const int e_end = min(e0 + chunk, L - 1);  // e <= L - 2
  for (int e = e0 + 4 * tid; e < e_end; e += 4 * LS_THREADS) {
    const int4 v = *reinterpret_cast<const int4*>(sh + (e - lo));
    const int t4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int ee = e + c;
      if (t4[c] == s[0] && ee < e_end) {
        const int lim = min(LS_MAX_N, ee + 1);
        int m = 1;
#pragma unroll
        for (int j = 1; j < LS_MAX_N; ++j)
          if (m == j && j < lim && sh[ee - j - lo] == s[j]) m = j + 1;
        if (m >= LS_MIN_N) best = max(best, (m << POS_BITS) | (ee + 1));
      }
    }
  }
  best = warp_max(best);
  if ((tid & 31) == 0) warp_best[tid >> 5] = best;
  __syncthreads();

  // Warp 0: the CTA's best, its draft (shared-memory reads: start - lo + i < HALO + chunk + KD), and
  // the stores into this CTA's slot of rank 0.
  if (tid < 32) {
    int w = tid < WARPS ? warp_best[tid] : 0;
    w = warp_max(w);
    cluster_wait();  // phase 1: rank 0 is running
    const int start = w & ((1 << POS_BITS) - 1);
    const int nv = w > 0 ? min(L - start, LS_K) : 0;
    if (tid == 0) st_cluster(map_rank(smem_addr(&slot_best[rank]), 0), w);
    if (tid < nv) st_cluster(map_rank(smem_addr(&slot_draft[rank][tid]), 0), sh[start - lo + tid]);
  } else {
    cluster_wait();
  }
  cluster_arrive_release();  // phase 2: the slot is written
  if (rank != 0) return;     // nothing reads this CTA's shared memory
  cluster_wait();

  if (tid < 32) {
    int w = tid < LS_C ? slot_best[tid] : 0;
    w = warp_max(w);
    const int start = w & ((1 << POS_BITS) - 1);
    const int nv = w > 0 ? min(L - start, LS_K) : 0;
    const int fill = L > 0 ? s[0] : 0;
    if (tid < LS_K) {
      const int owner = w > 0 ? (start - 1) / chunk : 0;  // the CTA whose slice holds e = start - 1
      drafts[(i64)b * LS_K + tid] = tid < nv ? slot_draft[owner][tid] : fill;
    }
    if (tid == 0) num_valid[b] = nv;
  }
}
