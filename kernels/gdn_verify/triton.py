"""Triton Gated DeltaNet verify kernel with lazy state commit (and its eager twin).

One program owns one (request, value head, V-tile): a ``[K, BV]`` slice of the state stays in
registers for the whole step.  Lazy mode reads the base state and the log of step n-1, replays the
accepted tokens, rounds once to the state dtype (the eager path's store point), writes the base back
when it changed, runs the T new tokens for their outputs, and writes the new log; per layer and
request that is 1 state read + <= 1 state write instead of vLLM's 1 read + T writes.

The log holds, per token, what its state update consumed (log_layout.py): raw k, the delta vector
u (fp32, [HV, V]) and the decay (fp32).  A new token computes u from the state (gates, key norm,
k.h reduction) and applies ``h = h * decay + k (x) u``; its replay in the next step starts from the
same base in the same fp32 registers, so it would recompute bit-for-bit the same u: it reads u and
the decay back and applies only the rank-1 update, with the same explicit FMAs (``_rank1``).  That
keeps lazy == eager bit-identical and makes a replayed token about half a new token's work.

All token loops are unrolled (T and the log capacity TL are constexpr) and the replay is
predicated in groups of RG tokens, so the loads of a group sit in one straight-line block that the
compiler hoists: the global-load latency is paid once per group, not once per token (vLLM's and
fla's loops pay it per token); new tokens' inputs are prefetched PF tokens ahead.  Tiling knobs and
their measured defaults: ``_default_config``.

The log is double buffered, ``log[slot, parity]``: step n reads half ``parity`` and writes half
``1 - parity`` because the programs of one request share its k, decay and rk entries.  The caller flips the
one-element device tensor ``log_parity`` once per engine step (after all layers), so the launch
stays CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gdn_verify.log_layout import log_layout, log_view_f32


def _default_config(batch: int, state_dtype: torch.dtype, state_vk: bool = False) -> tuple[int, ...]:
    """(BV, num_warps, VEC, PF, RG, KCVT) from the H200 sweeps (NOTES.md,
    ``python -m kernels.gdn_verify.diag --sweep``).

    BV: V columns per program (one warp); VEC: state vector width along V, which fixes the lane
    split of the [K, BV] tile; PF: new tokens prefetched ahead (<= 4); RG: replay tokens per
    predicated group.  KCVT switches
    one of three edits suspected of the fp32 B=1/4 regression against da5db45 (bisected by the
    sweep; it changes no result bit): KCVT=1 converts a replayed k to fp32 right at its load, so
    its layout change (a shared-memory round trip with a barrier) waits for that load before the
    token's u/decay loads issue; KCVT=0 converts it at its first use, as da5db45
    did.  The other two suspects need no switch; compiled with triton 3.6 for sm_90 they give
    the same SASS either way: the VEC cap also on the v loads and output/log stores (fp32 and bf16
    states, BV 8 and 16), and the PF-deep prefetch queue at PF=2 vs da5db45's two-deep one (so
    PF is the variable).
    Both defaults split the tile over [8 K-lanes x 4 V-lanes] ((8, 1, 2): 2 V values per thread,
    (16, 1, 4): 4), so K reductions run in the same order and a request's results do not depend
    on the batch size it ran in (bit-identical across the two tilings, tested on the GPU).
    """
    # From the 2847685 sweep (rank-1 replay; NOTES.md, same-row repeats within 1%): fp32 takes
    # the 16-wide tile from batch 4 (B=4 28.0 -> 26.9 µs) and RG 8 below (B=1 12.7 -> 12.6, B=4
    # with BV 8 27.4); bf16 at batch >= 4 the 16-wide tile with PF 2 (B=8 39.5 -> 36.5; B=4 one
    # 20.1 cell to re-time, 16/1/4/4 25.7 vs 26.8).  fp16 was not swept: unchanged.  KCVT/PF/RG
    # move no result bit, so every batch still rounds like the [8 K x 4 V] family.
    if state_vk:
        return (8, 1, 4, 2, 4, 1)
    if state_dtype == torch.float32:
        return (16, 1, 4, 4, 8, 0) if batch >= 4 else (8, 1, 2, 2, 8, 0)
    if state_dtype == torch.bfloat16:
        return (16, 1, 4, 2, 8, 0) if batch >= 4 else (8, 1, 2, 4, 8, 0)
    if batch >= 8:
        return (16, 1, 4, 4, 8, 1)
    return (8, 1, 2, 4, 8, 1)


def _resolve_config(config, batch, state_dtype, state_vk) -> tuple[int, ...]:
    """A partial config (BV, num_warps[, VEC[, PF[, RG[, KCVT]]]]) filled from the default."""
    full = _default_config(batch, state_dtype, state_vk)
    if config is None:
        return full  # type: ignore[return-value]
    cfg = tuple(config) + full[len(config):]
    if len(cfg) != 6 or not 1 <= cfg[3] <= 4 or cfg[4] < 1:
        raise ValueError(f"config {cfg}: need 6 entries (BV, num_warps, VEC, PF, RG, KCVT), 1 <= PF <= 4 and RG >= 1")
    return cfg  # type: ignore[return-value]


@triton.jit
def _gates(a_raw, b_raw, neg_exp_A, dt):
    x = a_raw.to(tl.float32) + dt
    sp = tl.where(x <= 20.0, tl.log(1 + tl.exp(x)), x)
    decay = tl.exp(neg_exp_A * sp)
    beta = tl.sigmoid(b_raw.to(tl.float32))
    return decay, beta


@triton.jit
def _and(m, c):
    """Tensor mask m and scalar condition c (``m & c`` trips the triton 3.9 interpreter)."""
    return tl.where(c, m, False)


@triton.jit
def _rnorm(x):
    """1 / ||x|| as the reference's l2norm uses it (eps inside the sqrt); x: [BK] fp32."""
    return tl.rsqrt(tl.sum(x * x) + 1e-6)


