"""The lazy-commit GDN layer's spec branch on CPU, against its eager twin.

Two `LazyQwenGDN` layers with the same weights and state pools are driven with vLLM-shaped
`GDNAttentionMetadata` through several verify steps (ragged rows, 0 / some / all drafts accepted,
a row sitting out a step, a row entering from vLLM's own form): one runs the lazy kernel, the
other the eager twin (vLLM's per-token storing, same arithmetic).  Outputs, conv buffers and the
materialised states (the lazy one committed back to vLLM form) must be bit-identical.
"""
from __future__ import annotations

import copy
import os
import types

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402

from backend.plugin import gdn  # noqa: E402
from backend.plugin.gdn_layer import LazyQwenGDN  # noqa: E402
from backend.plugin.gdn_lazy import LazyGdnState, spec_conv_update  # noqa: E402

pytestmark = pytest.mark.unit

H, HV, K, V, WIDTH, NUM_SPEC, SLOTS = 1, 2, 128, 128, 4, 3, 24
DIM = 2 * H * K + HV * V
DT = torch.bfloat16


def _layer(eager: bool, weights: dict[str, torch.Tensor], conv: torch.Tensor, ssm: torch.Tensor) -> LazyQwenGDN:
    hv = ssm.shape[1]
    layer = LazyQwenGDN.__new__(LazyQwenGDN)
    torch.nn.Module.__init__(layer)
    layer.prefix = "model.layers.0.linear_attn"
    layer.tp_size = 1
    layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim = H, hv, K, V
    layer.key_dim, layer.value_dim = H * K, hv * V
    layer.num_spec = NUM_SPEC
    layer.activation = "silu"
    layer.model_config = types.SimpleNamespace(dtype=DT)
    layer.conv1d = types.SimpleNamespace(weight=weights["conv_w"].unsqueeze(1), bias=None)
    layer.A_log, layer.dt_bias = weights["A_log"], weights["dt_bias"]
    layer.kv_cache = [conv.clone(), ssm.clone()]
    layer.hh_eager, layer.hh_state, layer.hh_lazy_steps, layer.hh_upstream_steps = eager, None, 0, 0
    return layer


def _pools(seed: int, hv: int = HV) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dim = 2 * H * K + hv * V
    weights = {
        "conv_w": (torch.randn(dim, WIDTH, generator=g) * 0.5).to(DT),
        "A_log": torch.randn(hv, generator=g) * 0.5,
        "dt_bias": torch.randn(hv, generator=g) * 0.5,
    }
    state_len = WIDTH - 1 + NUM_SPEC
    shape = (SLOTS, dim, state_len) if is_conv_state_dim_first() else (SLOTS, state_len, dim)
    conv = torch.randn(*shape, generator=g).to(DT)
    ssm = (torch.randn(SLOTS, hv, V, K, generator=g) * 0.1).to(DT)
    return weights, conv, ssm


def _metadata(spec_idx: torch.Tensor, lens: list[int], acc: list[int]) -> GDNAttentionMetadata:
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(qsl[-1])
    return GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=len(lens), num_spec_decode_tokens=n, num_actual_tokens=n,
        spec_query_start_loc=qsl, spec_state_indices_tensor=spec_idx,
        spec_sequence_masks=torch.ones(len(lens), dtype=torch.bool),
        num_accepted_tokens=torch.tensor(acc, dtype=torch.int32),
        uniform_spec_sequence_length=lens[0] if len(set(lens)) == 1 else None,
    )


def _step(layer: LazyQwenGDN, md: GDNAttentionMetadata, x: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], layer.num_v_heads, V, dtype=DT)
    layer._hh_metadata = lambda: md  # type: ignore[method-assign]
    layer.hh_core(x, b, a, out, upstream=lambda: pytest.fail("routed upstream"))
    return out


