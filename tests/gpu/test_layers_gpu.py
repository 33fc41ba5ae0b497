"""vLLM 0.32's own attention and Gated DeltaNet layers on the GPU, plugin off vs on (H200).

Run on the device (tests/gpu/run_device.sh unpacks vLLM's Python sources and the wheels first):

    python3 -m pytest -q -p no:cacheprovider --noconftest tests/gpu/test_layers_gpu.py

Three stacks of gpu-long's layers (tests/gpu/rig.py), each one attention + one GDN layer with
the same seeded weights and pool contents: `off` built before the plugin is registered (vLLM's
TRITON_ATTN kernel, vLLM's GDN layer), `on` after (the router sends verify batches to
kernels.verify_attention, the GDN layer is the plugin's LazyQwenGDN) and `twin` (LazyQwenGDN's
eager twin: vLLM's storing scheme with the lazy kernel's arithmetic).  Every step runs inside a
FULL CUDA graph captured as vLLM captures one (warm-up on null blocks, capture with
max_seq_len = max_model_len, replays over persistent buffers); the KV cache is written by
vLLM's own quantizing writer.  Tolerances (relative L2 against the fp32 reference): attention
5e-3 (bf16 q/out over an int8 cache: both kernels measure ~2e-3), GDN outputs and states 1e-2
(bf16 states rounded per token); lazy == eager twin bit for bit (the kernels' claim).
"""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the H200 harness)"),
]

ATTN_TOL = 5e-3
GDN_TOL = 1e-2
CONTEXTS = (8192, 32768, 100_000)
MAX_CONTEXT = 100_000 + 64
ERRORS: dict[str, float] = {}  # printed at the end (the closing note's figures)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    assert torch.isfinite(x).all(), "non-finite output"
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def rig():
    from tests.gpu import rig as r

    eng = r.Engine("gpu-long", max_model_len=100_352)
    stacks = {"off": r.Stack(eng, "off", attn=1, gdn=1, max_reqs=2, max_context=MAX_CONTEXT, seed=1)}
    r.enable_plugin()
    stacks["on"] = r.Stack(eng, "on", attn=1, gdn=1, max_reqs=2, max_context=MAX_CONTEXT, seed=1)
    stacks["twin"] = r.Stack(eng, "twin", attn=1, gdn=1, max_reqs=2, max_context=MAX_CONTEXT, seed=1,
                             gdn_eager_twin=True)
    gen = torch.Generator(device="cuda").manual_seed(7)
    ctx_k = torch.randn(2, MAX_CONTEXT, eng.shape.kv_heads, eng.shape.head_dim, generator=gen, device="cuda",
                        dtype=eng.dtype)
    ctx_v = torch.randn_like(ctx_k)
    for st in stacks.values():
        st.assign_blocks(seed=3)
        fill_context(st, ctx_k, ctx_v)
    yield r, eng, stacks
    print("\nrelative L2 errors against the fp32 reference:")
    for k, v in ERRORS.items():
        print(f"  {k}: {v:.2e}")


def fill_context(st, k: torch.Tensor, v: torch.Tensor, chunk: int = 16384) -> None:
    """Write every request's context K/V through vLLM's own writer (the impl's quantizing
    `do_kv_cache_update`), as prefill would."""
    for layer in st.attn_layers:
        for r in range(k.shape[0]):
            for lo in range(0, k.shape[1], chunk):
                hi = min(lo + chunk, k.shape[1])
                slots = torch.tensor(st.slots(r, range(lo, hi)), dtype=torch.int64, device="cuda")
                layer.impl.do_kv_cache_update(layer, k[r, lo:hi], v[r, lo:hi], layer.kv_cache, slots)
    torch.cuda.synchronize()


