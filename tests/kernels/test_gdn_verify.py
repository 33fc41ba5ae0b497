"""Gated DeltaNet verify kernel: Triton (lazy and eager) against the fp32 reference, and lazy vs
eager states bit-identical over several steps.  CPU: TRITON_INTERPRET=1 on small odd shapes;
real shapes run only with CUDA."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first @triton.jit decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.gdn_verify import (  # noqa: E402
    fused_recurrent_gdn_commit,
    fused_recurrent_gdn_verify,
    fused_recurrent_gdn_verify_eager,
    gdn_log_empty,
    naive_recurrent_gdn_verify_eager,
    naive_recurrent_gdn_verify_lazy,
)

pytestmark = pytest.mark.kernels

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# ||out - ref|| / ||ref|| bounds: fp32 math with a different reduction order, then the state
# rounded to its dtype (one ulp where the two fp32 values straddle a rounding boundary).
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any(), "NaN in kernel output (unwritten element?)"
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def make_inputs(B, T, H, HV, K, V, seed, dtype=torch.bfloat16, device=DEVICE):
    g = torch.Generator().manual_seed(seed)

    def r(*s, std=1.0):
        return (torch.randn(*s, generator=g) * std).to(dtype).to(device)

    p = torch.Generator().manual_seed(HV)  # layer parameters: the same at every step
    return dict(
        q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), a=r(B, T, HV), b=r(B, T, HV),
        A_log=(torch.rand(HV, generator=p) * 2 - 1).to(device),
        dt_bias=(torch.randn(HV, generator=p) * 0.5).to(device),
    )


def nan_out(B, T, HV, V):
    return torch.full((B, T, HV, V), float("nan"), device=DEVICE)


CASES = [
    pytest.param(3, 5, 2, 6, 24, 20, torch.float32, id="B3-T5-H2-HV6-K24-V20-fp32"),
    pytest.param(3, 5, 2, 6, 24, 20, torch.bfloat16, id="B3-T5-H2-HV6-K24-V20-bf16"),
    pytest.param(3, 5, 2, 6, 24, 20, torch.float16, id="B3-T5-H2-HV6-K24-V20-fp16"),
    pytest.param(2, 3, 1, 3, 16, 40, torch.float32, id="B2-T3-H1-HV3-K16-V40-fp32"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,sdtype", CASES)
def test_eager_matches_reference(B, T, H, HV, K, V, sdtype):
    x = make_inputs(B, T, H, HV, K, V, seed=1)
    h0 = torch.randn(B, HV, K, V).mul(0.3).to(sdtype).to(DEVICE)
    pool = torch.full((1 + B * (T + 1), HV, K, V), float("nan"), dtype=sdtype, device=DEVICE)
    init = torch.arange(B, device=DEVICE) * (T + 1) + 1
    pool[init] = h0
    tok = (init[:, None] + 1 + torch.arange(T, device=DEVICE)).to(torch.int32).contiguous()
    o = fused_recurrent_gdn_verify_eager(
        **x, state=pool, init_indices=init.to(torch.int32), token_indices=tok, out=nan_out(B, T, HV, V)
    )
    o_ref, s_ref = naive_recurrent_gdn_verify_eager(**x, h0=h0)
    assert rel_err(o, o_ref) < TOL[torch.float32] * 50
    assert rel_err(pool[tok.long()], s_ref) < TOL[sdtype]
    assert torch.equal(pool[init], h0), "start state must not be written"


class EagerRunner:
    """vLLM-style state keeping: each request owns T + 1 slots; the step starts from `cur`."""

    def __init__(self, h0, T, config=None, state_vk=False):
        B = h0.shape[0]
        self.T = T
        self.config = config
        self.state_vk = state_vk
        self.pool = torch.full((1 + B * (T + 1), *h0.shape[1:]), float("nan"), dtype=h0.dtype, device=DEVICE)
        self.cur = [1 + i * (T + 1) for i in range(B)]
        self.pool[self.cur] = h0

    def step(self, x, out):
        B = len(self.cur)
        tok = []
        for i in range(B):
            own = range(1 + i * (self.T + 1), 1 + (i + 1) * (self.T + 1))
            tok.append([s for s in own if s != self.cur[i]])
        tok_t = torch.tensor(tok, dtype=torch.int32, device=DEVICE)
        init = torch.tensor(self.cur, dtype=torch.int32, device=DEVICE)
        o = fused_recurrent_gdn_verify_eager(**x, state=self.pool, init_indices=init, token_indices=tok_t, out=out,
                                             config=self.config, state_vk=self.state_vk)
        self._tok = tok
        return o

    def accept(self, accepted):
        self.cur = [c if r == 0 else t[r - 1] for c, r, t in zip(self.cur, accepted, self._tok)]

    def states(self):
        return self.pool[self.cur]


def _lazy_vs_eager(sdtype, B, T, H, HV, K, V, steps, config=None, seed=100, state_vk=False,
                   log_dtype=torch.bfloat16, in_dtypes=None):
    """Run lazy and eager side by side over `steps` (accepted counts after each step); assert
    outputs and states bit-identical at every step and after a final commit.  ``in_dtypes``:
    per-input dtypes (e.g. {"v": torch.float32}); ``state_vk``: [S, HV, V, K] pools."""
    shape = (B, HV, V, K) if state_vk else (B, HV, K, V)
    h0 = torch.randn(*shape).mul(0.3).to(sdtype).to(DEVICE)
    eager = EagerRunner(h0, T, config, state_vk)
    slots = torch.tensor([2, 0, 5][:B], dtype=torch.int32, device=DEVICE)
    lazy_pool = torch.full((6, *shape[1:]), float("nan"), dtype=sdtype, device=DEVICE)
    lazy_pool[slots.long()] = h0
    log = gdn_log_empty(6, T, H, K, HV, V, log_dtype, DEVICE).fill_(float("nan"))
    parity = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    replay = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    for n, accepted in enumerate(steps):
        x = make_inputs(B, T, H, HV, K, V, seed=seed + n)
        for name, dt in (in_dtypes or {}).items():
            x[name] = x[name].to(dt)
        o_e = eager.step(x, nan_out(B, T, HV, V))
        o_l = fused_recurrent_gdn_verify(
            **x, state=lazy_pool, state_indices=slots, log=log, log_parity=parity,
            num_replay=replay, out=nan_out(B, T, HV, V), config=config, state_vk=state_vk,
        )
        assert torch.equal(o_l, o_e), f"step {n}: outputs differ"
        assert torch.equal(lazy_pool[slots.long()], eager.states()), f"step {n}: base != eager start"
        eager.accept(accepted)
        replay = torch.tensor(accepted, dtype=torch.int32, device=DEVICE)
        parity ^= 1
    fused_recurrent_gdn_commit(x["A_log"], x["dt_bias"], lazy_pool, slots, log, parity, replay, H, config=config,
                               state_vk=state_vk)
    assert torch.equal(lazy_pool[slots.long()], eager.states()), "committed state != eager state"


@pytest.mark.parametrize("sdtype", DTYPES, ids=str)
def test_lazy_bit_identical_to_eager(sdtype):
    steps = [[0, 4, 2], [4, 1, 0], [3, 4, 4], [0, 0, 1]]  # accepted after each step
    _lazy_vs_eager(sdtype, 3, 4, 2, 4, 16, 12, steps)


# (BV, num_warps, VEC, PF, RG[, KCVT]): prefetch depths 1/3/4 with T=5 rotate the prefetch queue
# through every slot; RG=1 and RG=8 (> TL) cover the replay-group edges; KCVT 0 and 1.
@pytest.mark.parametrize("config", [(4, 1, 2, 1, 1), (8, 1, 4, 3, 8, 1), (16, 1, 4, 4, 2),
                                    (8, 1, 2, 2, 4, 0)], ids=str)
def test_lazy_bit_identical_to_eager_configs(config):
    steps = [[5, 0, 2], [1, 5, 3], [0, 2, 5]]
    _lazy_vs_eager(torch.bfloat16, 3, 5, 1, 2, 16, 20, steps, config=config, seed=300)


def test_lazy_bit_identical_to_eager_vk_fp32_log_mixed_inputs():
    """vLLM's [V, K] pool layout, an fp32 log holding bf16 keys, v/a/b in other dtypes than k:
    the replay (rank-1 updates from the logged u) still reproduces the eager states bit for bit."""
    steps = [[3, 0], [1, 3], [3, 2]]
    _lazy_vs_eager(torch.float32, 2, 3, 1, 2, 16, 12, steps, seed=600, state_vk=True, log_dtype=torch.float32,
                   in_dtypes={"v": torch.float32, "a": torch.float16, "b": torch.float32})


def test_log_layout_and_dtype_check():
    from kernels.gdn_verify import log_layout

    lay = log_layout(16, 128, 48, 128, torch.bfloat16)  # Qwen3.5 GDN: 28,928 B per token
    assert (lay.row_bytes, lay.u, lay.decay, lay.rk) == (28928, 1024, 7168, 7216)
    assert log_layout(16, 128, 48, 128, torch.float32).row_bytes == 28928 + 4096
    lay = log_layout(1, 7, 3, 5, torch.float16)  # odd sizes: 16-byte aligned sections and rows
    assert lay.u % 4 == 0 and lay.row_words % 4 == 0 and lay.row == 2 * lay.row_words
    assert gdn_log_empty(3, 4, 1, 7, 3, 5, torch.float16, "cpu").shape == (3, 2, 4, lay.row)
    B, T, H, HV, K, V = 1, 2, 1, 1, 8, 8
    x = make_inputs(B, T, H, HV, K, V, seed=1, dtype=torch.float16)
    with pytest.raises(ValueError, match="cannot hold k"):
        fused_recurrent_gdn_verify(
            **x, state=torch.zeros(1, HV, K, V, device=DEVICE), state_indices=torch.zeros(1, dtype=torch.int32, device=DEVICE),
            log=gdn_log_empty(1, T, H, K, HV, V, torch.bfloat16, DEVICE),
            log_parity=torch.zeros(1, dtype=torch.int32, device=DEVICE), num_replay=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        )


@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16], ids=str)
def test_lazy_matches_reference(sdtype):
    B, T, H, HV, K, V = 3, 3, 1, 2, 24, 20
    prev = make_inputs(B, T, H, HV, K, V, seed=7)
    x = make_inputs(B, T, H, HV, K, V, seed=8)
    base = torch.randn(B, HV, K, V).mul(0.3).to(sdtype).to(DEVICE)
    pool = base.clone()
    slots = torch.arange(B, dtype=torch.int32, device=DEVICE)
    log = gdn_log_empty(B, T, H, K, HV, V, torch.bfloat16, DEVICE).fill_(float("nan"))
    parity = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    fused_recurrent_gdn_verify(**prev, state=pool, state_indices=slots, log=log, log_parity=parity,
                               num_replay=torch.zeros(B, dtype=torch.int32, device=DEVICE), out=nan_out(B, T, HV, V))
    assert torch.equal(pool, base), "num_replay = 0 must leave the base untouched"
    parity ^= 1
    replay = torch.tensor([0, 3, 1], dtype=torch.int32, device=DEVICE)
    o = fused_recurrent_gdn_verify(**x, state=pool, state_indices=slots, log=log, log_parity=parity,
                                   num_replay=replay, out=nan_out(B, T, HV, V))
    ref_log = (prev["k"], prev["v"], prev["a"], prev["b"])
    o_ref, base_ref = naive_recurrent_gdn_verify_lazy(**x, base=base, log=ref_log, num_replay=replay)
    assert rel_err(o, o_ref) < TOL[torch.float32] * 50
    assert rel_err(pool, base_ref) < TOL[sdtype]


def test_vllm_state_layout():
    """state_vk=True: the same step on vLLM's [S, HV, V, K] pool layout."""
    B, T, H, HV, K, V = 2, 3, 1, 2, 16, 12
    prev = make_inputs(B, T, H, HV, K, V, seed=11)
    x = make_inputs(B, T, H, HV, K, V, seed=12)
    res = []
    base = torch.randn(B, HV, K, V).mul(0.3).to(DEVICE)
    for vk in (False, True):
        pool = base.transpose(-1, -2).contiguous() if vk else base.clone()
        slots = torch.arange(B, dtype=torch.int32, device=DEVICE)
        log = gdn_log_empty(B, T, H, K, HV, V, torch.bfloat16, DEVICE).fill_(float("nan"))
        par = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        kw = dict(state=pool, state_indices=slots, log=log, log_parity=par, state_vk=vk)
        fused_recurrent_gdn_verify(**prev, **kw, num_replay=torch.zeros(B, dtype=torch.int32, device=DEVICE))
        par ^= 1
        o = fused_recurrent_gdn_verify(**x, **kw, num_replay=torch.tensor([3, 1], dtype=torch.int32, device=DEVICE),
                                       out=nan_out(B, T, HV, V))
        res.append((o, pool.transpose(-1, -2) if vk else pool))
    assert rel_err(res[1][0], res[0][0]) < TOL[torch.float32]
    assert rel_err(res[1][1], res[0][1]) < TOL[torch.float32]


