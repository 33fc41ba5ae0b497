// mbarrier and TMA 1D bulk-copy helpers (sm_90), shared by verify_attention.cu and
// ../ceiling_stream.cu: their Python loaders put this text in front of the kernel source (NVRTC
// through torch.cuda._compile_kernel takes one source string and no include path).

__device__ __forceinline__ void mbar_init(unsigned int bar, unsigned int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Spin until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned int bar, unsigned int parity) {
  unsigned int ok = 0;
  while (!ok) {
    asm volatile(
        "{ .reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p; }\n"
        : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  }
}
__device__ __forceinline__ void mbar_arrive(unsigned int bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned int bar, unsigned int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// TMA 1D bulk copy global -> shared, completing `bytes` on the mbarrier (16-byte aligned, x16).
__device__ __forceinline__ void bulk_g2s(unsigned int dst, unsigned long long src, unsigned int bytes,
                                         unsigned int bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