def int8_cache(layer):
    from kernels.verify_attention.reference import Int8KVCache

    k, v = layer.impl._pth_key_value_caches(layer.kv_cache)
    return Int8KVCache(raw=layer.kv_cache, k=k, v=v, k_scale=layer.impl._k_scale_cache,
                       v_scale=layer.impl._v_scale_cache)


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def test_vllm_block_size_is_the_geometry_page(rig) -> None:
    """vLLM's own hybrid alignment on the GPU gives the attention block backend/geometry.py
    computes for gpu-long (the page the pool check and the kernels assume)."""
    from backend.geometry import ModelShape, compute
    from backend.profiles import load_profile

    _, eng, stacks = rig
    geom = compute(load_profile("gpu-long"), ModelShape.named("qwen3.8-27b"))
    mamba = next(g.spec for g in stacks["off"].groups if not g.is_attention)
    attn = next(g.spec for g in stacks["off"].groups if g.is_attention)
    assert eng.block_size == geom.block_size == attn.block_size, (eng.block_size, geom.block_size)
    assert mamba.page_size_bytes == attn.page_size_bytes == geom.state_page_bytes


# -- attention: verify (T = 1 + k) and decode (T = 1) over 8K-100K --------------------------------


@pytest.mark.parametrize("T", [8, 1], ids=["verify", "decode"])
def test_attention_steps_in_graphs_match_reference(rig, T: int) -> None:
    from kernels.verify_attention.reference import naive_verify_attention

    r, eng, stacks = rig
    assert T == 1 or T == 1 + eng.num_spec
    H, D, Hkv = r.Q_HEADS, eng.shape.head_dim, eng.shape.kv_heads
    gen = torch.Generator(device="cuda").manual_seed(11 + T)
    results = {}
    for name in ("off", "on"):
        st = stacks[name]
        q = torch.empty(2 * T, H * D, device="cuda", dtype=eng.dtype)
        k = torch.empty(2 * T, Hkv * D, device="cuda", dtype=eng.dtype)
        v = torch.empty_like(k)
        module = r.AttentionStep(st)
        gen.manual_seed(11 + T)
        for ctx in CONTEXTS:
            step = r.StepInputs(context=[ctx, ctx - 1234], tokens=[T, T])
            for x in (q, k, v):
                x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=eng.dtype))
            out = st.run(module, (q, k, v), step, graph=True)[0].clone()
            torch.cuda.synchronize()
            layer = st.attn_layers[0]
            g = st.groups[[g.is_attention for g in st.groups].index(True)]
            seq = torch.tensor([c + t for c, t in zip(step.context, step.tokens)], dtype=torch.int32, device="cuda")
            cu = torch.tensor([0, T, 2 * T], dtype=torch.int32, device="cuda")
            ref = naive_verify_attention(q.view(-1, H, D), int8_cache(layer), cu, seq, g.block_table[:2])
            err = rel(out.view(-1, H, D), ref)
            ERRORS[f"attention {name} T={T} ctx={ctx}"] = err
            assert err < ATTN_TOL, (name, ctx, err)
            results[(name, ctx)] = out
    for ctx in CONTEXTS:  # the two kernels agree with each other as closely as with the reference
        assert rel(results[("on", ctx)], results[("off", ctx)]) < 2 * ATTN_TOL


def test_attention_routing_by_kernel_names(rig) -> None:
    """Plugin on: a verify batch runs kernels.verify_attention, a decode batch vLLM's kernel;
    plugin off: vLLM's kernel for both (CUDA kernel names of one eager step each)."""
    r, eng, stacks = rig
    H, D, Hkv = r.Q_HEADS, eng.shape.head_dim, eng.shape.kv_heads
    seen = {}
    for name in ("off", "on"):
        st = stacks[name]
        for T in (8, 1):
            q = torch.randn(2 * T, H * D, device="cuda", dtype=eng.dtype)
            k = torch.randn(2 * T, Hkv * D, device="cuda", dtype=eng.dtype)
            step = r.StepInputs(context=[32768, 30000], tokens=[T, T])
            names = kernel_names(lambda st=st, q=q, k=k, step=step: st.run(r.AttentionStep(st), (q, k, k.clone()), step,
                                                                            graph=False))
            seen[(name, T)] = {n for n in names if "attn" in n.lower() or "attention" in n.lower()}
    assert any("unified_attention" in n for n in seen[("off", 8)]), seen
    assert not any("unified_attention" in n for n in seen[("on", 8)]), seen
    assert any("verify" in n for n in seen[("on", 8)]), seen
    assert any("unified_attention" in n for n in seen[("on", 1)]), seen


