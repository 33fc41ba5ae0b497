"""Symmetric int8, group-128 weight quantization in compressed-tensors' `pack-quantized` layout.

What vLLM 0.32 reads for a WNA16 layer (CompressedTensorsWNA16 / CompressedTensorsEmbeddingWNA16Int):
  weight_packed  int32 [rows, cols / 4]   four int8 codes per int32, code c stored as c + 128 in bits
                                          8i..8i+7 of word i // 4 (compressed_tensors.pack_to_int32)
  weight_scale   model dtype [rows, cols / group]
  weight_shape   int64 [2] = (rows, cols)
and the dequantized weight is code × scale of its (row, group). No zero point (symmetric).

The scale of a group is amax / 127 rounded *up* to the stored dtype (bf16 keeps 8 mantissa bits): codes
then stay within ±127 with no clipping, and the error we measure is the error the engine sees, since
vLLM casts the scales to the model dtype at load.

Error: ‖W − Ŵ‖_F / ‖W‖_F over the whole tensor, accumulated chunk by chunk, with Ŵ = code × scale
rounded to the model dtype, as the engine computes with it (the seeds measured 0.64% for lm_head and
0.56% for embed_tokens of the 27B). A tensor at or above the bound is refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NUM_BITS = 8
PACK_FACTOR = 32 // NUM_BITS
GROUP_SIZE = 128
QMAX = 127
MAX_REL_ERROR = 0.01  # the bound: refuse at 1% or more


class QuantizationRefused(ValueError):
    """A tensor cannot be quantized within the bound (or at all); the message says which and why."""


def can_group(shape: tuple[int, ...], group_size: int = GROUP_SIZE) -> str | None:
    """None if a [rows, cols] weight quantizes with this group size, else why not."""
    if len(shape) != 2:
        return f"not a matrix (shape {list(shape)})"
    if shape[1] % group_size:
        return f"input dim {shape[1]} is not a multiple of group {group_size}"
    return None


def _round_up_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest value of `dtype` >= x (x > 0), as float32."""
    y = x.to(dtype)
    low = y.float() < x
    if low.any():
        y = torch.where(low, torch.nextafter(y, torch.full_like(y, math.inf)), y)
    return y.float()


def quantize_rows(w: torch.Tensor, scale_dtype: torch.dtype, group_size: int = GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [R, C] (any float dtype) -> (codes int8 [R, C] in [-127, 127], scales [R, C/group] scale_dtype).

    In place where it can: a chunk's temporaries are about two fp32 copies of it."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group_size, group_size)  # g: [R, G, group]
    amax = g.abs().amax(dim=-1)  # amax: [R, G]
    # An all-zero group gets the smallest positive scale: its codes are 0 and it dequantizes exactly.
    tiny = torch.finfo(scale_dtype).tiny
    scale = _round_up_to(torch.clamp(amax / QMAX, min=tiny), scale_dtype)  # scale: [R, G] fp32
    codes = g.div_(scale[..., None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return codes.reshape(rows, cols), scale.to(scale_dtype)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes int8 [R, C] -> int32 [R, C/4] with compressed-tensors' own packer (the format's reference)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    return pack_to_int32(codes, NUM_BITS, packed_dim=1)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/4] -> int8 codes [R, C]: byte i of a word is code 4w + i, stored as code + 128."""
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int32) * NUM_BITS
    b = (packed.unsqueeze(-1) >> shifts).bitwise_and_(0xFF)  # b: [R, C/4, 4] int32
    return b.sub_(1 << (NUM_BITS - 1)).to(torch.int8).reshape(packed.shape[0], -1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """codes int8 [R, C], scale [R, C/group] -> fp32 [R, C]."""
    rows, cols = codes.shape
    g = codes.float().reshape(rows, cols // group_size, group_size)
    return g.mul_(scale.float()[..., None]).reshape(rows, cols)


@dataclass
class ErrorStats:
    """Accumulates ‖W − Ŵ‖² and ‖W‖² over row chunks of one tensor."""

    err_sq: float = 0.0
    ref_sq: float = 0.0
    max_abs_err: float = 0.0
    max_abs: float = 0.0
    rows: int = 0

    def add(self, w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
        w = w.float().flatten()
        # Ŵ as the engine holds it: code × scale rounded to the model dtype (the scale's), which is what
        # the int8 embedding gather returns and what Marlin dequantizes to before its MMA
        w_hat = dequantize(codes, scale, group_size).to(scale.dtype).float().flatten()
        d = w_hat.sub_(w)  # d: Ŵ − W, fp32
        self.err_sq += float(torch.linalg.vector_norm(d, dtype=torch.float64)) ** 2  # sums in fp64
        self.ref_sq += float(torch.linalg.vector_norm(w, dtype=torch.float64)) ** 2
        self.max_abs_err = max(self.max_abs_err, float(d.abs_().max()))
        self.max_abs = max(self.max_abs, float(w.abs_().max()))
        self.rows += codes.shape[0]

    @property
    def rel_error(self) -> float:
        if self.ref_sq == 0.0:
            return 0.0 if self.err_sq == 0.0 else math.inf
        return math.sqrt(self.err_sq / self.ref_sq)

    def as_dict(self) -> dict:
        return {"rel_error": self.rel_error, "max_abs_error": self.max_abs_err, "max_abs": self.max_abs}


def quantize_chunk(w: torch.Tensor, scale_dtype: torch.dtype, stats: ErrorStats,
                   group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """One row chunk: (packed int32 [r, C/4], scales [r, C/group]); its error goes into `stats`.

    The packed words are decoded again and must give back the codes, so a packing mistake stops the
    run instead of shipping; the error is then that of the codes and scales as stored."""
    codes, scale = quantize_rows(w, scale_dtype, group_size)
    packed = pack(codes)
    if not torch.equal(unpack(packed), codes):
        raise QuantizationRefused("int32 packing did not decode to its int8 codes")
    stats.add(w, codes, scale, group_size)
    return packed, scale
