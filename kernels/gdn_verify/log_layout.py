"""Row layout of the GDN verify token log (shared by the Triton kernel and the torch reference).

One row per logged token, ``log[slot, half, t]``; the tensor's dtype is the dtype its key section
stores (the inputs' k dtype, or fp32), the rest of the row is fp32 read through
``log.view(torch.float32)``:

    k      [H, K]   raw key, exactly as the step received it (log dtype)      elements [0, H*K)
    (pad to 16 bytes)
    u      [HV, V]  the token's delta vector, fp32, exactly as the step computed it
    decay  [HV]     exp(g), fp32
    rk     [H]      1 / ||k|| (the l2norm's factor), fp32 (the torch reference's replay uses it)
    (pad to 16 bytes)

A replayed token is then a pure rank-1 update ``h = h * decay + k (x) u`` (the Triton kernel: u
carries the key norm; the torch reference: ``h = h * decay + (k * rk) (x) u``), the same operations
on the same fp32 values as when the token ran as a new token, so lazy and eager states stay
bit-identical without recomputing gates or the k.h reduction.

Its own module (not reference.py or triton.py): the layout is product code that both the Triton
launcher and the torch reference (the engine plugin's CPU path) import, and gdn_log_empty sizes
the engine's log from it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class LogLayout(NamedTuple):
    """Offsets of one log row.  ``row``: row length in log elements; ``row_words``: the same in
    fp32 words; ``u``, ``decay``, ``rk``: offsets in fp32 words; the key section starts at 0."""

    row: int
    row_words: int
    u: int
    decay: int
    rk: int

    @property
    def row_bytes(self) -> int:
        return self.row_words * 4


LOG_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def log_layout(num_k_heads: int, k_dim: int, num_v_heads: int, v_dim: int, dtype: torch.dtype) -> LogLayout:
    if dtype not in LOG_DTYPES:
        raise ValueError(f"log dtype {dtype}: need one of {LOG_DTYPES}")
    per_word = 4 // dtype.itemsize  # log elements per fp32 word (1 or 2)
    k_words = _round_up(num_k_heads * k_dim, 4 * per_word) // per_word
    u = k_words
    decay = u + num_v_heads * v_dim
    rk = decay + num_v_heads
    row_words = _round_up(rk + num_k_heads, 4)
    return LogLayout(row=row_words * per_word, row_words=row_words, u=u, decay=decay, rk=rk)


def log_view_f32(log: torch.Tensor) -> torch.Tensor:
    """The log's fp32 words: [S, 2, TL, row_words] (the same storage)."""
    return log if log.dtype == torch.float32 else log.view(torch.float32)