@triton.jit
def _delta_u(b_h, b_k, rk, b_v, decay, beta):
    """The token's delta vector u: [BV] fp32.  b_h: [BK, BV] fp32 state tile before the token;
    b_k: [BK] raw key (fp32) and rk its 1/norm; b_v: [BV]; decay, beta: scalars.  The norm and
    the decay are folded into scalars ([BV] work only, the k.h reduction does not wait for the
    decay multiply): u = (v - (k.h) * decay * rk) * beta * rk, to be applied to the raw k (the
    reference's order, u = (v - kn.(h * decay)) * beta applied to kn = k * rk, was slower in every
    cell of eb659a6's sweep: B=8 fp32 55.9 vs 50.7 µs, B=4 37.5 vs 34.8; removed in issue 22)."""
    b_kh = tl.sum(b_h * b_k[:, None], 0)
    # v - kh * (decay * rk) as one explicit FMA (ptxas would contract it anyway; pinned so
    # that the lazy and eager kernels cannot round it differently)
    return tl.fma(b_kh, -(decay * rk), b_v) * (beta * rk)


@triton.jit
def _rank1(b_h, b_k, b_u, decay):
    """h * decay + k (x) u with the rounding pinned by explicit FMAs: a new token and its replay
    (u and decay read back from the log) run exactly these operations on the same fp32 values,
    which is what keeps lazy and eager states bit-identical."""
    return tl.fma(b_h, decay, b_k[:, None] * b_u[None, :])


@triton.jit
def _out(b_h, b_q, rq):
    """o = sum_k h[k, :] * q_n[k], q_n = q * rq (rq includes the query scale)."""
    return tl.sum(b_h * b_q[:, None], 0) * rq


@triton.jit
def _load_token(q, k, v, a, b, i_b, t, i_h, i_hv, o_k, o_v, m_k, m_v,
                s_qk_b, s_qk_t, s_v_b, s_v_t, s_ab_b, s_ab_t, K: tl.constexpr, V: tl.constexpr):
    """Raw q, k ([BK]), v ([BV]), a, b (scalars) of token t."""
    p_qk = i_b * s_qk_b + t * s_qk_t + i_h * K + o_k
    r_q = tl.load(q + p_qk, mask=m_k, other=0)
    r_k = tl.load(k + p_qk, mask=m_k, other=0)
    r_v = tl.load(v + i_b * s_v_b + t * s_v_t + i_hv * V + o_v, mask=m_v, other=0)
    r_a = tl.load(a + i_b * s_ab_b + t * s_ab_t + i_hv)
    r_b = tl.load(b + i_b * s_ab_b + t * s_ab_t + i_hv)
    return r_q, r_k, r_v, r_a, r_b