def test_reference_lazy_equals_reference_eager():
    B, T, H, HV, K, V = 2, 3, 1, 2, 8, 8
    prev = make_inputs(B, T, H, HV, K, V, seed=3, device="cpu")
    x = make_inputs(B, T, H, HV, K, V, seed=4, device="cpu")
    h0 = torch.randn(B, HV, K, V).to(torch.bfloat16)
    _, s_prev = naive_recurrent_gdn_verify_eager(**prev, h0=h0)
    replay = torch.tensor([2, 3])
    start = torch.stack([s_prev[i, r - 1] for i, r in enumerate(replay.tolist())])
    o_e, _ = naive_recurrent_gdn_verify_eager(**x, h0=start)
    o_l, base = naive_recurrent_gdn_verify_lazy(
        **x, base=h0, log=(prev["k"], prev["v"], prev["a"], prev["b"]), num_replay=replay
    )
    assert torch.equal(base, start) and torch.equal(o_l, o_e)


def test_negative_slot_is_skipped():
    B, T, H, HV, K, V = 2, 2, 1, 2, 8, 8
    x = make_inputs(B, T, H, HV, K, V, seed=5)
    pool = torch.randn(3, HV, K, V, device=DEVICE)
    before = pool.clone()
    log = gdn_log_empty(3, T, H, K, HV, V, torch.bfloat16, DEVICE).fill_(float("nan"))
    o = fused_recurrent_gdn_verify(
        **x, state=pool, state_indices=torch.tensor([-1, 1], dtype=torch.int32, device=DEVICE), log=log,
        log_parity=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        num_replay=torch.tensor([2, 0], dtype=torch.int32, device=DEVICE), out=nan_out(B, T, HV, V),
    )
    assert torch.isnan(o[0]).all() and not torch.isnan(o[1]).any()
    assert torch.equal(pool, before)