def _materialised(layer: LazyQwenGDN, spec_idx: torch.Tensor, acc: list[int]) -> torch.Tensor:
    """The state of each row's last accepted token, in vLLM form (lazy rows committed on a copy)."""
    st: LazyGdnState = copy.deepcopy(layer.hh_state, {id(layer.hh_state.k): layer.hh_state.k})  # kernels shared
    acc_t = torch.tensor(acc, dtype=torch.int32)
    if not st.eager:
        st.commit_rows(spec_idx, acc_t, layer.A_log, layer.dt_bias)
    cols = spec_idx.gather(1, (acc_t.long() - 1).unsqueeze(1)).squeeze(1).long()
    return st.pool[cols].clone()


# Rows are requests with windows of 1 + NUM_SPEC slots; each step: tokens per row, and how many
# of the previous step's tokens were accepted (vLLM's num_accepted_tokens; 1 after a prefill).
WINDOWS = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
STEPS = [
    ([0, 1, 2], [4, 4, 4], [1, 1, 1]),  # first verify step after prefill: uniform, full drafts
    ([0, 1, 2], [4, 2, 1], [4, 1, 2]),  # all / none / some accepted; ragged next (1 = no draft)
    ([0, 2], [3, 1], [2, 1]),  # row 1 sits out this step (token budget)
    ([0, 1, 2], [4, 4, 2], [3, 2, 1]),  # row 1 back: its log is in the half this step overwrites
    ([0, 1, 2], [1, 1, 1], [4, 4, 2]),  # nobody drafted: T = 1 rows in a width-4 window
    ([2, 0, 1], [4, 3, 4], [1, 1, 1]),  # rows permuted in the batch
]


def _drive(kernel: str, steps, hv: int, monkeypatch: pytest.MonkeyPatch):
    """Run `steps` on a lazy and an eager layer (same weights and pools) with `kernel`; every
    step's output, conv buffer and materialised states must agree bit for bit."""
    monkeypatch.setenv("HYPERHARNESS_GDN_KERNEL", kernel)
    weights, conv, ssm = _pools(seed=3, hv=hv)
    dim = 2 * H * K + hv * V
    lazy, eager = _layer(False, weights, conv, ssm), _layer(True, weights, conv, ssm)
    g = torch.Generator().manual_seed(5)
    outs = []
    for rows, lens, acc in steps:
        spec_idx = WINDOWS[rows]
        md = _metadata(spec_idx, lens, acc)
        n = sum(lens)
        x = torch.randn(n, dim, generator=g).to(DT)
        b, a = torch.randn(n, hv, generator=g).to(DT), torch.randn(n, hv, generator=g).to(DT)
        before = _materialised(lazy, spec_idx, acc) if lazy.hh_state is not None else None
        if before is not None:
            assert torch.equal(before, _materialised(eager, spec_idx, acc))
        o_lazy, o_eager = _step(lazy, md, x, b, a), _step(eager, md, x, b, a)
        assert torch.equal(o_lazy, o_eager), (rows, lens, acc)
        assert o_lazy.abs().sum() > 0
        assert torch.equal(lazy.kv_cache[0], eager.kv_cache[0])
        outs.append(o_lazy)
    assert lazy.hh_lazy_steps == eager.hh_lazy_steps == len(steps)
    assert type(lazy.hh_state.k).__name__ == ("module" if kernel == "triton" else "type")
    spare = WINDOWS[:, 1:].flatten().long()
    assert torch.equal(lazy.kv_cache[1][spare], ssm[spare]), "the lazy path wrote a per-token state"
    return lazy, eager, outs


def test_spec_branch_lazy_equals_eager_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU engines' torch stand-in, every step of STEPS."""
    lazy, eager, _ = _drive("torch", STEPS, HV, monkeypatch)
    # After the last step: every accepted count's state agrees.
    for acc in ([1, 1, 1], [2, 3, 4], [3, 4, 1]):  # last step: 3, 4, 4 tokens
        assert torch.equal(_materialised(lazy, WINDOWS, acc), _materialised(eager, WINDOWS, acc))