@triton.jit
def gdn_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, o,
    state, init_idx, tok_idx, log, logf, log_parity, num_replay,
    scale,
    s_qk_b, s_qk_t, s_v_b, s_v_t, s_ab_b, s_ab_t, s_state,
    T: tl.constexpr, TL: tl.constexpr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    LAZY: tl.constexpr, STATE_VK: tl.constexpr,
    VEC: tl.constexpr, PF: tl.constexpr, RG: tl.constexpr, KCVT: tl.constexpr,
    LR: tl.constexpr, LRW: tl.constexpr, OFF_U: tl.constexpr, OFF_D: tl.constexpr, OFF_RK: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    slot = tl.load(init_idx + i_b).to(tl.int64)
    if slot < 0:
        return

    o_k = tl.arange(0, BK)
    # VEC caps the contiguity the compiler sees along V, and with it the state load's vector
    # width, which fixes the tile's lane split: 16-byte loads give fp32 [16 K-lanes x 2 V-lanes]
    # but bf16/fp16 [32 x 1] (8 V values per thread: 5 shuffle rounds x 8 values per K reduction,
    # 2.1x the shuffles of fp32 -- why 2-byte states ran slower).  VEC=4 gives every dtype [16 x 2].
    o_v = tl.max_contiguous(i_v * BV + tl.arange(0, BV), VEC)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    neg_exp_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    dt = tl.load(dt_bias + i_hv).to(tl.float32)

    # The tile is [BK, BV] either way; with V contiguous ([K, V], the default) the K reductions
    # stay mostly inside each thread, with K contiguous (vLLM's [V, K]) they cross 32 lanes.
    if STATE_VK:
        o_s = i_hv * K * V + o_v[None, :] * K + o_k[:, None]
    else:
        o_s = i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    p_h = state + slot * s_state + o_s
    b_h = tl.load(p_h, mask=m_h, other=0).to(tl.float32)

    # Inputs of the first PF new tokens are loaded now, under the state load and the replay, and
    # each later token's PF steps ahead (ptxas does not hoist loads across the unrolled tokens).
    # PF >= T issues every new token's loads up front: no global load left in the token chain.
    if T > 0:
        q0, k0, v0, a0, b0 = _load_token(q, k, v, a, b, i_b, 0, i_h, i_hv, o_k, o_v, m_k, m_v,
                                         s_qk_b, s_qk_t, s_v_b, s_v_t, s_ab_b, s_ab_t, K, V)
    if T > 1 and PF > 1:
        q1, k1, v1, a1, b1 = _load_token(q, k, v, a, b, i_b, 1, i_h, i_hv, o_k, o_v, m_k, m_v,
                                         s_qk_b, s_qk_t, s_v_b, s_v_t, s_ab_b, s_ab_t, K, V)
    if T > 2 and PF > 2:
        q2, k2, v2, a2, b2 = _load_token(q, k, v, a, b, i_b, 2, i_h, i_hv, o_k, o_v, m_k, m_v,
                                         s_qk_b, s_qk_t, s_v_b, s_v_t, s_ab_b, s_ab_t, K, V)
    if T > 3 and PF > 3:
        q3, k3, v3, a3, b3 = _load_token(q, k, v, a, b, i_b, 3, i_h, i_hv, o_k, o_v, m_k, m_v,
                                         s_qk_b, s_qk_t, s_v_b, s_v_t, s_ab_b, s_ab_t, K, V)

    # Log rows (log_layout.py): raw k in the log's dtype through `log` (LR elements per row), then
    # u, decay and rk in fp32 through `logf`, the same storage in fp32 words (LRW per row).
    if LAZY:
        par = tl.load(log_parity).to(tl.int64)
        p_lin = log + (slot * 2 + par) * TL * LR
        p_lout = log + (slot * 2 + 1 - par) * TL * LR
        pf_lin = logf + (slot * 2 + par) * TL * LRW
        pf_lout = logf + (slot * 2 + 1 - par) * TL * LRW
        r = tl.load(num_replay + i_b)
        # Replay predicated in groups of RG tokens: a group's loads sit in one straight-line block
        # that the compiler hoists (latency paid once per group), at most RG - 1 wasted steps.
        # A replayed token is a pure rank-1 update from its logged k, u and decay: no gates, no
        # k.h reduction, no key norm (u carries it).
        for g in tl.static_range(0, TL, RG):
            if r > g:
                for j in tl.static_range(RG):
                    if g + j < TL:
                        m_i = g + j < r
                        p_row = p_lin + (g + j) * LR
                        pf_row = pf_lin + (g + j) * LRW
                        l_k = tl.load(p_row + i_h * K + o_k, mask=_and(m_k, m_i), other=0)
                        if KCVT:  # the conversion (and its layout change) sits right at the load
                            l_k = l_k.to(tl.float32)
                        l_u = tl.load(pf_row + OFF_U + i_hv * V + o_v, mask=_and(m_v, m_i), other=0)
                        l_d = tl.load(pf_row + OFF_D + i_hv, mask=m_i, other=0)
                        # KCVT=0: converted only here, after this token's other loads were issued
                        b_hn = _rank1(b_h, l_k.to(tl.float32), l_u, l_d)
                        b_h = tl.where(m_i, b_hn, b_h)
        # The eager path rounds here (its stored state of the last accepted token); idempotent
        # when nothing was replayed.
        b_h = b_h.to(state.dtype.element_ty).to(tl.float32)
        tl.store(p_h, b_h.to(state.dtype.element_ty), mask=_and(m_h, r > 0))
        # k rows are shared by HV // H value heads and all V tiles: one program writes each.
        m_wk = _and(m_k, (i_v == 0) & (i_hv % (HV // H) == 0))
        m_wab = i_v == 0
        m_wrk = (i_v == 0) & (i_hv % (HV // H) == 0)

    for t in tl.static_range(T):
        # rotate the prefetch queue (depth PF <= 4) and load token t + PF into its tail
        r_q, r_k, r_v, r_a, r_b = q0, k0, v0, a0, b0
        if PF > 1 and t + 1 < T:
            q0, k0, v0, a0, b0 = q1, k1, v1, a1, b1
        if PF > 2 and t + 2 < T:
            q1, k1, v1, a1, b1 = q2, k2, v2, a2, b2
        if PF > 3 and t + 3 < T:
            q2, k2, v2, a2, b2 = q3, k3, v3, a3, b3
        if t + PF < T:
            nq, nk, nv, na, nb = _load_token(q, k, v, a, b, i_b, t + PF, i_h, i_hv, o_k, o_v, m_k, m_v,
                                             s_qk_b, s_qk_t, s_v_b, s_v_t, s_ab_b, s_ab_t, K, V)
            if PF == 1:
                q0, k0, v0, a0, b0 = nq, nk, nv, na, nb
            elif PF == 2:
                q1, k1, v1, a1, b1 = nq, nk, nv, na, nb
            elif PF == 3:
                q2, k2, v2, a2, b2 = nq, nk, nv, na, nb
            else:
                q3, k3, v3, a3, b3 = nq, nk, nv, na, nb
        f_q = r_q.to(tl.float32)
        f_k = r_k.to(tl.float32)
        decay, beta = _gates(r_a, r_b, neg_exp_A, dt)
        rk = _rnorm(f_k)
        b_u = _delta_u(b_h, f_k, rk, r_v.to(tl.float32), decay, beta)
        b_h = _rank1(b_h, f_k, b_u, decay)
        b_o = _out(b_h, f_q, _rnorm(f_q) * scale)
        tl.store(o + ((i_b * T + t) * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if LAZY:
            # what the replay of this token needs, exactly as used above (k converts exactly:
            # the log is in k's dtype or fp32)
            tl.store(p_lout + t * LR + i_h * K + o_k, r_k.to(log.dtype.element_ty), mask=m_wk)
            pf_row = pf_lout + t * LRW
            tl.store(pf_row + OFF_U + i_hv * V + o_v, b_u, mask=m_v)
            tl.store(pf_row + OFF_D + i_hv, decay, mask=m_wab)
            # 1/||k||: this kernel's replay does not read it (u carries it); the log row keeps the
            # layout the torch reference writes and reads (reference.TorchGdnKernels)
            tl.store(pf_row + OFF_RK + i_h, rk, mask=m_wrk)
        else:
            i_s = tl.load(tok_idx + i_b * T + t).to(tl.int64)
            tl.store(state + i_s * s_state + o_s, b_h.to(state.dtype.element_ty), mask=_and(m_h, i_s >= 0))


def _row_strides(x: torch.Tensor, name: str, inner: int) -> tuple[int, int]:
    """Batch and token strides of x: [B, T, heads, (dim)] whose (heads, dim) block is dense."""
    if x.stride()[2:] != torch.empty(x.shape[2:], device="meta").stride() or (
        inner > 1 and x.stride(-1) != 1
    ):
        raise ValueError(f"{name}: heads/last dims must be dense, got strides {x.stride()}")
    return x.stride(0), x.stride(1)


def _dense(x: torch.Tensor, name: str, inner: int) -> tuple[torch.Tensor, int, int]:
    try:
        return (x, *_row_strides(x, name, inner))
    except ValueError:
        x = x.contiguous()
        return (x, *_row_strides(x, name, inner))


def gdn_verify_fwd(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    init_idx: torch.Tensor,
    *,
    num_k_heads: int,
    tok_idx: torch.Tensor | None = None,
    log: torch.Tensor | None = None,
    log_parity: torch.Tensor | None = None,
    num_replay: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    state_vk: bool = False,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor | None:
    """Launcher shared by the lazy, eager and commit-only entry points (see __init__)."""
    lazy = log is not None
    if state_vk:
        _, HV, V, K = state.shape
    else:
        _, HV, K, V = state.shape
    H = num_k_heads
    B = init_idx.shape[0]
    T = 0 if q is None else q.shape[1]
    if HV % H:
        raise ValueError(f"value heads {HV} not a multiple of key heads {H}")
    if state.stride()[1:] != (V * K, state.shape[3], 1):
        raise ValueError(f"state must be dense per slot, shape {tuple(state.shape)} strides {state.stride()}")
    if lazy:
        TL = log.shape[2]
        lay = log_layout(H, K, HV, V, log.dtype)
        if log.shape[1] != 2 or log.shape[3] != lay.row or not log.is_contiguous():
            raise ValueError(f"log must be a contiguous [slots, 2, TL, {lay.row}] (gdn_log_empty), got {tuple(log.shape)}")
        if T > TL:
            raise ValueError(f"T={T} tokens do not fit a log of {TL} tokens")
        logf = log_view_f32(log)
        lay_kw = dict(LR=lay.row, LRW=lay.row_words, OFF_U=lay.u, OFF_D=lay.decay, OFF_RK=lay.rk)
    else:
        TL = 1
        logf = state
        lay_kw = dict(LR=0, LRW=0, OFF_U=0, OFF_D=0, OFF_RK=0)
    if q is None:
        dummy = torch.empty(0, device=state.device, dtype=log.dtype if lazy else state.dtype)
        q = k = v = a = b = dummy
        sqk = sv = sab = (0, 0)
        o = dummy
    else:
        if q.shape != k.shape or q.shape[2:] != (H, K) or v.shape[:2] != q.shape[:2] or v.shape[2:] != (HV, V):
            raise ValueError(f"q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} vs state {tuple(state.shape)}")
        if a.shape != (B, T, HV) or b.shape != (B, T, HV):
            raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)} must be [{B}, {T}, {HV}]")
        if lazy and log.dtype not in (k.dtype, torch.float32):
            # the replay must see k exactly as the step did
            raise ValueError(f"a {log.dtype} log cannot hold k of {k.dtype} exactly: use a {k.dtype} or fp32 log")
        if q.stride() != k.stride():
            q, k = q.contiguous(), k.contiguous()
        q, *sqk = _dense(q, "q", K)
        k, *_ = _dense(k, "k", K)
        v, *sv = _dense(v, "v", V)
        a, *sab = _dense(a, "a", 1)
        if b.stride() != a.stride():
            a, b = a.contiguous(), b.contiguous()
            a, *sab = _dense(a, "a", 1)
        o = out if out is not None else torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    BV, num_warps, vec, pf, rg, kcvt = _resolve_config(config, B, state.dtype, state_vk)
    BV = min(BV, triton.next_power_of_2(V))
    grid = (triton.cdiv(V, BV), B * HV)
    gdn_verify_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, o,
        state, init_idx, tok_idx if tok_idx is not None else init_idx,
        log if lazy else state, logf, log_parity if lazy else init_idx,
        num_replay if lazy else init_idx,
        K**-0.5 if scale is None else scale,
        sqk[0], sqk[1], sv[0], sv[1], sab[0], sab[1], state.stride(0),
        T=T, TL=TL, H=H, HV=HV, K=K, V=V,
        BK=triton.next_power_of_2(K), BV=BV, LAZY=lazy, STATE_VK=state_vk,
        VEC=min(vec, BV), PF=pf, RG=rg, KCVT=bool(kcvt), **lay_kw,
        num_warps=num_warps, num_stages=1,
    )
    return o if T else None