@pytest.mark.skipif(not CUDA, reason="real shapes need CUDA")
@pytest.mark.parametrize("sdtype", DTYPES, ids=str)
@pytest.mark.parametrize("B", [1, 4, 8])
def test_real_shapes_gpu(B, sdtype):
    T, H, HV, K, V = 8, 16, 48, 128, 128
    h0 = torch.randn(B, HV, K, V, device=DEVICE).mul(0.05).to(sdtype)
    eager = EagerRunner(h0, T)
    slots = torch.arange(B, dtype=torch.int32, device=DEVICE) + 1
    pool = torch.full((B + 1, HV, K, V), float("nan"), dtype=sdtype, device=DEVICE)
    pool[slots.long()] = h0
    log = gdn_log_empty(B + 1, T, H, K, HV, V, torch.bfloat16, DEVICE).fill_(float("nan"))
    parity = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    replay = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(B)
    for n in range(4):
        x = make_inputs(B, T, H, HV, K, V, seed=200 + n)
        start = eager.states().clone()
        o_e = eager.step(x, nan_out(B, T, HV, V))
        o_l = fused_recurrent_gdn_verify(**x, state=pool, state_indices=slots, log=log, log_parity=parity,
                                         num_replay=replay, out=nan_out(B, T, HV, V))
        assert torch.equal(o_l, o_e) and torch.equal(pool[slots.long()], start)
        o_ref, s_ref = naive_recurrent_gdn_verify_eager(**x, h0=start)
        assert rel_err(o_e, o_ref) < TOL[torch.float32] * 50
        assert rel_err(eager.pool[torch.tensor(eager._tok, device=DEVICE)], s_ref) < TOL[sdtype]
        accepted = torch.randint(0, T + 1, (B,), generator=g).tolist()
        accepted[0] = [0, T, 3, 1][n]
        eager.accept(accepted)
        replay = torch.tensor(accepted, dtype=torch.int32, device=DEVICE)
        parity ^= 1


