"""Split-KV verify attention over vLLM 0.32.0's int8 per-token-head paged KV cache (Triton).

Two kernels:

* ``verify_attention_split_kernel``: grid (KV split, KV head, request x query tile). One program
  holds every query row of one KV head (GQA group x the request's query tokens, row
  m = token * G + group) in one tile, walks one contiguous range of the request's keys once, and
  writes an online-softmax partial (unnormalised accumulator, running max, running sum).
  With a single split it normalises and writes the output itself.
* ``verify_attention_combine_kernel``: grid (query token, query head); merges the partials.

Why it looks the way it does (numbers: H200, issue 6):
* KV bytes dominate (520 B per token and KV head at D=256), so the grid is split along the keys
  until it fills the GPU; every KV byte is read once per (request, KV head).
* The V half of each record starts 260 bytes in, so V rows are only 4-byte aligned; the kernel
  addresses K and V from the K view and states the alignment it may assume (``K_ALIGN`` /
  ``V_ALIGN``, derived from the strides), so the loads are 8 / 4 bytes wide, not bytes.
* int8 -> fp16 is exact; on the GPU it is done with the magic-number trick (one xor, two prmt,
  two f16x2 subtracts per 4 values) instead of one I2F per value (measured 10-15% faster). The
  dots run in fp16 with Q pre-scaled by softmax_scale * log2(e) (|q| * scale < 65504 assumed),
  fp32 accumulation. Per-token scales are applied to S (K scale) and to P (V scale), as vLLM does.
* The number of splits is a launch parameter, and each split's key range is computed on the
  device from seqused_k, so a CUDA graph captured once stays valid as lengths change.
* Tried and dropped (H200, 100K, T=8): reading K/V through 16-byte-aligned windows (fewer, wider
  copies; 273 -> 355 us, more registers) and reading int32 words split into 4 interleaved
  sub-dots (no byte-wise shared-memory re-layout; 273 -> 580-935 us).
* Known limit: the kernel is register-bound (255 registers, spills at T >= 8 on Triton 3.6),
  not bandwidth-bound: about 40% of copy bandwidth at T=1 and 20% at T=8 (bench.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Fills the H200's 132 SMs about twice; partial traffic (2 x G*T*D*4 bytes per split and KV head)
# is kept under ~6% of the KV bytes by MIN_SPLIT_TOKENS. Tuned on the H200 (see bench.py).
CTAS_PER_SM = 2
MIN_SPLIT_TOKENS = 256
# Floor on the split count without a sliding window (H200 sweep at eb72f37, HISTORY.md; diag.py
# --sweep re-times it): filling the GPU twice gave batch 4 only 17 splits and batch 8 only 9; 33
# splits was fastest at batch 4 (32K/100K, T=1/8: 1.4-1.8x over 17) and batch 8 (100K T=8), and
# batch 1 keeps its 66.
MIN_SPLITS = 33


@triton.jit
def _i8_to_f16(x, USE_ASM: tl.constexpr):
    """int8 -> fp16, exact. ASM: fp16(0x6400 | (x ^ 0x80)) - 1152 for 4 values per register."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 u, m, c, a0, a1;
            xor.b32 u, $2, 0x80808080;
            mov.b32 m, 0x64646464;
            mov.b32 c, 0x64806480;
            prmt.b32 a0, u, m, 0x4140;
            prmt.b32 a1, u, m, 0x4342;
            sub.f16x2 $0, a0, c;
            sub.f16x2 $1, a1, c;
            }""",
            constraints="=r,=r,r",
            args=[x],
            dtype=tl.float16,
            is_pure=True,
            pack=4,
        )
    else:
        return x.to(tl.float16)


@triton.jit
def verify_attention_split_kernel(
    q_ptr,  # [N, Hq, D] bf16/fp16
    kv_ptr,  # int8 base of the cache (the K view); V is at kv_ptr + v_off
    ks_ptr,  # [num_blocks, P, Hkv] fp32 (strided)
    vs_ptr,  # [num_blocks, P, Hkv] fp32 (strided)
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    cu_q_ptr,  # [B + 1] int32
    out_ptr,  # [N, Hq, D], written when SPLIT is False
    part_acc_ptr,  # [N, Hq, S, D] fp32, written when SPLIT
    part_ml_ptr,  # [N, Hq, S, 2] fp32, written when SPLIT
    qk_scale,  # softmax_scale * log2(e)
    v_off,
    window,  # keys k visible from query position p iff p - k < window; 0 = no window
    num_splits,
    num_q_tiles,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kv_blk,
    stride_kv_slot,
    stride_kv_head,
    stride_ks_blk,
    stride_ks_slot,
    stride_ks_head,
    stride_vs_blk,
    stride_vs_slot,
    stride_vs_head,
    stride_bt,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ALIGN: tl.constexpr,
    V_ALIGN: tl.constexpr,
    USE_ASM: tl.constexpr,
    SPLIT: tl.constexpr,
):
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_bq = tl.program_id(2)
    i_b = i_bq // num_q_tiles
    i_qt = i_bq % num_q_tiles

    q_start = tl.load(cu_q_ptr + i_b)
    q_len = tl.load(cu_q_ptr + i_b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + i_b)
    ctx_len = seq_len - q_len
    q_lo = i_qt * BLOCK_Q
    q_hi = tl.minimum(q_lo + BLOCK_Q, q_len)

    # Keys this query tile can see: [k_lo, k_hi); split them evenly in BLOCK_N multiples.
    k_hi = ctx_len + q_hi
    k_lo = 0
    if window > 0:
        k_lo = tl.maximum(ctx_len + q_lo - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(tl.maximum(k_hi - k_lo, 0), num_splits), BLOCK_N) * BLOCK_N
    n_start = k_lo + i_s * per_split
    n_end = tl.minimum(n_start + per_split, k_hi)

    o_m = tl.arange(0, BLOCK_M)
    o_t = q_lo + o_m // G
    o_hq = i_h * G + o_m % G
    m_row = (o_m < BLOCK_Q * G) & (o_t < q_hi)
    o_d = tl.arange(0, D)
    q_pos = ctx_len + o_t

    p_q = q_ptr + (q_start + o_t).to(tl.int64)[:, None] * stride_q_tok
    p_q += o_hq[:, None] * stride_q_head + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None], other=0.0)
    b_q = (b_q.to(tl.float32) * qk_scale).to(tl.float16)

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    p_bt = block_table_ptr + i_b.to(tl.int64) * stride_bt
    for n0 in range(n_start, n_end, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < n_end
        blk = tl.load(p_bt + o_n // PAGE, mask=m_n, other=0).to(tl.int64)
        slot = o_n % PAGE
        o_k = blk * stride_kv_blk + slot * stride_kv_slot + i_h * stride_kv_head
        o_v = tl.multiple_of(o_k + v_off, V_ALIGN)
        o_k = tl.multiple_of(o_k, K_ALIGN)
        b_k = tl.load(kv_ptr + o_k[:, None] + o_d[None, :], mask=m_n[:, None], other=0)
        b_v = tl.load(kv_ptr + o_v[:, None] + o_d[None, :], mask=m_n[:, None], other=0)
        b_ks = tl.load(
            ks_ptr + blk * stride_ks_blk + slot * stride_ks_slot + i_h * stride_ks_head,
            mask=m_n,
            other=0.0,
        )
        b_vs = tl.load(
            vs_ptr + blk * stride_vs_blk + slot * stride_vs_slot + i_h * stride_vs_head,
            mask=m_n,
            other=0.0,
        )

        b_s = tl.dot(b_q, tl.trans(_i8_to_f16(b_k, USE_ASM))) * b_ks[None, :]
        m_vis = m_n[None, :] & (o_n[None, :] <= q_pos[:, None])
        if window > 0:
            m_vis &= (q_pos[:, None] - o_n[None, :]) < window
        b_s = tl.where(m_vis, b_s, float("-inf"))

        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        b_p = tl.exp2(b_s - m_safe[:, None])
        alpha = tl.exp2(b_m - m_safe)
        b_l = b_l * alpha + tl.sum(b_p, 1)
        b_pv = (b_p * b_vs[None, :]).to(tl.float16)
        b_acc = b_acc * alpha[:, None] + tl.dot(b_pv, _i8_to_f16(b_v, USE_ASM))
        b_m = m_new

    o_tok = (q_start + o_t).to(tl.int64)
    if SPLIT:
        o_row = (o_tok * tl.num_programs(1) * G + o_hq) * num_splits + i_s
        tl.store(part_acc_ptr + o_row[:, None] * D + o_d[None, :], b_acc, mask=m_row[:, None])
        tl.store(part_ml_ptr + o_row * 2, b_m, mask=m_row)
        tl.store(part_ml_ptr + o_row * 2 + 1, b_l, mask=m_row)
    else:
        b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
        p_o = out_ptr + o_tok[:, None] * stride_o_tok + o_hq[:, None] * stride_o_head
        tl.store(p_o + o_d[None, :], b_o.to(out_ptr.dtype.element_ty), mask=m_row[:, None])


@triton.jit
def verify_attention_combine_kernel(
    out_ptr,  # [N, Hq, D]
    part_acc_ptr,  # [N, Hq, S, D] fp32
    part_ml_ptr,  # [N, Hq, S, 2] fp32
    num_splits,
    stride_o_tok,
    stride_o_head,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits: the (max, sum) pairs are read at once
    CHUNK_S: tl.constexpr,  # splits per accumulator chunk ([CHUNK_S, BLOCK_D] fp32 in registers)
    BLOCK_D: tl.constexpr,  # output columns per program (grid axis 2: more programs in flight)
):
    i_t = tl.program_id(0).to(tl.int64)
    i_hq = tl.program_id(1)
    i_d = tl.program_id(2)
    o_base = (i_t * tl.num_programs(1) + i_hq) * num_splits
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < num_splits
    b_m = tl.load(part_ml_ptr + (o_base + o_s) * 2, mask=m_s, other=float("-inf"))
    b_l = tl.load(part_ml_ptr + (o_base + o_s) * 2 + 1, mask=m_s, other=0.0)
    m_max = tl.max(b_m, 0)
    b_w = tl.where(b_m > float("-inf"), tl.exp2(b_m - m_max), 0.0)
    denom = tl.sum(b_w * b_l, 0)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_c = tl.arange(0, CHUNK_S)
    b_o = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        m_c = (s0 + o_c) < num_splits
        c_m = tl.load(part_ml_ptr + (o_base + s0 + o_c) * 2, mask=m_c, other=float("-inf"))
        c_w = tl.where(c_m > float("-inf"), tl.exp2(c_m - m_max), 0.0)
        p_acc = part_acc_ptr + (o_base + s0 + o_c)[:, None] * D + o_d[None, :]
        b_acc = tl.load(p_acc, mask=m_c[:, None], other=0.0)
        b_o += tl.sum(b_acc * c_w[:, None], 0)
    p_o = out_ptr + i_t * stride_o_tok + i_hq * stride_o_head + o_d
    tl.store(p_o, (b_o / denom).to(out_ptr.dtype.element_ty))


def _alignment(*byte_offsets: int) -> int:
    """Largest power of two up to 16 dividing every offset (0 divides by anything)."""
    g = 0
    for x in byte_offsets:
        g = math.gcd(g, int(x))
    return 16 if g == 0 else min(16, g & -g)


def _launch_config(block_m: int) -> dict[str, int]:
    """BLOCK_N / warps / stages per query-tile height (H200 sweep at 100K, eefae98; HISTORY.md)."""
    if block_m <= 16:
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if block_m <= 64:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def default_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    num_q_tiles: int,
    max_seqlen_k: int,
    device: torch.device,
    windowed: bool = False,
) -> int:
    """Splits per (request, KV head, query tile): enough to fill the GPU twice, at least
    MIN_SPLITS without a sliding window, at most one per MIN_SPLIT_TOKENS keys."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    want = triton.cdiv(CTAS_PER_SM * sms, num_seqs * num_kv_heads * num_q_tiles)
    if not windowed:
        want = max(want, MIN_SPLITS)
    return max(1, min(want, triton.cdiv(max_seqlen_k, MIN_SPLIT_TOKENS)))


