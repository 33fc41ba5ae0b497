// Pure-read ceiling probes for vLLM 0.32.0's int8_per_token_head paged KV cache (issue 6).
//
// Question they answer: which fraction of the device's copy bandwidth can ANY kernel reach when
// it reads exactly the bytes of one request's context through its block table (batch 1, no
// window, 4 KV heads x D = 256: a slot is 4 records of 520 bytes = 2,080 contiguous bytes, a page
// of P slots P x 2,080 contiguous bytes)? Each probe reads every byte once, adds the 32-bit words
// (wrapping) so nothing is optimised away, and stores one partial sum per warp (sink[warp of the
// grid]); ceiling_stream.py checks the total against torch's sum of the same bytes.
//
// * va_ceil_tma: persistent grid (CTAS_PER_SM x SMs CTAs), warp 0 lane 0 streams units of TOK
//   slots (TOK x 2,080 contiguous bytes inside one page) with cp.async.bulk (TMA 1D bulk copy)
//   into a STAGES-deep shared-memory ring (full / empty mbarriers); CW consumer warps add the
//   words from shared memory. CTA c takes units [c n / G, (c + 1) n / G).
// * va_ceil_ld: plain 16-byte ld.global.nc vector loads, 256 threads, UNROLL loads in flight per
//   thread, MINB CTAs per SM; the context flattened into 16-byte elements (130 per slot), element
//   e at page e / (P x 130) of the block table; CTA c takes a contiguous range of elements (GS
//   false) or chunks of 256 x UNROLL elements grid-strided (GS true). HINT adds the
//   .L2::256B prefetch-size qualifier.
// * va_ceil_ld_head: the split kernel's per-head pattern with va_ceil_ld's loop: CTA c reads only
//   KV head c % 4, through the same 16-byte-aligned 528-byte window per (slot, head) (33 loads;
//   the window starts 0 or 8 bytes before the 520-byte record, so it overlaps a neighbour's).
//
// No header: compiled by NVRTC (torch.cuda._compile_kernel) for sm_90a, after cuda/sm90_bulk.cuh.

typedef unsigned int u32;
typedef unsigned long long u64;

#define DI __device__ __forceinline__
#define SLOT 2080           // bytes per slot: 4 KV heads x (256 + 4 + 256 + 4)
#define SLOT16 (SLOT / 16)  // 16-byte elements per slot: 130
#define REC 520             // bytes per (slot, head) record
#define WIN 33              // 16-byte windows covering one record

DI u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

template <bool HINT>
DI uint4 ldg16(u64 a) {
  uint4 v;
  if (HINT)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
  return v;
}

DI u32 sum4(uint4 v) { return v.x + v.y + v.z + v.w; }

DI u32 warp_sum(u32 x) {
#pragma unroll
  for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// mbar_* and bulk_g2s: cuda/sm90_bulk.cuh, put in front of this text by ceiling_stream.py.

// grid: (CTAs, 1, 1), block: 32 x (1 + CW), dynamic shared memory STAGES x TOK x SLOT bytes.
// sink: int32 [grid x CW] (one sum per consumer warp).
template <int TOK, int STAGES, int CW>
__global__ void __launch_bounds__(32 * (1 + CW), 1)
    va_ceil_tma(const char* kv, const int* bt, int ctx, int page, int stride_blk, u32* sink) {
  constexpr u32 STAGE = TOK * SLOT;
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) u64 bars[2 * STAGES];  // full[s], then empty[s]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_units = (ctx + TOK - 1) / TOK;
  const int u0 = (int)((long long)blockIdx.x * n_units / gridDim.x);
  const int u1 = (int)((long long)(blockIdx.x + 1) * n_units / gridDim.x);
  const u32 ring_s = smem_addr(ring), full0 = smem_addr(bars), empty0 = full0 + 8 * STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, CW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {
    // Producer warp: the 32 lanes look up 32 units' sources at once (one coalesced block-table
    // read), lane 0 issues them in order, each after its stage's previous unit was consumed.
    for (int g = u0; g < u1; g += 32) {
      const int u = g + lane;
      u64 src = 0;
      u32 bytes = 0;
      if (u < u1) {
        const int tok = u * TOK, p = tok / page, slot = tok - p * page;
        src = (u64)kv + (u64)__ldg(bt + p) * (u64)stride_blk + (u64)slot * SLOT;
        bytes = (u32)min(TOK, ctx - tok) * SLOT;
      }
      const int nj = min(32, u1 - g);
      for (int j = 0; j < nj; ++j) {
        const u64 sj = __shfl_sync(0xffffffffu, src, j);
        const u32 bj = __shfl_sync(0xffffffffu, bytes, j);
        if (lane == 0) {
          const int it = g + j - u0, s = it % STAGES;
          if (it >= STAGES) mbar_wait(empty0 + 8 * s, ((it / STAGES) - 1) & 1);
          mbar_expect_tx(full0 + 8 * s, bj);
          bulk_g2s(ring_s + s * STAGE, sj, bj, full0 + 8 * s);
        }
        __syncwarp();
      }
    }
    return;
  }
  const int ct = threadIdx.x - 32;
  u32 acc = 0;
  for (int u = u0; u < u1; ++u) {
    const int it = u - u0, s = it % STAGES;
    mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
    const int n16 = min(TOK, ctx - u * TOK) * SLOT16;
    const uint4* st = reinterpret_cast<const uint4*>(ring + s * STAGE);
    for (int i = ct; i < n16; i += 32 * CW) acc += sum4(st[i]);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * s);
  }
  acc = warp_sum(acc);
  if (lane == 0) sink[blockIdx.x * CW + warp - 1] = acc;
}

