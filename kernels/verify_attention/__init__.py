"""Verify attention (1 + k query tokens per request) over vLLM 0.32.0's int8 per-token-head cache."""

from __future__ import annotations

import math
import os
import warnings

import torch

from kernels.verify_attention.reference import (
    Int8KVCache,
    make_int8_kv_cache,
    naive_verify_attention,
    write_int8_kv,
)

__all__ = [
    "Int8KVCache",
    "make_int8_kv_cache",
    "naive_verify_attention",
    "split_kv_verify_attention",
    "verify_attention",
    "write_int8_kv",
]


def split_kv_verify_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seqused_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float | None,
    window_size: tuple[int, int],
    block_table: torch.Tensor,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its int8 per-token-head paged cache.

    Takes the tensors vLLM 0.32.0's TRITON_ATTN backend passes to ``unified_attention`` for
    ``kv_cache_dtype="int8_per_token_head"`` (same names and order, minus the options this op
    does not support), so an engine plugin can call it in its place for verify (and decode)
    batches. Legend: N query tokens in the batch, B requests, Hq / Hkv query / KV heads,
    D head size (a power of two, >= 16), P page size (any, e.g. 16 or 1616), NB cache blocks.

    Backends: on sm_90 GPUs with D in {128, 256} and the cache in vLLM's layout, the CUDA kernel
    in ``cuda/`` (compiled by NVRTC on first use); otherwise, and on the CPU (Triton's
    interpreter), the Triton kernel in ``triton.py``. ``HH_VERIFY_ATTENTION_BACKEND=triton``
    forces Triton, ``=cuda`` forces CUDA (an error where unsupported).

    Args:
        q: [N, Hq, D] bf16 or fp16; rows of request i are cu_seqlens_q[i]:cu_seqlens_q[i+1].
        k: [NB, P, Hkv, D + 4] int8, the backend's key view: ``kv_cache.transpose(1, 2)
            .split(D + 4, -1)[0]``; byte D..D+3 of each row is the fp32 K scale.
        v: [NB, P, Hkv, D + 4] int8, the value view (same strides as k, D + 4 bytes after it).
        out: [N, Hq, D], q's dtype; every row of the N is written.
        cu_seqlens_q: [B + 1] int32, starts with 0.
        max_seqlen_q: host int >= every query length (sizes the query tile; 1..16 typical).
        seqused_k: [B] int32, keys per request including its own query tokens.
        max_seqlen_k: host int >= every seqused_k (picks the split count when num_splits is None).
        softmax_scale: None means 1/sqrt(D).
        window_size: vLLM's (left, right): left >= 0 lets position p see keys k with
            p - k <= left (a model sliding window W is (W - 1, 0)); (-1, -1) means none.
        block_table: [B, max_blocks] int32, logical page -> physical block.
        k_scale_cache: [NB, P, Hkv] fp32 strided view over the inline K scales.
        v_scale_cache: [NB, P, Hkv] fp32 strided view over the inline V scales.
        num_splits: KV splits per (request, KV head, query tile); None picks one from
            max_seqlen_k and the GPU's SM count. Pass a fixed value under CUDA-graph capture: each split's key range
            is computed on the device from seqused_k, so one value serves every length.

    Returns:
        out.

    Example:
        >>> cache = make_int8_kv_cache(num_blocks, 16, 4, 256, "cuda")
        >>> split_kv_verify_attention(q, cache.k, cache.v, out, cu_q, 9, seq_lens, 100_000,
        ...                           None, (-1, -1), block_table, cache.k_scale, cache.v_scale)
    """
    _check(q, k, v, out, cu_seqlens_q, seqused_k, block_table, k_scale_cache, v_scale_cache)
    head_size = q.shape[2]
    scale = 1.0 / math.sqrt(head_size) if softmax_scale is None else float(softmax_scale)
    window = window_size[0] + 1 if window_size[0] >= 0 else 0
    if _use_cuda(q, k, v, out, k_scale_cache, v_scale_cache):
        from kernels.verify_attention.cuda import verify_attention_cuda

        try:
            return verify_attention_cuda(
                q, k, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, scale, window,
                block_table, num_splits=num_splits,
            )  # fmt: skip
        except Exception as exc:  # compile / load failure: say so once, use Triton from then on
            if _backend() == "cuda":
                raise
            _CUDA_BROKEN.append(repr(exc))
            warnings.warn(f"verify_attention: CUDA kernel unavailable ({exc!r}); using Triton")
    from kernels.verify_attention.triton import verify_attention_fwd

    return verify_attention_fwd(
        q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, scale, window,
        block_table, k_scale_cache, v_scale_cache, num_splits=num_splits,
    )  # fmt: skip


verify_attention = split_kv_verify_attention

# Set when compiling or loading the CUDA kernel failed once in this process.
_CUDA_BROKEN: list[str] = []


def _backend() -> str:
    """HH_VERIFY_ATTENTION_BACKEND: auto (default: CUDA where supported, else Triton), triton, cuda."""
    return os.environ.get("HH_VERIFY_ATTENTION_BACKEND", "auto").lower()


def _use_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
) -> bool:
    backend = _backend()
    if backend == "triton" or (backend == "auto" and _CUDA_BROKEN) or not q.is_cuda:
        return False
    from kernels.verify_attention import cuda as va_cuda

    ok = va_cuda.supported(q, k, v, out, k_scale_cache, v_scale_cache)
    if backend == "cuda" and not ok:
        raise ValueError("HH_VERIFY_ATTENTION_BACKEND=cuda but this call is not supported by it")
    return ok


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
) -> None:
    n, hq, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"head size {d} must be a power of two >= 16")
    if k.dtype != torch.int8 or v.dtype != torch.int8:
        raise ValueError(f"k/v must be int8 views, got {k.dtype} / {v.dtype}")
    if k.dim() != 4 or k.shape[-1] < d or k.shape[2] == 0 or hq % k.shape[2]:
        raise ValueError(f"k shape {tuple(k.shape)} does not fit q shape {tuple(q.shape)}")
    if k.stride() != v.stride() or k.shape != v.shape:
        raise ValueError(f"k/v views differ: {k.stride()} vs {v.stride()}")
    if k.stride(3) != 1:
        raise ValueError(f"k/v rows must be contiguous, stride {k.stride()}")
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)}/{out.dtype} vs q {tuple(q.shape)}/{q.dtype}")
    for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        if t.dtype != torch.float32 or tuple(t.shape) != tuple(k.shape[:3]):
            raise ValueError(f"{name} must be fp32 {tuple(k.shape[:3])}, got {tuple(t.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if cu_seqlens_q.shape[0] != seqused_k.shape[0] + 1 or block_table.shape[0] < seqused_k.shape[0]:
        raise ValueError(
            f"batch sizes differ: cu_seqlens_q {tuple(cu_seqlens_q.shape)}, "
            f"seqused_k {tuple(seqused_k.shape)}, block_table {tuple(block_table.shape)}"
        )