def verify_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seqused_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    window: int,
    block_table: torch.Tensor,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_asm: bool | None = None,
) -> torch.Tensor:
    """Launcher; see ``kernels.verify_attention.verify_attention`` for the contract."""
    num_tokens, num_q_heads, head_size = q.shape
    num_seqs = seqused_k.shape[0]
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    page = k.shape[1]

    block_m = max(16, triton.next_power_of_2(group * max(1, max_seqlen_q)))
    block_m = min(block_m, max(128, triton.next_power_of_2(group)))
    block_q = block_m // group
    num_q_tiles = triton.cdiv(max(1, max_seqlen_q), block_q)
    cfg = _launch_config(block_m)
    block_n = block_n or cfg["BLOCK_N"]
    if num_splits is None:
        num_splits = default_num_splits(
            num_seqs, num_kv_heads, num_q_tiles, max_seqlen_k, q.device, windowed=window > 0
        )
    if use_asm is None:
        use_asm = q.is_cuda and not _interpreting()

    v_off = v.data_ptr() - k.data_ptr()
    split = num_splits > 1
    if split:
        part_acc = torch.empty(
            num_tokens, num_q_heads, num_splits, head_size, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            num_tokens, num_q_heads, num_splits, 2, dtype=torch.float32, device=q.device
        )
    else:
        part_acc = part_ml = out  # unused
    grid = (num_splits, num_kv_heads, num_seqs * num_q_tiles)
    args = (
        q, k, k_scale_cache, v_scale_cache, block_table, seqused_k, cu_seqlens_q,
        out, part_acc, part_ml,
        softmax_scale * LOG2E, v_off, window, num_splits, num_q_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        k_scale_cache.stride(0), k_scale_cache.stride(1), k_scale_cache.stride(2),
        v_scale_cache.stride(0), v_scale_cache.stride(1), v_scale_cache.stride(2),
        block_table.stride(0),
    )  # fmt: skip
    meta = dict(
        G=group, D=head_size, PAGE=page, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        USE_ASM=use_asm, SPLIT=split,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )  # fmt: skip
    k_align = _alignment(*k.stride()[:3], k.data_ptr())
    v_align = _alignment(*k.stride()[:3], k.data_ptr(), v_off)
    verify_attention_split_kernel[grid](*args, K_ALIGN=k_align, V_ALIGN=v_align, **meta)
    if split:
        block_d = min(head_size, 64)
        block_s = triton.next_power_of_2(num_splits)
        verify_attention_combine_kernel[(num_tokens, num_q_heads, head_size // block_d)](
            out, part_acc, part_ml, num_splits, out.stride(0), out.stride(1),
            D=head_size, BLOCK_S=block_s, CHUNK_S=min(block_s, 64), BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