// grid: (CTAs, 1, 1), block 256; sink: int32 [grid x 8].
template <int PAGE, int UNROLL, int MINB, bool GS, bool HINT>
__global__ void __launch_bounds__(256, MINB)
    va_ceil_ld(const char* kv, const int* bt, int ctx, int stride_blk, u32* sink) {
  constexpr u32 EP = PAGE * SLOT16;  // 16-byte elements per page
  const u32 n = (u32)ctx * SLOT16, tid = threadIdx.x;
  u32 acc = 0;
  auto step = [&](u32 e0, u32 e1) {  // UNROLL loads: elements e0 + k x 256 below e1
    uint4 v[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const u32 e = e0 + k * 256;
      v[k] = make_uint4(0, 0, 0, 0);
      if (e < e1) {
        const u32 p = e / EP, off = e - p * EP;
        v[k] = ldg16<HINT>((u64)kv + (u64)__ldg(bt + p) * (u64)stride_blk + (u64)off * 16);
      }
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) acc += sum4(v[k]);
  };
  if (GS) {
    for (u32 c = blockIdx.x * (256u * UNROLL); c < n; c += gridDim.x * (256u * UNROLL)) step(c + tid, n);
  } else {
    const u32 e0 = (u32)((u64)blockIdx.x * n / gridDim.x), e1 = (u32)((u64)(blockIdx.x + 1) * n / gridDim.x);
    for (u32 c = e0; c < e1; c += 256u * UNROLL) step(c + tid, e1);
  }
  acc = warp_sum(acc);
  if (tid % 32 == 0) sink[blockIdx.x * 8 + tid / 32] = acc;
}

// grid: (CTAs, 1, 1) with CTAs % 4 == 0, block 256; sink: int32 [grid x 8].
template <int PAGE, int UNROLL, int MINB>
__global__ void __launch_bounds__(256, MINB)
    va_ceil_ld_head(const char* kv, const int* bt, int ctx, int stride_blk, u32* sink) {
  const int h = blockIdx.x % 4, part = blockIdx.x / 4, parts = gridDim.x / 4;
  const u32 t0 = (u32)((u64)part * ctx / parts), t1 = (u32)((u64)(part + 1) * ctx / parts);
  const u64 rec = (u64)kv + h * REC, base = rec - (rec & 15u);  // 16-byte-aligned window start
  const u32 e1 = (t1 - t0) * WIN, tid = threadIdx.x;
  u32 acc = 0;
  for (u32 c = tid; c < e1; c += 256u * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const u32 e = c + k * 256;
      v[k] = make_uint4(0, 0, 0, 0);
      if (e < e1) {
        const u32 r = e / WIN, w = e - r * WIN, tok = t0 + r, p = tok / PAGE, slot = tok - p * PAGE;
        v[k] = ldg16<false>(base + (u64)__ldg(bt + p) * (u64)stride_blk + (u64)slot * SLOT + w * 16);
      }
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) acc += sum4(v[k]);
  }
  acc = warp_sum(acc);
  if (tid % 32 == 0) sink[blockIdx.x * 8 + tid / 32] = acc;
}

// Explicit instantiations for an offline compile check (nvcc -cubin); NVRTC instantiates by name.
#ifdef VA_CEIL_INSTANTIATE
template __global__ void va_ceil_tma<8, 12, 4>(const char*, const int*, int, int, int, u32*);
template __global__ void va_ceil_tma<16, 6, 4>(const char*, const int*, int, int, int, u32*);
template __global__ void va_ceil_ld<16, 8, 4, false, false>(const char*, const int*, int, int, u32*);
template __global__ void va_ceil_ld<16, 4, 8, false, false>(const char*, const int*, int, int, u32*);
template __global__ void va_ceil_ld<1616, 8, 4, true, true>(const char*, const int*, int, int, u32*);
template __global__ void va_ceil_ld_head<16, 8, 4>(const char*, const int*, int, int, u32*);
#endif