# -- GDN: verify steps with accept / reject, then decode steps, in graphs -------------------------

# num_accepted (vLLM's num_accepted_tokens, the previous step's accepted drafts + 1) per request
# for each step; the first step follows a prefill (1).  Then two decode steps (no drafts).
GDN_STEPS = [([1, 1], 8), ([8, 3], 8), ([1, 8], 8), ([4, 1], 8), ([8, 1], 8), ([2, 5], 8), ([3, 1], 1), ([1, 1], 1)]
GDN_BLOCKS = (12, 3)  # contexts of 12 and 3 scheduler blocks + 9: every step stays in its block


def _ref_conv(hist: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 depthwise causal conv + SiLU of one request: hist [W-1, dim], x [T, dim], w [dim, W]."""
    seq = torch.cat([hist, x.float()], 0)
    width = w.shape[1]
    out = torch.stack([(seq[t : t + width].T * w.float()).sum(-1) for t in range(x.shape[0])])
    return torch.nn.functional.silu(out)


def _conv_hist(layer, slot: int, acc: int) -> torch.Tensor:
    """The W-1 conv inputs a step reads for its first token: columns acc-1 .. acc+W-3 of the
    slot's rolling buffer ([dim, W-1] or [W-1, dim] by vLLM's layout), as [W-1, dim] fp32."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    buf = layer.kv_cache[0][slot]
    w1 = layer.conv1d.weight.shape[-1] - 1
    cols = slice(acc - 1, acc - 1 + w1)
    return (buf[:, cols].T if is_conv_state_dim_first() else buf[cols]).float()


def _materialised(layer, windows: list[list[int]], acc: list[int]) -> torch.Tensor:
    """The state of each request's last accepted token in vLLM's form [B, HV, V, K] (a lazy
    row committed on a copy of the bookkeeping and pool)."""
    idx = torch.tensor(windows, dtype=torch.int32, device="cuda")
    acc_t = torch.tensor(acc, dtype=torch.int32, device="cuda")
    st = getattr(layer, "hh_state", None)
    pool = layer.kv_cache[1]
    if st is not None and not st.eager:
        st = copy.copy(st)  # commit on copies of what commit_rows writes: the pool and the flags
        st.pool, st.lazy = st.pool.clone(), st.lazy.clone()
        st.commit_rows(idx, acc_t, layer.A_log, layer.dt_bias)
        pool = st.pool
    cols = idx.gather(1, (acc_t.long() - 1).unsqueeze(1)).squeeze(1).long()
    return pool[cols].clone()


