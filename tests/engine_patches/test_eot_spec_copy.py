"""Patch 0005's worker copy on real GDN states: lazy == eager, and equal to vLLM's own postprocess.

Two `LazyQwenGDN` layers with the same weights and pools (lazy, and the eager twin that stores
every token's state as vLLM does) run verify steps of 1 + k tokens (k = 3) on 20 requests, one
per (running count, accepted drafts) pair: running 9..12 and 14, every accepted count 0..k.  Then,
as in the engine, vLLM's align postprocess (block 8) and the end-of-turn snapshot copy (unit 4,
`run_eot_snapshot`; V1 through `postprocess_eot_snapshot_v1`, MRV2 with a permuted `idx_mapping`)
run on both pools: the lazy layer's temporal copies through 0003's hook, the eager pools through
vLLM's copy body.  A request copies iff b* = new // 4 * 4 >= running and b* is not a block
multiple: c = 0 (running 12), mid-window (running 10/11), the last column (running 9, all
accepted), and not at all (boundary before the window, or a block multiple: running 14).

The reference: vLLM's own `run_fused_postprocess` with block size 4 on a third copy of the
eager pools, where b* *is* a block boundary, so vLLM itself writes column b* - running (bias c)
into an empty block.  The snapshot block must equal that block byte for byte (conv and temporal,
NaN-prefilled alike); the lazy snapshot must equal the eager one, and the lazy windows keep their
base and log (their materialised states equal the eager ones).
"""
from __future__ import annotations

import os
import types

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.v1.worker import mamba_utils  # noqa: E402

from tests.engine_patches.test_eot_spec import eot_spec_patched  # noqa: E402
from tests.engine_patches.test_gdn_align import align_context, interpret_mamba_kernels  # noqa: E402
from tests.engine_patches.test_gdn_lazy import DIM, NUM_SPEC, _layer, _materialised, _metadata, _pools, _step  # noqa: E402

pytestmark = pytest.mark.unit

BS, UNIT = 8, 4
T = 1 + NUM_SPEC
CASES = [(running, a) for running in (9, 10, 11, 12, 14) for a in range(T)]
N = len(CASES)
STATE_IDX = 3  # window = table columns 3..6
# Per request 7 slots: col 1 (vLLM's block-8 boundary copy), col 2 (the block-4 reference's
# destination), cols 3..6 (the window), the snapshot block.  Slot 0 fills unused columns.
SLOTS = 1 + 7 * N


def _slot(i: int, j: int) -> int:
    return 1 + 7 * i + j


BLOCKS = torch.tensor([[0, _slot(i, 0), _slot(i, 1), *(_slot(i, 2 + j) for j in range(T)), 0] for i in range(N)],
                      dtype=torch.int32)
REF = [_slot(i, 1) for i in range(N)]
Z = [_slot(i, 6) for i in range(N)]


def _expected_col(running: int, a: int) -> int | None:
    b = (running + a) // UNIT * UNIT
    return b - running if b >= running and b % BS else None


def _context(layer, conv: torch.Tensor, ssm: torch.Tensor, block_size: int) -> mamba_utils.MambaSpecDecodeGPUContext:
    return align_context(layer, conv, ssm, N, block_size=block_size, blocks=BLOCKS, slots=SLOTS)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)  # bf16 bits: NaN == NaN


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not eot_spec_patched():
        pytest.skip("patch 0005 not applied (hyperharness patches apply --ensure)")
    interpret_mamba_kernels()


