"""Plain-torch fp32 specification of the Gated DeltaNet spec-decode verify step.

The Qwen3-Next / Qwen3.5 gated delta rule, one token at a time (all math in fp32):

    g    = -exp(A_log) * softplus(a + dt_bias)        (softplus threshold 20, as vLLM)
    beta = sigmoid(b)
    q    = q * rsqrt(sum(q^2) + 1e-6) * scale,  k = k * rsqrt(sum(k^2) + 1e-6)
    h    = h * exp(g)                                  h: [HV, K, V] per request
    u    = (v - k^T h) * beta
    h    = h + k u^T
    o    = q^T h

Layout: the state of one request is ``[HV, K, V]`` (V contiguous, fla's default).  vLLM 0.32.0's
pool stores ``[HV, V, K]``; the Triton kernel reads either.  Key head ``i_h`` serves value heads
``i_h * HV // H ... (i_h + 1) * HV // H - 1``.

Two ways to make a verify step resumable from any accepted token:

* eager (vLLM): store the state after every token, rounded to the state dtype; the next step
  starts from the stored state of its last accepted token.
* lazy: keep one base state plus a log of the step's raw ``k, v, a, b``; the next step first
  replays the accepted tokens of the log onto the base, rounds once to the state dtype (the
  same rounding point as the eager store), and then runs its own tokens.

Both give bit-identical states because they execute the same fp32 operations in the same order.
(The Triton kernel logs each token's delta vector u and decay instead of v, a, b -- log_layout.py
-- so its replay skips recomputing them; same math, bit-identical to its own eager path.)

``TorchGdnKernels`` is the kernel's contract (the lazy log of log_layout.py, parity halves, state
slots, both pool layouts) in this plain torch: the engine plugin's CPU path and the tests' twin.
"""

from __future__ import annotations

import torch

from kernels.gdn_verify.log_layout import log_layout, log_view_f32

SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay ``exp(g)`` and ``beta`` in fp32. a, b: [..., HV]; A_log, dt_bias: [HV]."""
    x = a.float() + dt_bias.float()
    sp = torch.where(x <= SOFTPLUS_THRESHOLD, torch.log(1 + torch.exp(x)), x)
    g = -torch.exp(A_log.float()) * sp
    return torch.exp(g), torch.sigmoid(b.float())


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[..., H, K] -> [..., HV, K] (grouped value heads share a key head)."""
    return x.repeat_interleave(hv // x.shape[-2], dim=-2)


def naive_gdn_step(
    h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """One delta-rule update. h: [HV, K, V] fp32; k: [HV, K] (normalised); v: [HV, V]; decay,
    beta: [HV]. Returns the new h."""
    h = h * decay[:, None, None]
    u = (v.float() - (h * k[:, :, None]).sum(-2)) * beta[:, None]
    return h + k[:, :, None] * u[:, None, :]


def naive_recurrent_gdn_verify_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    h0: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager verify (vLLM's per-token state storing).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; a, b: [B, T, HV]; A_log, dt_bias: [HV];
    h0: [B, HV, K, V] start states (any float dtype).
    Returns o: [B, T, HV, V] fp32 and states: [B, T, HV, K, V] in h0.dtype, states[:, t] being the
    state after token t, rounded to h0.dtype as a state pool stores it.
    """
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K**-0.5 if scale is None else scale
    decay, beta = gdn_gates(a, b, A_log, dt_bias)
    qn = _expand_heads(_l2norm(q) * scale, HV)
    kn = _expand_heads(_l2norm(k), HV)
    o = torch.empty(B, T, HV, v.shape[-1], dtype=torch.float32, device=q.device)
    states = torch.empty(B, T, *h0.shape[1:], dtype=h0.dtype, device=q.device)
    for i_b in range(B):
        h = h0[i_b].float()
        for t in range(T):
            h = naive_gdn_step(h, kn[i_b, t], v[i_b, t], decay[i_b, t], beta[i_b, t])
            o[i_b, t] = (h * qn[i_b, t][:, :, None]).sum(-2)
            states[i_b, t] = h.to(h0.dtype)
    return o, states


def naive_recurrent_gdn_verify_lazy(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    base: torch.Tensor,
    log: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    num_replay: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lazy verify: replay ``num_replay[b]`` logged tokens onto the base, round, run the step.

    base: [B, HV, K, V] (state dtype); log: the previous step's raw (k [B, TL, H, K],
    v [B, TL, HV, V], a [B, TL, HV], b [B, TL, HV]) or None; num_replay: [B] ints in [0, TL].
    Returns o: [B, T, HV, V] fp32 and the new base [B, HV, K, V] in base.dtype (the next step's
    log is simply this step's (k, v, a, b)).
    """
    HV = v.shape[2]
    new_base = base.clone()
    for i_b in range(base.shape[0]):
        r = int(num_replay[i_b])
        if r == 0:
            continue
        lk, lv, la, lb = (x[i_b, :r] for x in log)  # type: ignore[union-attr]
        decay, beta = gdn_gates(la, lb, A_log, dt_bias)
        kn = _expand_heads(_l2norm(lk), HV)
        h = base[i_b].float()
        for t in range(r):
            h = naive_gdn_step(h, kn[t], lv[t], decay[t], beta[t])
        new_base[i_b] = h.to(base.dtype)
    o, _ = naive_recurrent_gdn_verify_eager(q, k, v, a, b, A_log, dt_bias, new_base, scale)
    return o, new_base


class TorchGdnKernels:
    """The three `kernels.gdn_verify` entry points in plain torch (same contract: log layout,
    parity halves, num_replay, negative slots, [K, V] or [V, K] pools), one request and token at
    a time with the reference's fp32 step (`naive_gdn_step`'s order of operations).

    The engine plugin serves CPU engines with it (backend/plugin/gdn_layer.py): Triton's
    interpreter takes seconds per call at the real head size, far too slow to serve even the test
    model.  Like the kernel, a new token logs what its update used (raw k, u, decay and 1/||k||,
    `log_layout`) and a replayed token is only ``h * decay + (k * rk) (x) u``, the same torch ops
    on the same values, so lazy and eager are bit-identical to each other.  Not to the Triton
    kernel: other reduction order, and its u carries the key norm (it is applied to the raw k,
    triton._delta_u) where this u is applied to the normalised k, so the two must not share a log.
    """

    @staticmethod
    def _rnorm(x: torch.Tensor) -> torch.Tensor:
        """One token's [H, D] -> fp32 [H, 1] factor 1 / ||x|| (eps inside the sqrt)."""
        x = x.float()
        return torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    @staticmethod
    def _normed(x: torch.Tensor, r: torch.Tensor, hv: int) -> torch.Tensor:
        """[H, D] * [H, 1] -> fp32 [HV, D] (grouped value heads share a key head)."""
        x = x.float() * r
        return x.repeat_interleave(hv // x.shape[0], dim=0)

    @staticmethod
    def _rank1(h, kn, u, decay):
        """h * decay + kn (x) u: the update of a new token and of its replay (same ops, same
        shapes: CPU kernels round alike)."""
        return h * decay[:, None, None] + kn[:, :, None] * u[:, None, :]

    @classmethod
    def _token(cls, h, k_tok, v_tok, a_tok, b_tok, A_log, dt_bias):
        """One new token: (new h, u [HV, V], decay [HV], rk [H, 1]), the last three what its
        replay reads back from the log."""
        decay, beta = gdn_gates(a_tok, b_tok, A_log, dt_bias)
        rk = cls._rnorm(k_tok)
        kn = cls._normed(k_tok, rk, h.shape[0])
        hd = h * decay[:, None, None]
        u = (v_tok.float() - (hd * kn[:, :, None]).sum(-2)) * beta[:, None]
        return cls._rank1(h, kn, u, decay), u, decay, rk

    @classmethod
    def _out(cls, h, q_tok, scale: float | None):
        K = q_tok.shape[-1]
        qn = cls._normed(q_tok, cls._rnorm(q_tok), h.shape[0]) * (K**-0.5 if scale is None else scale)
        return (h * qn[:, :, None]).sum(-2)

    @staticmethod
    def _load(state, slot: int, state_vk: bool) -> torch.Tensor:
        h = state[slot].float()
        return h.transpose(-1, -2) if state_vk else h

    @staticmethod
    def _store(state, slot: int, h: torch.Tensor, state_vk: bool) -> None:
        state[slot] = (h.transpose(-1, -2) if state_vk else h).to(state.dtype)

    @classmethod
    def _replay(cls, h, log, slot: int, par: int, r: int, H: int):
        hv, K, V = h.shape
        lay = log_layout(H, K, hv, V, log.dtype)
        logf = log_view_f32(log)
        for t in range(r):
            words = logf[slot, par, t]
            kn = cls._normed(log[slot, par, t, : H * K].view(H, K), words[lay.rk : lay.rk + H].view(H, 1), hv)
            h = cls._rank1(h, kn, words[lay.u : lay.u + hv * V].view(hv, V), words[lay.decay : lay.decay + hv])
        return h

    @staticmethod
    def _write_log(log, slot: int, half: int, t: int, k_tok, u, decay, rk) -> None:
        H, K = k_tok.shape
        hv, V = u.shape
        lay = log_layout(H, K, hv, V, log.dtype)
        log[slot, half, t, : H * K] = k_tok.reshape(-1).to(log.dtype)  # exact: checked dtypes
        words = log_view_f32(log)[slot, half, t]
        words[lay.u : lay.u + hv * V] = u.reshape(-1)
        words[lay.decay : lay.decay + hv] = decay
        words[lay.rk : lay.rk + H] = rk.reshape(-1)

    @classmethod
    def fused_recurrent_gdn_verify(cls, q, k, v, a, b, A_log, dt_bias, state, state_indices, log,
                                   log_parity, num_replay, scale=None, out=None, state_vk=False):
        B, T, H, _ = q.shape
        hv = v.shape[2]
        if log.dtype not in (k.dtype, torch.float32):
            raise ValueError(f"a {log.dtype} log cannot hold k of {k.dtype} exactly: use a {k.dtype} or fp32 log")
        par = int(log_parity.item())
        o = out if out is not None else torch.empty(B, T, hv, v.shape[-1], dtype=q.dtype, device=q.device)
        for i in range(B):
            slot = int(state_indices[i])
            if slot < 0:
                continue
            h = cls._load(state, slot, state_vk)
            r = int(num_replay[i])
            if r:
                h = cls._replay(h, log, slot, par, r, H)
                h = h.to(state.dtype).float()
                cls._store(state, slot, h, state_vk)
            for t in range(T):
                h, u, decay, rk = cls._token(h, k[i, t], v[i, t], a[i, t], b[i, t], A_log, dt_bias)
                o[i, t] = cls._out(h, q[i, t], scale).to(o.dtype)
                cls._write_log(log, slot, 1 - par, t, k[i, t], u, decay, rk)
        return o

    @classmethod
    def fused_recurrent_gdn_commit(cls, A_log, dt_bias, state, state_indices, log, log_parity,
                                   num_replay, num_k_heads, state_vk=False):
        par = int(log_parity.item())
        for i in range(state_indices.shape[0]):
            slot, r = int(state_indices[i]), int(num_replay[i])
            if slot < 0 or r == 0:
                continue
            h = cls._replay(cls._load(state, slot, state_vk), log, slot, par, r, num_k_heads)
            cls._store(state, slot, h, state_vk)

    @classmethod
    def fused_recurrent_gdn_verify_eager(cls, q, k, v, a, b, A_log, dt_bias, state, init_indices,
                                         token_indices, scale=None, out=None, state_vk=False):
        B, T, _, _ = q.shape
        hv = v.shape[2]
        o = out if out is not None else torch.empty(B, T, hv, v.shape[-1], dtype=q.dtype, device=q.device)
        for i in range(B):
            slot = int(init_indices[i])
            if slot < 0:
                continue
            h = cls._load(state, slot, state_vk)
            for t in range(T):
                h = cls._token(h, k[i, t], v[i, t], a[i, t], b[i, t], A_log, dt_bias)[0]
                o[i, t] = cls._out(h, q[i, t], scale).to(o.dtype)
                dst = int(token_indices[i, t])
                if dst >= 0:
                    cls._store(state, dst, h, state_vk)
        return o