# Candidate tilings timed by kernels/gdn_verify/diag.py --sweep.  Tilings with the same lane split
# along K reduce in the same order and must give bit-identical results: [16 K-lanes] (8, 1, 4),
# (4, 1, 2); [8 K-lanes] (8, 1, 2), (16, 1, 4) (the two defaults).  KCVT (6th entry) and PF/RG only
# move instructions: bit-identical to the family reference (default KCVT).  (4, 1, 2, 4, 8) passed
# at eb659a6 and compiles to the same SASS since; dropped to keep the device run's compile set small.
GPU_CONFIGS = [(8, 1, 4, 2, 4), (8, 1, 2, 4, 8), (16, 1, 4, 4, 8), (8, 1, 2, 4, 8, 0), (16, 1, 4, 4, 8, 0),
               (8, 1, 2, 2, 4, 0), (8, 1, 4, 2, 4, 1), (8, 1, 2, 2, 8, 0), (16, 1, 4, 2, 8, 0)]


def _family_ref(config):
    k_lanes = 32 // (config[0] // min(config[2], config[0]))
    return {16: (8, 1, 4, 2, 4), 8: (8, 1, 2, 4, 8)}[k_lanes]


@pytest.mark.skipif(not CUDA, reason="real shapes need CUDA")
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=str)
def test_real_shapes_configs_gpu(config, sdtype):
    T, H, HV, K, V = 8, 16, 48, 128, 128
    _lazy_vs_eager(sdtype, 3, T, H, HV, K, V, [[8, 3, 0], [1, 8, 5]], config=config, seed=400)
    ref = _family_ref(config)
    if tuple(config) != ref:
        outs = []
        for cfg in (config, ref):
            x = make_inputs(3, T, H, HV, K, V, seed=500)
            pool = torch.randn(3, HV, K, V, generator=torch.Generator().manual_seed(1)).mul(0.05).to(sdtype).to(DEVICE)
            log = gdn_log_empty(3, T, H, K, HV, V, torch.bfloat16, DEVICE)
            par = torch.zeros(1, dtype=torch.int32, device=DEVICE)
            slots = torch.arange(3, dtype=torch.int32, device=DEVICE)
            fused_recurrent_gdn_verify(**x, state=pool, state_indices=slots, log=log, log_parity=par,
                                       num_replay=torch.zeros(3, dtype=torch.int32, device=DEVICE),
                                       out=nan_out(3, T, HV, V), config=cfg)
            par ^= 1
            o = fused_recurrent_gdn_verify(**x, state=pool, state_indices=slots, log=log, log_parity=par,
                                           num_replay=torch.tensor([8, 2, 5], dtype=torch.int32, device=DEVICE),
                                           out=nan_out(3, T, HV, V), config=cfg)
            outs.append((o, pool))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), f"{config} vs {ref}"