@pytest.mark.parametrize("runner", ["v1", "mrv2"])
def test_snapshot_equals_vllms_postprocess_and_lazy_equals_eager(runner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPERHARNESS_GDN_KERNEL", "torch")
    weights, conv0, ssm0 = _pools(seed=5)
    reps = -(-SLOTS // conv0.shape[0])
    conv = torch.cat([conv0 * (1 + r) for r in range(reps)])[:SLOTS]
    ssm = torch.cat([ssm0 * (1 - 0.5 * r) for r in range(reps)])[:SLOTS]
    targets = torch.tensor(REF + Z)
    conv[targets], ssm[targets] = float("nan"), float("nan")
    lazy, eager = _layer(False, weights, conv, ssm), _layer(True, weights, conv, ssm)
    lazy.hh_align_copies = eager.hh_align_copies = 0
    ctx_lazy = _context(lazy, conv, ssm, BS)
    ctx_eager = _context(types.SimpleNamespace(kv_cache=eager.kv_cache), conv, ssm, BS)  # no hook
    assert [x[0] for x in ctx_lazy.temporal_copy_layers] == [lazy] and not ctx_eager.temporal_copy_layers

    g = torch.Generator().manual_seed(3)
    windows = BLOCKS[:, STATE_IDX : STATE_IDX + T]
    for _ in range(2):  # the second step is the one whose acceptance is applied below
        md = _metadata(windows, [T] * N, [1] * N)
        x = torch.randn(N * T, DIM, generator=g).to(conv.dtype)
        b, a = (torch.randn(N * T, lazy.num_v_heads, generator=g).to(conv.dtype) for _ in range(2))
        assert torch.equal(_step(lazy, md, x, b, a), _step(eager, md, x, b, a))

    running = torch.tensor([r for r, _ in CASES], dtype=torch.int32)
    acc = torch.tensor([a + 1 for _, a in CASES], dtype=torch.int32)  # vLLM's num_accepted
    computed, scheduled, drafts = running - 1, torch.full((N,), T, dtype=torch.int32), torch.full((N,), NUM_SPEC, dtype=torch.int32)
    state_idx = torch.full((N,), STATE_IDX, dtype=torch.int32)

    # The reference before anyone copies: vLLM's postprocess with block size = unit.
    ref_conv, ref_ssm = eager.kv_cache[0].clone(), eager.kv_cache[1].clone()
    ctx_ref = _context(types.SimpleNamespace(kv_cache=[ref_conv, ref_ssm]), ref_conv, ref_ssm, UNIT)
    ctx_ref.run_fused_postprocess(N, acc, state_idx, scheduled, computed, drafts)

    perm = torch.arange(N - 1, -1, -1, dtype=torch.int32)  # MRV2: batch row -> request slot
    for ctx in (ctx_lazy, ctx_eager):
        if runner == "v1":
            ctx.run_fused_postprocess(N, acc, state_idx, scheduled, computed, drafts)
            ctx.mamba_state_idx_buf.gpu[:N] = state_idx
            ctx.num_computed_tokens_buf.gpu[:N] = computed
            ctx.num_scheduled_tokens_buf.gpu[:N] = scheduled
            ctx.num_draft_tokens_buf.gpu[:N] = drafts
            out = types.SimpleNamespace(mamba_eot_snapshot_blocks={f"r{i}": {0: Z[i]} for i in range(N)},
                                        mamba_eot_snapshot_unit=UNIT)
            mamba_utils.postprocess_eot_snapshot_v1(ctx, out, [f"r{i}" for i in range(N)], N, acc)
        else:
            new = computed + scheduled - drafts + acc - 1
            ctx.run_fused_postprocess_align(N, acc.clone(), state_idx, new, perm)
            blocks = torch.tensor([[Z[int(s)]] for s in perm], dtype=torch.int32)  # batch order
            ctx.run_eot_snapshot(N, blocks, ctx.num_accepted_tokens_out, state_idx, new, UNIT, perm)

    copied = [i for i, (r, a) in enumerate(CASES) if _expected_col(r, a) is not None]
    cols = {_expected_col(*CASES[i]) for i in copied}
    assert cols == set(range(T)) and len(copied) < N  # every column, and rows that do not copy
    # Hook calls: every snapshot, plus vLLM's own block-8 boundary copies (running 14, new >= 16).
    boundary_rows = sum((r + a) // BS * BS >= r for r, a in CASES)
    assert boundary_rows == 2 and lazy.hh_align_copies == len(copied) + boundary_rows
    for i in range(N):
        z = Z[i]
        for eager_pool, lazy_pool in zip(eager.kv_cache, lazy.kv_cache, strict=True):
            assert torch.equal(_bits(lazy_pool[z]), _bits(eager_pool[z])), (CASES[i], "lazy != eager")
        if i in copied:
            assert torch.equal(_bits(eager.kv_cache[0][z]), _bits(ref_conv[REF[i]])), (CASES[i], "conv")
            assert torch.equal(_bits(eager.kv_cache[1][z]), _bits(ref_ssm[REF[i]])), (CASES[i], "temporal")
            assert not torch.isnan(eager.kv_cache[1][z].float()).any()
        else:
            assert torch.isnan(eager.kv_cache[0][z].float()).all() and torch.isnan(eager.kv_cache[1][z].float()).all()
    # Conv copies are vLLM's in both; the lazy windows kept their base and log.
    assert torch.equal(_bits(lazy.kv_cache[0]), _bits(eager.kv_cache[0]))
    acc_out = ctx_eager.num_accepted_tokens_out[:N].tolist()
    assert torch.equal(_materialised(lazy, windows, acc_out), _materialised(eager, windows, acc_out))