@pytest.mark.kernels
def test_triton_kernel_lazy_equals_eager_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real kernel through Triton's interpreter (the only interpreter test here: minutes on
    CPU), at the smallest shapes the layer routes (one key and one value head; K = V = 128 is the
    router's rule) and the steps that exercise the log: full drafts, all / none / some accepted,
    a row sitting out, its return with its log in the half the step overwrites.  The same steps on
    the torch stand-in agree with it up to reduction order."""
    steps = STEPS[:4]
    lazy, eager, outs = _drive("triton", steps, 1, monkeypatch)
    for acc in ([1, 1, 1], [2, 3, 2], [4, 4, 1]):  # last step: 4, 4, 2 tokens
        assert torch.equal(_materialised(lazy, WINDOWS, acc), _materialised(eager, WINDOWS, acc))
    t_lazy, _, t_outs = _drive("torch", steps, 1, monkeypatch)
    for o, t in zip(outs, t_outs, strict=True):
        assert torch.allclose(o.float(), t.float(), atol=2e-2, rtol=2e-2), (o.float() - t.float()).abs().max()
    for acc in ([1, 1, 1], [4, 4, 1]):
        x, y = _materialised(lazy, WINDOWS, acc).float(), _materialised(t_lazy, WINDOWS, acc).float()
        assert torch.allclose(x, y, atol=2e-2, rtol=2e-2), (x - y).abs().max()


@pytest.mark.kernels
def test_torch_twin_writes_the_kernels_log_layout() -> None:
    """The torch twin and the Triton kernel (interpreter) write the same log rows (raw k exact;
    decay, 1/||k|| up to reduction order; u up to reduction order once the twin's u, applied to the
    normalised k, is scaled by 1/||k||: the kernel's u is applied to the raw k) and replay them to
    the same states; the twin with an fp32 log holding the bf16 keys is bit-identical to the twin
    with a bf16 log."""
    import kernels.gdn_verify as kv
    from kernels.gdn_verify.reference import TorchGdnKernels as tk

    B, T, h, hv, k_dim, v_dim = 2, 3, 1, 2, 16, 8
    g = torch.Generator().manual_seed(9)
    A_log, dt_bias = torch.randn(hv, generator=g) * 0.5, torch.randn(hv, generator=g) * 0.5
    steps = [tuple(torch.randn(B, T, *shape, generator=g).to(DT) for shape in
                   ((h, k_dim), (h, k_dim), (hv, v_dim), (hv,), (hv,))) for _ in range(2)]
    base = torch.randn(3, hv, k_dim, v_dim, generator=g) * 0.3
    slots = torch.tensor([2, 0], dtype=torch.int32)
    runs = {}
    for name, impl, log_dtype in (("kernel", kv, DT), ("twin", tk, DT), ("twin-fp32-log", tk, torch.float32)):
        pool = base.clone()
        log = kv.gdn_log_empty(3, T, h, k_dim, hv, v_dim, log_dtype, "cpu").fill_(float("nan"))
        par = torch.zeros(1, dtype=torch.int32)
        outs = []
        for n, (q, k, v, a, b) in enumerate(steps):
            replay = torch.tensor([0, 0] if n == 0 else [3, 1], dtype=torch.int32)
            outs.append(impl.fused_recurrent_gdn_verify(q, k, v, a, b, A_log, dt_bias, pool, slots, log, par,
                                                        replay))
            if n == 0:
                first_log = log.clone()
            par ^= 1
        runs[name] = (pool, first_log, outs)
    lay = kv.log_layout(h, k_dim, hv, v_dim, DT)
    (p_k, l_k, o_k), (p_t, l_t, o_t), (p_f, l_f, o_f) = runs["kernel"], runs["twin"], runs["twin-fp32-log"]
    rows = l_k[slots.long(), 1]  # [B, T, row]: the first step wrote half 1
    assert torch.equal(rows[..., : h * k_dim], l_t[slots.long(), 1][..., : h * k_dim])
    assert torch.equal(rows[..., : h * k_dim].view(B, T, h, k_dim), steps[0][1])
    words_k, words_t = (kv.log_view_f32(x)[slots.long(), 1] for x in (l_k, l_t))
    for lo, n in ((lay.decay, hv), (lay.rk, h)):
        assert torch.allclose(words_k[..., lo : lo + n], words_t[..., lo : lo + n], rtol=1e-4, atol=1e-5)
    rk_t = words_t[..., lay.rk : lay.rk + h].repeat_interleave(hv // h, -1).repeat_interleave(v_dim, -1)
    u_t = words_t[..., lay.u : lay.u + hv * v_dim] * rk_t
    assert torch.allclose(words_k[..., lay.u : lay.u + hv * v_dim], u_t, rtol=1e-4, atol=1e-5)
    assert torch.allclose(p_k, p_t, rtol=1e-4, atol=1e-5)
    assert torch.equal(p_t, p_f) and all(torch.equal(x, y) for x, y in zip(o_t, o_f, strict=True))


def test_commit_for_upstream_leaves_vllm_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step after lazy steps: the spec rows are committed to column num_accepted - 1 (what
    vLLM's own path reads), non-spec slots forget their logs, then upstream runs."""
    monkeypatch.setenv("HYPERHARNESS_GDN_KERNEL", "torch")
    weights, conv, ssm = _pools(seed=4)
    lazy, eager = _layer(False, weights, conv, ssm), _layer(True, weights, conv, ssm)
    g = torch.Generator().manual_seed(6)
    for rows, lens, acc in STEPS[:2]:
        md = _metadata(WINDOWS[rows], lens, acc)
        n = sum(lens)
        x = torch.randn(n, DIM, generator=g).to(DT)
        b, a = torch.randn(n, HV, generator=g).to(DT), torch.randn(n, HV, generator=g).to(DT)
        _step(lazy, md, x, b, a), _step(eager, md, x, b, a)
    acc = [3, 1]
    mixed = GDNAttentionMetadata(
        num_prefills=1, num_prefill_tokens=5, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=2, num_spec_decode_tokens=8, num_actual_tokens=13,
        spec_state_indices_tensor=WINDOWS[:2], spec_sequence_masks=torch.tensor([True, True, False]),
        num_accepted_tokens=torch.tensor(acc, dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor([8], dtype=torch.int32),
    )
    calls: list[str] = []
    for layer in (lazy, eager):
        layer._hh_metadata = lambda: mixed  # type: ignore[method-assign]
        layer.hh_core(None, None, None, None, upstream=lambda: calls.append("upstream"))  # type: ignore[arg-type]
    assert calls == ["upstream", "upstream"]
    cols = WINDOWS[:2].gather(1, (torch.tensor(acc) - 1).unsqueeze(1)).squeeze(1).long()
    assert torch.equal(lazy.kv_cache[1][cols], eager.kv_cache[1][cols])
    assert not lazy.hh_state.lazy[[0, 4, 8]].any()
    # The next pure spec step enters from vLLM form (row 0 reads column 2) and still matches.
    rows, lens = [0, 1], [4, 4]
    md = _metadata(WINDOWS[rows], lens, acc)
    x = torch.randn(8, DIM, generator=g).to(DT)
    b, a = torch.randn(8, HV, generator=g).to(DT), torch.randn(8, HV, generator=g).to(DT)
    assert torch.equal(_step(lazy, md, x, b, a), _step(eager, md, x, b, a))


def _kernel_inputs(g: torch.Generator, rows: int, T: int):
    return (torch.randn(rows, T, H, K, generator=g).to(DT), torch.randn(rows, T, H, K, generator=g).to(DT),
            torch.randn(rows, T, HV, V, generator=g).to(DT), torch.randn(rows, T, HV, generator=g).to(DT),
            torch.randn(rows, T, HV, generator=g).to(DT))


def _upstream_step(layers, g: torch.Generator, spec_idx: torch.Tensor | None, acc: list[int],
                   prefill: dict[int, bool]) -> None:
    """A prefill or mixed step through `hh_core` with a stand-in for vLLM's own kernels, on every
    layer with the same inputs: a prefill chunk runs two tokens on its slot (from zeros when the
    chunk is the prompt's first); a spec row (one token, no drafts) reads column num_accepted - 1
    and stores its state into column 0, as vLLM's spec path does."""
    from kernels.gdn_verify.reference import TorchGdnKernels as tk

    slots = list(prefill)
    pre_in = _kernel_inputs(g, len(slots), 2)
    n_spec = 0 if spec_idx is None else spec_idx.shape[0]
    spec_in = _kernel_inputs(g, n_spec, 1) if n_spec else None
    md = GDNAttentionMetadata(
        num_prefills=len(slots), num_prefill_tokens=2 * len(slots), num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=n_spec, num_spec_decode_tokens=n_spec, num_actual_tokens=2 * len(slots) + n_spec,
        spec_state_indices_tensor=spec_idx,
        spec_sequence_masks=None if not n_spec else torch.tensor([True] * n_spec + [False] * len(slots)),
        num_accepted_tokens=None if not n_spec else torch.tensor(acc, dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32),
    )
    for layer in layers:
        def upstream(layer=layer) -> None:
            pool, _ = layer._hh_pool()
            for slot, first in prefill.items():
                if first:
                    pool[slot] = 0
            idx = torch.tensor(slots, dtype=torch.int32)
            tk.fused_recurrent_gdn_verify_eager(*pre_in, layer.A_log, layer.dt_bias, pool, idx,
                                                idx.unsqueeze(1).expand(-1, 2).contiguous())
            if n_spec:
                init = spec_idx.gather(1, (torch.tensor(acc) - 1).unsqueeze(1)).squeeze(1).to(torch.int32)
                tk.fused_recurrent_gdn_verify_eager(*spec_in, layer.A_log, layer.dt_bias, pool, init,
                                                    spec_idx[:, :1].to(torch.int32).contiguous())

        layer._hh_metadata = lambda: md  # type: ignore[method-assign]
        layer.hh_core(None, None, None, None, upstream=upstream)  # type: ignore[arg-type]


def test_engine_turn_boundaries_on_reused_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step sequence of the end-to-end engine test (test_gdn_lazy_engine.py, 64-token budget)
    on the torch stand-in: chunked prefills, mixed steps whose spec rows go upstream, pure verify
    steps of one token (no drafts), requests finishing one by one, then a new turn whose requests
    get other windows on the same slots: a column 0 that held a lazy row with a pending log in the
    half the next step reads, one whose row sat out (log in the other half), one that was a spare
    column.  Lazy and eager agree at every step."""
    monkeypatch.setenv("HYPERHARNESS_GDN_KERNEL", "torch")
    weights, conv, ssm = _pools(seed=7)
    lazy, eager = _layer(False, weights, conv, ssm), _layer(True, weights, conv, ssm)
    g = torch.Generator().manual_seed(8)

    def spec(windows: torch.Tensor, lens: list[int], acc: list[int]) -> None:
        md = _metadata(windows, lens, acc)
        n = sum(lens)
        x = torch.randn(n, DIM, generator=g).to(DT)
        b, a = torch.randn(n, HV, generator=g).to(DT), torch.randn(n, HV, generator=g).to(DT)
        assert torch.equal(_step(lazy, md, x, b, a), _step(eager, md, x, b, a)), (windows, lens, acc)

    def same(windows: torch.Tensor, acc: list[int]) -> None:
        if lazy.hh_state is None:  # no verify step yet: plain pools
            assert torch.equal(lazy.kv_cache[1], eager.kv_cache[1])
            return
        assert torch.equal(_materialised(lazy, windows, acc), _materialised(eager, windows, acc))

    def turn(w: torch.Tensor) -> None:
        c0 = w[:, 0].tolist()
        _upstream_step((lazy, eager), g, None, [], {c0[0]: True})
        _upstream_step((lazy, eager), g, None, [], {c0[0]: False, c0[1]: True, c0[2]: True})
        same(w, [1, 1, 1])
        _upstream_step((lazy, eager), g, w[:1], [1], {c0[1]: False, c0[2]: False})
        same(w, [1, 1, 1])
        _upstream_step((lazy, eager), g, w[:2], [1, 1], {c0[2]: False})
        same(w, [1, 1, 1])
        for _ in range(3):
            spec(w, [1, 1, 1], [1, 1, 1])
        spec(w, [4, 2, 1], [1, 1, 1])  # drafts too (the engine's ngram drafts on repetitive text)
        spec(w, [1, 1, 1], [3, 2, 1])
        spec(w[[0, 2]], [1, 1], [1, 1])  # the second request finished
        spec(w[[2]], [1], [1])  # the first one too: row 0 sat out, row 2 ran
        same(w, [1, 1, 1])

    w1 = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
    turn(w1)
    st = lazy.hh_state
    # Pending logs left behind: slot 8 in the half the next step reads, slot 0 in the other one.
    assert st.lazy[[0, 4, 8]].all() and int(st.half[8]) == int(st.parity) != int(st.half[0])
    # New requests: column 0 on slot 8 (pending log, current half), 0 (stale half), 5 (spare).
    w2 = torch.tensor([[8, 12, 13, 14], [0, 15, 16, 17], [5, 18, 19, 20]], dtype=torch.int32)
    turn(w2)
    assert lazy.hh_lazy_steps == eager.hh_lazy_steps == 14
    assert torch.equal(lazy.kv_cache[0], eager.kv_cache[0])


def test_spec_conv_update_matches_a_direct_convolution() -> None:
    g = torch.Generator().manual_seed(1)
    dim, state_len = 8, WIDTH - 1 + NUM_SPEC
    buf = torch.randn(3, dim, state_len, generator=g)
    w = torch.randn(dim, WIDTH, generator=g)
    x = torch.randn(2, 4, dim, generator=g)
    acc, ntok = torch.tensor([3, 1]), torch.tensor([2, 4])
    before = buf.clone()
    out = spec_conv_update(x, buf, w, None, False, torch.tensor([2, 0]), acc, ntok)
    for r, (slot, off) in enumerate(((2, 2), (0, 0))):
        seq = torch.cat([before[slot, :, off : off + WIDTH - 1], x[r].T], dim=1)
        ref = torch.stack([(seq[:, t : t + WIDTH] * w).sum(-1) for t in range(4)])
        assert torch.allclose(out[r, : ntok[r]], ref[: ntok[r]], atol=1e-5)
        # After accepting j tokens, the next window [j-1, j-1+3) is the 3 inputs before token j.
        for j in range(1, int(ntok[r]) + 1):
            assert torch.equal(buf[slot, :, j - 1 : j - 1 + WIDTH - 1], seq[:, j : j + WIDTH - 1])


def test_router_sends_every_pure_spec_batch_of_128_dim_heads() -> None:
    batch = dict(num_spec_rows=3, num_rows=3, tokens_per_row=NUM_SPEC + 1, key_dim=128, value_dim=128,
                 state_dtype="bfloat16", log_capacity=NUM_SPEC + 1)
    assert gdn.route_to_lazy_commit(gdn.GdnBatch(**batch))  # type: ignore[arg-type]
    assert not gdn.route_to_lazy_commit(gdn.GdnBatch(**{**batch, "num_rows": 4}))  # type: ignore[arg-type]
