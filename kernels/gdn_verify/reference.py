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
"""

from __future__ import annotations

import torch

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