@pytest.mark.skipif(not CUDA, reason="real shapes need CUDA")
@pytest.mark.parametrize("variant", ["vk", "fp32-log"])
def test_real_shapes_log_variants_gpu(variant):
    """Default config at real shapes on vLLM's [V, K] pool layout (bf16 state), and with an fp32
    log holding the bf16 keys (fp32 state): lazy == eager bit for bit over two steps + commit."""
    T, H, HV, K, V = 8, 16, 48, 128, 128
    if variant == "vk":
        _lazy_vs_eager(torch.bfloat16, 3, T, H, HV, K, V, [[8, 3, 0], [1, 8, 5]], seed=700, state_vk=True)
    else:
        _lazy_vs_eager(torch.float32, 3, T, H, HV, K, V, [[8, 3, 0], [1, 8, 5]], seed=700, log_dtype=torch.float32)


def test_default_config_table():
    """Every batch size's default config rounds like batch 1's (the [8 K x 4 V] family), so a
    request's results do not depend on the batch it ran in; configs are (BV, num_warps, VEC, PF,
    RG, KCVT) from the H200 sweep in NOTES.md."""
    from kernels.gdn_verify.triton import _default_config, _resolve_config

    for sd in (torch.float32, torch.bfloat16, torch.float16):
        ref = _family_ref(_default_config(1, sd))
        for batch in (1, 2, 3, 4, 5, 7, 8, 16):
            cfg = _default_config(batch, sd)
            assert len(cfg) == 6 and cfg[:3] in ((8, 1, 2), (16, 1, 4))
            assert _family_ref(cfg) == ref
        assert _default_config(8, sd, state_vk=True) == (8, 1, 4, 2, 4, 1)
    assert _resolve_config((16, 2), 1, torch.bfloat16, False) == (16, 2, 2, 4, 8, 0)
    with pytest.raises(ValueError):
        _resolve_config((8, 1, 4, 5), 1, torch.float32, False)
