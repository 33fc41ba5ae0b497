"""The specification of verify attention over vLLM 0.32.0's int8 per-token-head KV cache.

Plain torch, fp32. Two parts:

* ``make_int8_kv_cache`` / ``write_int8_kv``: the cache exactly as vLLM 0.32.0's TRITON_ATTN
  backend holds it for ``kv_cache_dtype="int8_per_token_head"``. The backend receives a logical
  ``[num_blocks, Hkv, block_size, 2 * (D + 4)]`` int8 tensor whose physical order is
  ``[block][slot][head][record]`` (NHD). Each ``(slot, head)`` record of ``2 * (D + 4)`` bytes is
  ``K int8 x D | K scale fp32 | V int8 x D | V scale fp32``, so V starts ``D + 4`` bytes into the
  record and is only 4-byte aligned. The backend hands its kernel the views below
  (``TritonAttentionImpl._pth_key_value_caches`` and ``_ensure_scale_caches``).
* ``naive_verify_attention``: dequantize K/V per token and head, causal attention of each
  request's query rows (its last ``q_len`` positions) over its whole context, softmax scale
  ``1/sqrt(D)`` unless given, optional sliding window.

Shape legend: B requests, T query tokens of a request (1 + draft tokens), N = sum of T over the
batch, Hq query heads, Hkv KV heads (Hq % Hkv == 0), D head size, L a request's context length
(keys, including its own query tokens), P the page (block) size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # one fp32 scale after each of K and V in every (slot, head) record


@dataclass(frozen=True)
class Int8KVCache:
    """Views over one layer's int8 per-token-head cache, as the TRITON_ATTN backend builds them.

    raw:     [num_blocks, Hkv, P, 2 * (D + 4)] int8, NHD physical strides (the backend's input)
    k, v:    [num_blocks, P, Hkv, D + 4] int8 views (the first D bytes of each are the data)
    k_scale, v_scale: [num_blocks, P, Hkv] fp32 strided views over the inline scales
    """

    raw: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @property
    def head_size(self) -> int:
        return self.k.shape[-1] - SCALE_BYTES

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


def make_int8_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    device: torch.device | str = "cpu",
    block_pad_bytes: int = 0,
) -> Int8KVCache:
    """Allocate an (unfilled) cache with vLLM 0.32.0's int8_per_token_head layout.

    ``block_pad_bytes`` adds padding after every block, as vLLM does when attention pages share
    their size with mamba pages; kernels must read strides from the tensors.
    """
    record = 2 * (head_size + SCALE_BYTES)
    block_bytes = block_size * num_kv_heads * record + block_pad_bytes
    if block_bytes % 16:
        raise ValueError(f"block stride {block_bytes} B is not a multiple of 16")
    storage = torch.empty(num_blocks * block_bytes, dtype=torch.int8, device=device)
    raw = storage.as_strided(
        (num_blocks, num_kv_heads, block_size, record),
        (block_bytes, record, num_kv_heads * record, 1),
    )
    k, v = raw.transpose(1, 2).split(record // 2, dim=-1)
    f32 = storage.view(torch.float32)
    size = (num_blocks, block_size, num_kv_heads)
    stride = (block_bytes // 4, num_kv_heads * record // 4, record // 4)
    k_scale = f32.as_strided(size, stride, head_size // 4)
    v_scale = f32.as_strided(size, stride, (record // 2 + head_size) // 4)
    return Int8KVCache(raw=raw, k=k, v=v, k_scale=k_scale, v_scale=v_scale)


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (int8 [..., D], fp32 scale [...]), as vLLM's cache write does it.

    scale = max(absmax / 127, 1e-6); round half away from zero; clamp to [-128, 127].
    """
    xf = x.float()
    scale = (xf.abs().amax(-1) / 127.0).clamp_min(1e-6)
    y = xf * (1.0 / scale)[..., None]
    y = torch.where(y >= 0, y + 0.5, y - 0.5).trunc().clamp(-128, 127)
    return y.to(torch.int8), scale


def write_int8_kv(
    cache: Int8KVCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """Quantize and store key/value [n, Hkv, D] at flat slot ids [n] (block * P + offset)."""
    d = cache.head_size
    blk, off = slots // cache.block_size, slots % cache.block_size
    kq, ks = quantize_per_token_head(key)
    vq, vs = quantize_per_token_head(value)
    cache.k[blk, off, :, :d] = kq
    cache.v[blk, off, :, :d] = vq
    cache.k_scale[blk, off] = ks
    cache.v_scale[blk, off] = vs


def gather_dequantized(
    cache: Int8KVCache, block_row: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's first ``length`` keys and values, dequantized: 2 x [length, Hkv, D] fp32."""
    d, p = cache.head_size, cache.block_size
    blocks = block_row[: -(-length // p)].long()
    k = cache.k[blocks].flatten(0, 1)[:length, :, :d].float()
    v = cache.v[blocks].flatten(0, 1)[:length, :, :d].float()
    ks = cache.k_scale[blocks].flatten(0, 1)[:length].float()
    vs = cache.v_scale[blocks].flatten(0, 1)[:length].float()
    return k * ks[..., None], v * vs[..., None]


def naive_verify_attention(
    q: torch.Tensor,
    cache: Int8KVCache,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """The reference: returns fp32 [N, Hq, D].

    q:            [N, Hq, D], any float dtype (upcast to fp32)
    cache:        one layer's int8 per-token-head cache (see ``Int8KVCache``)
    cu_seqlens_q: [B + 1] int, request i owns query rows cu[i]:cu[i+1]
    seqused_k:    [B] int, keys of request i (its query tokens are the last q_len of them)
    block_table:  [B, max_blocks] int, logical page -> physical block
    window_size:  vLLM's (left, right); left >= 0 lets query position p see keys k with
                  p - k <= left (so a model window W is left = W - 1); right is ignored (causal).
    """
    n, hq, d = q.shape
    hkv = cache.k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for i, length in enumerate(seqused_k.tolist()):
        q_len = cu[i + 1] - cu[i]
        if q_len == 0:
            continue
        k, v = gather_dequantized(cache, block_table[i], length)
        k = k.repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(hq // hkv, dim=1)
        qi = q[cu[i] : cu[i + 1]].float()  # [T, Hq, D]
        s = torch.einsum("thd,lhd->htl", qi, k) * scale
        q_pos = torch.arange(length - q_len, length, device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window_size[0] >= 0:
            allowed &= q_pos - k_pos <= window_size[0]
        s = s.masked_fill(~allowed, float("-inf"))
        out[cu[i] : cu[i + 1]] = torch.einsum("htl,lhd->thd", s.softmax(-1), v)
    return out