def test_gdn_accept_reject_in_graphs_lazy_equals_eager(rig) -> None:
    from kernels.gdn_verify.reference import naive_recurrent_gdn_verify_eager

    r, eng, stacks = rig
    layers = {n: s.gdn_layers[0] for n, s in stacks.items()}
    assert type(layers["off"]).__name__ == "QwenGatedDeltaNetAttention"
    assert type(layers["on"]).__name__ == "LazyQwenGDN" and not layers["on"].hh_eager and layers["twin"].hh_eager
    off = layers["off"]
    H, HV, K, V = off.num_k_heads, off.num_v_heads, off.head_k_dim, off.head_v_dim
    dim = 2 * H * K + HV * V
    w = off.conv1d.weight.view(off.conv1d.weight.shape[0], -1).float()
    gen = torch.Generator(device="cuda").manual_seed(5)
    # The same prefilled state in every stack (window column 0), and its fp32 mirror.
    conv0 = torch.randn((2, *off.kv_cache[0].shape[1:]), generator=gen, device="cuda").to(off.kv_cache[0].dtype)
    ssm0 = (torch.randn((2, *off.kv_cache[1].shape[1:]), generator=gen, device="cuda") * 0.1).to(off.kv_cache[1].dtype)
    for n, st in stacks.items():
        for b in range(2):
            col0 = st.window(0, b)[0]
            layers[n].kv_cache[0][col0] = conv0[b]
            layers[n].kv_cache[1][col0] = ssm0[b]
    # The window's other columns as they are before the steps (not zero: on its first call vLLM's
    # TRITON_ATTN writes fp32 1.0 into every inline scale slot of the whole shared KV buffer, the
    # GDN groups' blocks included, `_ensure_scale_caches`: 6,050 bf16 words per GDN block here).
    spare_before = [layers["on"].kv_cache[1][torch.tensor(stacks["on"].window(0, b)[1:], device="cuda")].clone()
                    for b in range(2)]
    ref_hist = [_conv_hist(off, stacks["off"].window(0, b)[0], 1) for b in range(2)]
    ref_state = [ssm0[b].transpose(-1, -2).clone() for b in range(2)]  # [HV, K, V] in the pool dtype
    bs = next(g.spec.block_size for g in stacks["off"].groups if not g.is_attention)
    assert 9 + sum(max(a) for a, _ in GDN_STEPS) + 8 < bs, f"scheduler block {bs} too small for the steps"
    context = [bs * n + 9 for n in GDN_BLOCKS]
    bufs = {}
    prev_states: list[torch.Tensor] = []  # per request: [T, HV, K, V] states after each token
    prev_seq: list[torch.Tensor] = []  # per request: [W-1+T, dim] conv inputs (history + tokens)
    for i, (acc, T) in enumerate(GDN_STEPS):
        if i:  # the previous step accepted acc[b] tokens: the scheduler advances each request
            context = [c + a for c, a in zip(context, acc)]
            for b in range(2):
                ref_state[b] = prev_states[b][acc[b] - 1]
                ref_hist[b] = prev_seq[b][acc[b] : acc[b] + w.shape[1] - 1]
        step = r.StepInputs(context=list(context), tokens=[T, T], num_accepted=list(acc))
        N = 2 * T
        x = torch.randn(N, dim, generator=gen, device="cuda").to(eng.dtype)
        b_in = torch.randn(N, HV, generator=gen, device="cuda").to(eng.dtype)
        a_in = torch.randn(N, HV, generator=gen, device="cuda").to(eng.dtype)
        outs = {}
        for n, st in stacks.items():
            if (n, T) not in bufs:
                o = [torch.empty(N, HV, V, device="cuda", dtype=eng.dtype)]
                bufs[(n, T)] = (torch.empty(N, dim, device="cuda", dtype=eng.dtype),
                                torch.empty(N, HV, device="cuda", dtype=eng.dtype),
                                torch.empty(N, HV, device="cuda", dtype=eng.dtype), r.GdnCoreStep(st, o))
            xb, bb, ab, module = bufs[(n, T)]
            xb.copy_(x), bb.copy_(b_in), ab.copy_(a_in)
            outs[n] = st.run(module, (xb, bb, ab), step, graph=True)[0].clone()
        torch.cuda.synchronize()
        # fp32 reference of this step, per request, from the state of its last accepted token.
        ref_out, prev_states, prev_seq = [], [], []
        for b in range(2):
            xs = x[b * T : (b + 1) * T]
            c = _ref_conv(ref_hist[b], xs, w)
            q, k, v = c.split([H * K, H * K, HV * V], -1)
            o, states = naive_recurrent_gdn_verify_eager(
                q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, HV, V),
                a_in[b * T : (b + 1) * T].view(1, T, HV), b_in[b * T : (b + 1) * T].view(1, T, HV),
                off.A_log, off.dt_bias, ref_state[b].unsqueeze(0))
            ref_out.append(o[0])
            prev_states.append(states[0])
            prev_seq.append(torch.cat([ref_hist[b], xs.float()], 0))
        ref = torch.cat(ref_out).view(N, HV, V)
        assert torch.equal(outs["on"], outs["twin"]), f"step {i}: lazy != eager twin"
        for n in ("off", "on"):
            err = rel(outs[n], ref)
            ERRORS[f"gdn out {n} step {i} T={T}"] = err
            assert err < GDN_TOL, (n, i, err)
        if T > 1 and GDN_STEPS[i + 1][1] == 1:  # the last verify step: every acceptance's state
            windows = {n: [st.window(0, b) for b in range(2)] for n, st in stacks.items()}
            for trial in ([8, 1], [1, 8], [4, 6]):
                mats = {n: _materialised(layers[n], windows[n], trial) for n in stacks}
                assert torch.equal(mats["on"], mats["twin"]), f"lazy != eager twin, accepted {trial}"
                ref_mat = torch.stack([prev_states[b][trial[b] - 1].transpose(-1, -2) for b in range(2)])
                for n in ("off", "on"):
                    err = rel(mats[n], ref_mat)
                    ERRORS[f"gdn state {n} step {i} accepted {trial}"] = err
                    assert err < GDN_TOL, (n, trial, err)
        for b in range(2):  # vLLM's conv kernel in both: the same rolling buffers
            assert torch.equal(layers["on"].kv_cache[0][stacks["on"].window(0, b)[0]],
                               layers["off"].kv_cache[0][stacks["off"].window(0, b)[0]]), (i, b)
    # The state after the last step's accepted tokens, in vLLM's form, for every stack.
    last_acc = [1, 1]  # the decode steps have one token each
    windows = {n: [st.window(0, b) for b in range(2)] for n, st in stacks.items()}
    mats = {n: _materialised(layers[n], windows[n], last_acc) for n in stacks}
    assert torch.equal(mats["on"], mats["twin"]), "lazy state != eager twin after accept / reject"
    ref_mat = torch.stack([prev_states[b][last_acc[b] - 1].transpose(-1, -2) for b in range(2)])
    for n in ("off", "on"):
        err = rel(mats[n], ref_mat)
        ERRORS[f"gdn state {n} after {len(GDN_STEPS)} steps"] = err
        assert err < GDN_TOL, (n, err)
    assert layers["on"].hh_lazy_steps >= 1 and layers["on"].hh_upstream_steps == 0
    for b in range(2):  # the lazy layer wrote only window column 0: one state per request and step
        spare = torch.tensor(windows["on"][b][1:], device="cuda")
        assert torch.equal(layers["on"].kv_cache[1][spare], spare_before[b]), "the lazy path wrote a per-token state"


def test_full_layer_forward_in_graph_plugin_on_matches_off(rig) -> None:
    """The whole layers as the model calls them (projections, core, gated norm, out_proj) in a
    FULL graph: plugin on and off give the same outputs within tolerance."""
    r, eng, stacks = rig
    H, D, Hkv = r.Q_HEADS, eng.shape.head_dim, eng.shape.kv_heads
    gen = torch.Generator(device="cuda").manual_seed(21)
    T = 1 + eng.num_spec
    inputs = [torch.randn(2 * T, n, generator=gen, device="cuda", dtype=eng.dtype)
              for n in (H * D, Hkv * D, Hkv * D, r.HIDDEN_SIZE)]
    outs = {}
    for n in ("off", "on"):
        st = stacks[n]
        bufs = tuple(x.clone() for x in inputs)
        step = r.StepInputs(context=[100_000 - 50, 65_000], tokens=[T, T], num_accepted=[1, 1])
        outs[n] = [o.clone() for o in st.run(r.LayerStep(st), bufs, step, graph=True)]
    torch.cuda.synchronize()
    for a, b in zip(outs["on"], outs["off"], strict=True):
        assert rel(a, b) < 2e-2, rel(a, b)
