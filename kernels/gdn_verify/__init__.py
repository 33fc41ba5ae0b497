"""Gated DeltaNet spec-decode verify with lazy state commit.

Shape legend: B requests, T verify tokens this step (<= TL), TL log capacity in tokens, H key heads,
HV value heads (multiple of H), K key dim, V value dim, S state-pool slots.
State layout ``[S, HV, K, V]`` (V contiguous, fla's default); ``state_vk=True`` reads and writes
vLLM 0.32.0's pool layout ``[S, HV, V, K]`` instead (K-reductions then cross all 32 lanes: slower).
"""

from __future__ import annotations

import torch

from kernels.gdn_verify.log_layout import log_layout, log_view_f32
from kernels.gdn_verify.reference import (
    naive_recurrent_gdn_verify_eager,
    naive_recurrent_gdn_verify_lazy,
)
from kernels.gdn_verify.triton import gdn_verify_fwd

__all__ = [
    "fused_recurrent_gdn_commit",
    "fused_recurrent_gdn_verify",
    "fused_recurrent_gdn_verify_eager",
    "gdn_log_empty",
    "log_layout",
    "log_view_f32",
    "naive_recurrent_gdn_verify_eager",
    "naive_recurrent_gdn_verify_lazy",
]


def gdn_log_empty(
    num_slots: int,
    max_tokens: int,
    num_k_heads: int,
    k_dim: int,
    num_v_heads: int,
    v_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Allocate a token log: [S, 2, TL, row] of ``dtype``, the dtype of the k it stores exactly
    (the inputs' k dtype, or fp32 for any k).

    Row per token (kernels/gdn_verify/log_layout.py): raw k (H*K, in ``dtype``) | u (HV*V) |
    decay (HV) | rk (H), the last three fp32 (read through ``log.view(torch.float32)``), each
    section 16-byte aligned.  Half ``p`` of slot s is read by a step whose ``log_parity`` is p;
    that step writes half 1 - p.  Contents need no init: a slot's first step must use
    num_replay = 0.

    Bytes per slot and layer: 2 * TL * row_bytes, row_bytes = 2*H*K + 4*(HV*V + HV + H) for a
    16-bit ``dtype`` (rounded up to 16).  Qwen3.5 GDN (H=16, K=128, HV=48, V=128), bf16 k:
    28,928 B per token, TL=8: 452 KiB per slot and layer, 21.2 MiB per slot over 48 layers
    (the raw k|v|a|b log of 86a6d8f took 16,576 B per token: 12.1 MiB per slot; an fp32 k
    adds 4 KiB per token).
    """
    lay = log_layout(num_k_heads, k_dim, num_v_heads, v_dim, dtype)
    return torch.empty(num_slots, 2, max_tokens, lay.row, dtype=dtype, device=device)


def fused_recurrent_gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    log: torch.Tensor,
    log_parity: torch.Tensor,
    num_replay: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    state_vk: bool = False,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Lazy-commit verify step of the gated delta rule (Qwen3-Next / Qwen3.5 GDN layers).

    Per request: fold the first ``num_replay`` tokens of the previous step's log into the base
    state (rounded once to the state dtype, exactly where vLLM's eager path stores its per-token
    state), write that base back, run the T new tokens for their outputs and log them.  States are
    bit-identical to :func:`fused_recurrent_gdn_verify_eager` resumed at the same token.

    Args:
        q, k: [B, T, H, K] (any float dtype; last two dims dense, batch/token strides free).
        v: [B, T, HV, V]; a, b: [B, T, HV] raw gate inputs (g = -exp(A_log)·softplus(a + dt_bias),
            beta = sigmoid(b)); any float dtypes, k's must be the log's (or the log fp32).
        A_log, dt_bias: [HV].
        state: [S, HV, K, V] fp32/bf16/fp16 base states, updated in place ([S, HV, V, K] with
            ``state_vk=True``).
        state_indices: [B] int32/int64 slot per request; a negative slot skips the request (its
            outputs are left unwritten).
        log: [S, 2, TL, row] from :func:`gdn_log_empty`, T <= TL; it holds each token's
            raw k, delta vector u and decay, so a replayed token is a rank-1 update only.
        log_parity: [1] int32 device tensor; flip it (``log_parity ^= 1``) once per engine step,
            after the last layer.
        num_replay: [B] int32 tokens of the previous step to commit, in [0, T_prev]; in vLLM terms
            ``num_accepted_tokens`` (accepted drafts + 1); 0 for a slot's first step.
        scale: query scale, default K ** -0.5.
        out: optional [B, T, HV, V] contiguous output.
        state_vk: state stored [S, HV, V, K] (vLLM 0.32.0's pool layout).
        config: kernel tiling ``(BV, num_warps[, VEC[, PF[, RG[, KCVT]]]]])``
            (a prefix, filled from triton._default_config);
            the default depends on batch and state dtype.  Bit-identity with the eager and
            commit calls holds for the same config only.

    Returns:
        o: [B, T, HV, V] in q.dtype (or ``out``).
    """
    return gdn_verify_fwd(
        q, k, v, a, b, A_log, dt_bias, state, state_indices, num_k_heads=k.shape[2],
        log=log, log_parity=log_parity, num_replay=num_replay, scale=scale, out=out,
        state_vk=state_vk, config=config,
    )


def fused_recurrent_gdn_commit(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    log: torch.Tensor,
    log_parity: torch.Tensor,
    num_replay: torch.Tensor,
    num_k_heads: int,
    state_vk: bool = False,
    config: tuple[int, ...] | None = None,
) -> None:
    """Materialise the lazy state: fold ``num_replay[b]`` logged tokens into ``state`` in place.

    Use before anything that reads the pool as plain states (prefill, prefix-cache copies, a
    non-spec decode step).  The next verify step of these slots must pass num_replay = 0.
    Shapes as in :func:`fused_recurrent_gdn_verify`; num_k_heads is H.
    """
    gdn_verify_fwd(
        None, None, None, None, None, A_log, dt_bias, state, state_indices,
        num_k_heads=num_k_heads, log=log, log_parity=log_parity, num_replay=num_replay,
        state_vk=state_vk, config=config,
    )


def fused_recurrent_gdn_verify_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    init_indices: torch.Tensor,
    token_indices: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    state_vk: bool = False,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Eager verify (vLLM's storing scheme, same arithmetic as the lazy kernel).

    Reads state[init_indices[b]] and writes the state after token t to state[token_indices[b, t]]
    (negative index: not stored).  init_indices: [B]; token_indices: [B, T] contiguous; other
    shapes as in :func:`fused_recurrent_gdn_verify`.  vLLM's ``init = indices[b, accepted - 1]``.

    Returns:
        o: [B, T, HV, V] in q.dtype.
    """
    if token_indices.shape != q.shape[:2] or not token_indices.is_contiguous():
        raise ValueError(f"token_indices must be a contiguous {tuple(q.shape[:2])}, got {tuple(token_indices.shape)}")
    return gdn_verify_fwd(
        q, k, v, a, b, A_log, dt_bias, state, init_indices, num_k_heads=k.shape[2],
        tok_idx=token_indices, scale=scale, out=out, state_vk=state_vk, config=config,
    )
