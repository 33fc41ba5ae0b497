"""kernels.verify_attention against its fp32 reference.

Without CUDA the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1) on small odd
shapes; with CUDA the same cases run compiled, plus the real shapes (Qwen3.8-27B attention and
the DFlash2 drafter's sliding-window layers). Outputs are pre-filled with NaN.

Tolerance, relative Frobenius error ||out - ref|| / ||ref||:
* fp16 q/out: 2e-3 (fp16 operands, fp32 accumulation; measured about 4e-4).
* bf16 q/out: 1e-2. The output's own bf16 rounding is about 1.7e-3; the interpreter rounds
  fp32 -> bf16 less accurately (measured 3.3e-3 there; 1.6e-3 to 1.75e-3 on the H200).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    # Must be set before the kernels are decorated (first import of the kernel module).
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from kernels.verify_attention import (  # noqa: E402
    make_int8_kv_cache,
    naive_verify_attention,
    verify_attention,
    write_int8_kv,
)

pytestmark = pytest.mark.kernels
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (real shapes)")


def build_problem(seq_lens, q_lens, hq, hkv, d, page, dtype, device=DEVICE, seed=0):
    """A paged cache filled through vLLM's quantisation, shuffled pages, and queries."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [-(-n // page) for n in seq_lens]
    cache = make_int8_kv_cache(sum(blocks) + 3, page, hkv, d, device)
    cache.raw.as_strided((cache.raw.untyped_storage().nbytes(),), (1,)).fill_(0x55)
    perm = torch.randperm(sum(blocks) + 3, generator=gen)
    block_table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        block_table[i, :n] = perm[used : used + n].int()
        used += n
    block_table = block_table.to(device)
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n, device=device)
        slots = block_table[i, pos // page].long() * page + pos % page
        # Keys with a few large channels, like real post-RoPE keys; unit-scale values.
        key = torch.randn(n, hkv, d, generator=gen).to(device)
        key[..., :4] *= 8
        value = torch.randn(n, hkv, d, generator=gen).to(device)
        write_int8_kv(cache, key, value, slots)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(device, dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return cache, block_table, cu.to(device), seq, q


def run_case(seq_lens, q_lens, hq, hkv, d, page, dtype, window=(-1, -1), num_splits=None, **cuda_kw):
    """One call against the reference: the public path, or with ``cuda_kw`` the CUDA launcher with
    those choices of its rule forced (cuda.verify_attention_cuda: decode, sched, combine_kernel, pdl)."""
    cache, bt, cu, seq, q = build_problem(seq_lens, q_lens, hq, hkv, d, page, dtype)
    out = torch.full_like(q, float("nan"))
    if cuda_kw:
        from kernels.verify_attention import cuda as va_cuda

        va_cuda.verify_attention_cuda(q, cache.k, out, cu, max(q_lens), seq, max(seq_lens), d**-0.5,
                                      window[0] + 1 if window[0] >= 0 else 0, bt, num_splits, **cuda_kw)  # fmt: skip
    else:
        verify_attention(
            q, cache.k, cache.v, out, cu, max(q_lens), seq, max(seq_lens), None, window, bt,
            cache.k_scale, cache.v_scale, num_splits=num_splits,
        )  # fmt: skip
    ref = naive_verify_attention(q, cache, cu, seq, bt, window_size=window)
    assert not torch.isnan(out).any(), "unwritten (NaN) output rows"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"rel err {err:.2e}")
    assert err < TOL[dtype], f"relative error {err:.3e} >= {TOL[dtype]}"
    return err


# (seq_lens, q_lens, Hq, Hkv, D, page, window, splits): small odd shapes for the interpreter.
SMALL = [
    pytest.param([37, 70, 5], [9, 16, 1], 6, 2, 32, 16, (-1, -1), 1, id="B3-T9,16,1-G3-D32-S1"),
    pytest.param([37, 70, 5], [9, 16, 1], 6, 2, 32, 16, (-1, -1), 3, id="B3-T9,16,1-G3-D32-S3"),
    pytest.param([129], [1], 6, 2, 64, 16, (-1, -1), None, id="B1-T1-L129-D64-auto"),
    pytest.param([300, 45], [9, 3], 4, 2, 32, 16, (63, 0), 4, id="B2-T9,3-window64-S4"),
    pytest.param([1700, 33], [16, 1], 6, 2, 32, 1616, (-1, -1), 4, id="B2-T16,1-P1616-S4"),
    pytest.param([50], [40], 6, 1, 16, 32, (-1, -1), 2, id="B1-T40-G6-qtiles-S2"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("seq_lens", "q_lens", "hq", "hkv", "d", "page", "window", "splits"), SMALL)
def test_matches_reference(seq_lens, q_lens, hq, hkv, d, page, window, splits, dtype):
    run_case(seq_lens, q_lens, hq, hkv, d, page, dtype, window, splits)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter only")
def test_interpreter_casts_int8_to_fp16_exactly():
    """The kernel converts int8 -> fp16 (the interpreter of Triton 3.6/3.9 gets int8 -> bf16 wrong)."""
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y_ptr + o, tl.load(x_ptr + o).to(tl.float16))

    x = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    y = torch.empty(256, dtype=torch.float16)
    cast[(1,)](x, y, N=256)
    assert torch.equal(y.float(), x.float())


def test_rejects_bad_inputs():
    cache, bt, cu, seq, q = build_problem([20], [2], 4, 2, 32, 16, torch.float16)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="int32"):
        verify_attention(q, cache.k, cache.v, out, cu.long(), 2, seq, 20, None, (-1, -1), bt,
                         cache.k_scale, cache.v_scale)  # fmt: skip
    with pytest.raises(ValueError, match="head size"):
        verify_attention(q[..., :24], cache.k, cache.v, out[..., :24], cu, 2, seq, 20, None,
                         (-1, -1), bt, cache.k_scale, cache.v_scale)  # fmt: skip


REAL = [
    # Qwen3.8-27B attention: 24 q heads, 4 KV heads, D=256; mixed lengths, page 16.
    pytest.param([100_003, 31_999, 8_191, 1], [9, 9, 16, 1], 24, 4, 256, 16, (-1, -1), None,
                 id="qwen-B4-mixed-P16"),
    pytest.param([100_000], [8], 24, 4, 256, 16, (-1, -1), None, id="qwen-B1-T8-100K"),
    pytest.param([100_000], [1], 24, 4, 256, 16, (-1, -1), None, id="qwen-B1-T1-100K"),
    pytest.param([65_537, 4_000], [16, 8], 24, 4, 256, 1616, (-1, -1), None, id="qwen-P1616"),
    pytest.param([100_000, 3_000], [9, 9], 24, 4, 256, 16, (-1, -1), 7, id="qwen-S7"),
    # DFlash2 drafter sliding-window layers: 8 KV heads x 128, window 2,048.
    pytest.param([5_000, 2_100, 300], [8, 8, 1], 32, 8, 128, 16, (2047, 0), None,
                 id="drafter-swa2048"),
]  # fmt: skip


@gpu_only
@pytest.mark.parametrize(("seq_lens", "q_lens", "hq", "hkv", "d", "page", "window", "splits"), REAL)
def test_real_shapes(seq_lens, q_lens, hq, hkv, d, page, window, splits):
    run_case(seq_lens, q_lens, hq, hkv, d, page, torch.bfloat16, window, splits)


def spy_compiled(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernel variants the CUDA launcher looks up from now on, in call order."""
    from kernels.verify_attention import cuda as va_cuda

    calls: list[str] = []
    real = va_cuda._compiled

    def spy(name, smem):
        calls.append(name)
        return real(name, smem)

    monkeypatch.setattr(va_cuda, "_compiled", spy)
    return calls


@gpu_only
def test_real_shapes_decode_rule(monkeypatch):
    """The launcher's decode rule at plain decode (T=1: 6 rows per KV head): verify_attn_decode from
    DECODE_MIN_KEYS keys of the longest request, the wgmma kernel below (and everywhere with
    decode=False); each matches the reference at 100K."""
    use_cuda_kernel(monkeypatch)
    from kernels.verify_attention import cuda as va_cuda

    calls = spy_compiled(monkeypatch)
    for lens, want in (([va_cuda.DECODE_MIN_KEYS, 700], "verify_attn_decode"),
                       ([va_cuda.DECODE_MIN_KEYS - 1, 700], "verify_attn_split_wg"),
                       ([100_000], "verify_attn_decode")):
        calls.clear()
        run_case(lens, [1] * len(lens), 24, 4, 256, 16, torch.bfloat16, (-1, -1), None)
        assert calls[0].startswith(want + "<"), (lens, calls)
    calls.clear()
    run_case([100_000], [1], 24, 4, 256, 16, torch.bfloat16, (-1, -1), None, decode=False)
    assert calls[0].startswith("verify_attn_split_wg<"), calls


# The CUDA kernel (sm_90, D in {128, 256}) on odd shapes: contexts not a multiple of the page or
# of its 64-key tile, T = 1 / 9 / 16 / 40 (several query tiles), mixed lengths, page 1616,
# sliding windows, one split (direct output) and several (partials + combine), empty splits.
CUDA_CASES = [
    pytest.param([37, 70, 5], [9, 16, 1], 24, 4, 256, 16, (-1, -1), 1, id="B3-T9,16,1-S1"),
    pytest.param([37, 70, 5], [9, 16, 1], 24, 4, 256, 16, (-1, -1), 3, id="B3-T9,16,1-S3"),
    pytest.param([129], [1], 24, 4, 256, 16, (-1, -1), None, id="B1-T1-L129-auto"),
    pytest.param([3001, 45], [9, 3], 32, 8, 128, 16, (63, 0), 4, id="D128-window64-S4"),
    pytest.param([5000, 2100, 300], [8, 8, 1], 32, 8, 128, 16, (2047, 0), None, id="D128-w2048"),
    pytest.param([1700, 33], [16, 1], 24, 4, 256, 1616, (-1, -1), 4, id="P1616-T16,1-S4"),
    pytest.param([5000, 77], [16, 9], 24, 4, 256, 16, (-1, -1), None, id="T16,9-auto"),
    pytest.param([1000, 40], [40, 1], 24, 4, 256, 16, (-1, -1), 5, id="T40-qtiles-S5"),
    pytest.param([200, 90], [3, 2], 24, 4, 256, 16, (-1, -1), 40, id="empty-splits-S40"),
    pytest.param([4099], [5], 8, 4, 128, 16, (-1, -1), 2, id="G2-D128-S2"),
    pytest.param([20000, 9000], [8, 1], 24, 4, 256, 16, (-1, -1), 150, id="S150-combine-2-batches"),
]  # fmt: skip


def use_cuda_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip off sm_90; else force the CUDA backend (an error if it would fall back)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the CUDA kernel runs on sm_90")
    monkeypatch.setenv("HH_VERIFY_ATTENTION_BACKEND", "cuda")


@gpu_only
@pytest.mark.parametrize("sched", ["dyn", "static"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("seq_lens", "q_lens", "hq", "hkv", "d", "page", "window", "splits"), CUDA_CASES)
def test_cuda_matches_reference(seq_lens, q_lens, hq, hkv, d, page, window, splits, dtype, sched, monkeypatch):
    """The wgmma kernel with tiles from the per-unit counter (dyn) and with static splits, the
    partials merged by the rule's combine kernel."""
    use_cuda_kernel(monkeypatch)
    run_case(seq_lens, q_lens, hq, hkv, d, page, dtype, window, splits, decode=False, sched=sched)


# The row, column and warp combines apply where >= 32 splits are merged: the two many-split cases
# (S150: three chunks of the row combine) and the 100K batch-1 shapes (66 splits).
MANY_SPLIT_CASES = [c for c in CUDA_CASES if c.id in ("empty-splits-S40", "S150-combine-2-batches")] + [
    c for c in REAL if c.id in ("qwen-B1-T8-100K", "qwen-B1-T1-100K")
]
ROW_COMBINE_CASES = MANY_SPLIT_CASES + [
    pytest.param([20000, 700], [8, 1], 32, 8, 128, 16, (-1, -1), 40, id="D128-S40"),
]


@gpu_only
@pytest.mark.parametrize("sched", ["dyn", "static"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("seq_lens", "q_lens", "hq", "hkv", "d", "page", "window", "splits"), ROW_COMBINE_CASES)
def test_cuda_row_combine(seq_lens, q_lens, hq, hkv, d, page, window, splits, dtype, sched, monkeypatch):
    """verify_attn_combine_r (CTA per row, coalesced) merges the wgmma kernel's partials."""
    use_cuda_kernel(monkeypatch)
    run_case(seq_lens, q_lens, hq, hkv, d, page, dtype, window, splits, decode=False, sched=sched,
             combine_kernel="row")  # fmt: skip


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("seq_lens", "q_lens", "hq", "hkv", "d", "page", "window", "splits"), ROW_COMBINE_CASES)
def test_cuda_col_combine(seq_lens, q_lens, hq, hkv, d, page, window, splits, dtype, monkeypatch):
    """verify_attn_combine_c (CTA per row and 64-dim column block) after the wgmma kernel (the
    decode kernel's own cases run it by the rule: test_cuda_decode_kernel)."""
    use_cuda_kernel(monkeypatch)
    run_case(seq_lens, q_lens, hq, hkv, d, page, dtype, window, splits, decode=False, combine_kernel="col")


W_COMBINE_CASES = MANY_SPLIT_CASES + [
    pytest.param([20000, 9000], [8, 1], 24, 4, 256, 16, (-1, -1), 300, id="S300-rule-w"),
]


@gpu_only
@pytest.mark.parametrize("sched", ["dyn", "static"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("seq_lens", "q_lens", "hq", "hkv", "d", "page", "window", "splits"), W_COMBINE_CASES)
def test_cuda_w_combine(seq_lens, q_lens, hq, hkv, d, page, window, splits, dtype, sched, monkeypatch):
    """verify_attn_combine_w (a warp per row x 8 dims, lane = split): the rule past 256 splits
    (S300), forced on the other many-split cases."""
    use_cuda_kernel(monkeypatch)
    kw = {} if splits is not None and splits > 256 else {"combine_kernel": "w"}  # None: 66 splits at 100K b1
    run_case(seq_lens, q_lens, hq, hkv, d, page, dtype, window, splits, decode=False, sched=sched, **kw)


PDL_CASES = [c for c in CUDA_CASES if c.id in ("B3-T9,16,1-S3", "D128-w2048", "empty-splits-S40")]


@gpu_only
@pytest.mark.parametrize(("seq_lens", "q_lens", "hq", "hkv", "d", "page", "window", "splits"), PDL_CASES)
def test_cuda_pdl_combine(seq_lens, q_lens, hq, hkv, d, page, window, splits, monkeypatch):
    """The combine after the wgmma kernel launched with programmatic dependent launch (the rule
    uses it after the decode kernel)."""
    use_cuda_kernel(monkeypatch)
    run_case(seq_lens, q_lens, hq, hkv, d, page, torch.bfloat16, window, splits, decode=False, pdl=True)


@gpu_only
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_cuda_dyn_graph_replay(pdl, monkeypatch):
    """Tile counters are back at zero after every launch, so CUDA-graph replays stay correct."""
    use_cuda_kernel(monkeypatch)
    from kernels.verify_attention import cuda as va_cuda

    cache, bt, cu, seq, q = build_problem([3001, 700, 64], [8, 1, 3], 24, 4, 256, 16, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    ref = naive_verify_attention(q, cache, cu, seq, bt)

    def call():
        va_cuda.verify_attention_cuda(q, cache.k, out, cu, 8, seq, 3001, 256**-0.5, 0, bt,
                                      num_splits=7, sched="dyn", pdl=pdl)  # fmt: skip

    call()  # eager: compiles, allocates the counters
    replay_and_check(call, out, ref)


def replay_and_check(call, out, ref, replays=3):
    """Capture call() (already run once eagerly) in a CUDA graph and replay it into a NaN-filled
    out: each replay matches ref and leaves the per-device tile counters at zero."""
    from kernels.verify_attention import cuda as va_cuda

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(replays):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < TOL[torch.bfloat16], err
        assert int(va_cuda._COUNTERS[torch.cuda.current_device()].abs().sum()) == 0


def test_cuda_ring_depth():
    """Two CTAs per SM: 2 stages at 48 query rows, 3 at one n8 tile of rows (D = 256)."""
    from kernels.verify_attention.cuda import pick_stages, smem_bytes_wg

    assert smem_bytes_wg(256, 6, 2) == 99_296  # ring, Q, P, maxima / sums, tile index ring
    assert pick_stages(256, 6, smem_bytes_wg) == 2
    assert pick_stages(256, 1, smem_bytes_wg) == 3
    assert pick_stages(128, 4, smem_bytes_wg) == 4


def test_cuda_split_rule():
    """CUDA split rule at 132 SMs, two CTAs each: one full wave at batch 1, whole waves at 4."""
    from kernels.verify_attention.cuda import num_splits_for

    assert num_splits_for(1, 4, 1, 100_000, 132) == 66  # 264 CTAs, 24 tiles each
    assert num_splits_for(4, 4, 1, 100_000, 132) == 16  # 256 CTAs (33: 528 CTAs costs the same)
    assert num_splits_for(1, 4, 2, 100_000, 132) == 33  # T=16: two query tiles
    assert num_splits_for(1, 4, 1, 300, 132) == 2  # at least 4 tiles of 64 keys per split


def test_default_split_rule(monkeypatch):
    """The split rule at the H200's 132 SMs (sweep in kernels/verify_attention/NOTES.md)."""
    from types import SimpleNamespace

    from kernels.verify_attention.triton import default_num_splits

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda")
    assert default_num_splits(1, 4, 1, 100_000, cuda) == 66  # fills the GPU twice
    assert default_num_splits(4, 4, 1, 100_000, cuda) == 33  # floor (was 17)
    assert default_num_splits(8, 4, 1, 100_000, cuda) == 33  # floor (was 9)
    assert default_num_splits(4, 4, 1, 100_000, cuda, windowed=True) == 17  # no floor with a window
    assert default_num_splits(4, 4, 1, 2_000, cuda) == 8  # one split per 256 keys at most


def test_combine_rule():
    """Which combine merges 32..256 splits, and with PDL or not (no GPU needed): col + PDL after the
    decode kernel, row without PDL after the wgmma kernel; the column block divides both head sizes."""
    from kernels.verify_attention import cuda as vc

    assert vc.default_combine() == "row" and vc.default_combine(decode=True) == "col"
    assert not vc.default_pdl() and vc.default_pdl(decode=True)
    assert all(d % vc.COMBINE_COLS == 0 for d in vc.HEAD_SIZES)
    assert vc.default_sched(1) == "dyn" and vc.default_sched(2) == vc.default_sched(6) == "static"


# verify_attn_decode (forced on here; auto from 32K keys): query tiles of at most 8 rows. Contexts not a
# multiple of its 16-key chunk, windows starting inside a chunk, T=2 at G=4 (8 rows, causal within
# the block), page 1616, one split (each head's warps merge and write out), splits without keys,
# 150 splits (row combine), mixed lengths.
DECODE_CASES = [
    pytest.param([129], [1], 24, 4, 256, 16, (-1, -1), None, id="B1-T1-L129-auto"),
    pytest.param([37, 70, 5], [1, 1, 1], 24, 4, 256, 16, (-1, -1), 3, id="B3-mixed-S3"),
    pytest.param([3001, 45], [1, 1], 32, 8, 128, 16, (63, 0), 4, id="D128-window64-S4"),
    pytest.param([5000, 2100, 300], [2, 2, 1], 32, 8, 128, 16, (2047, 0), None, id="D128-G4-T2-w2048"),
    pytest.param([1700, 33], [1, 1], 24, 4, 256, 1616, (-1, -1), 4, id="P1616-S4"),
    pytest.param([200, 90], [1, 1], 24, 4, 256, 16, (-1, -1), 40, id="empty-splits-S40"),
    pytest.param([20000, 9001], [1, 1], 24, 4, 256, 16, (-1, -1), 150, id="S150-row-combine"),
    pytest.param([50001], [1], 24, 4, 256, 16, (-1, -1), None, id="L50001-auto"),
    pytest.param([4099], [2], 8, 4, 128, 16, (-1, -1), 2, id="G2-T2-D128-S2"),
]  # fmt: skip


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("seq_lens", "q_lens", "hq", "hkv", "d", "page", "window", "splits"), DECODE_CASES)
def test_cuda_decode_kernel(seq_lens, q_lens, hq, hkv, d, page, window, splits, dtype, monkeypatch):
    use_cuda_kernel(monkeypatch)
    run_case(seq_lens, q_lens, hq, hkv, d, page, dtype, window, splits, decode=True)


@gpu_only
def test_cuda_decode_graph_replay_and_selection(monkeypatch):
    """The decode kernel is what runs at <= 8 rows (its compiled variant is the one looked up),
    and CUDA-graph replays of it stay correct."""
    use_cuda_kernel(monkeypatch)
    from kernels.verify_attention import cuda as va_cuda

    cache, bt, cu, seq, q = build_problem([3001, 700, 64], [1, 1, 1], 24, 4, 256, 16, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    ref = naive_verify_attention(q, cache, cu, seq, bt)
    calls = spy_compiled(monkeypatch)

    def call():
        va_cuda.verify_attention_cuda(q, cache.k, out, cu, 1, seq, 3001, 256**-0.5, 0, bt, num_splits=7, decode=True)

    call()
    assert calls[0] == "verify_attn_decode<256, 6, 4, true>"
    replay_and_check(call, out, ref)  # the chunk-batch counters are reset by each launch


def test_decode_rule():
    """The decode kernel by key span (no GPU needed); its CTA's shared memory fits an SM, its
    split rule fills the GPU once."""
    from kernels.verify_attention import cuda as vc

    assert vc.default_decode(vc.DECODE_MIN_KEYS) and vc.default_decode(100_000)
    assert not vc.default_decode(vc.DECODE_MIN_KEYS - 1) and not vc.default_decode(2048 + 8)
    assert vc.pick_stages_decode(256, 4) == 6 and vc.pick_stages_decode(128, 8) == 6
    assert vc.smem_bytes_decode(256, 4, 6) == 6 * 33_280 + 4 * 4096 + 96 + 24  # ring, Q^T, barriers, indices
    assert vc.num_splits_decode(1, 100_000, 132) == 132 and vc.num_splits_decode(4, 100_000, 132) == 33
    assert vc.num_splits_decode(1, 300, 132) == 3  # at least 16 keys per stream
    for d, hkv in ((128, 8), (256, 4)):
        assert vc.smem_bytes_decode(d, hkv, vc.pick_stages_decode(d, hkv)) + 1024 <= vc.SHARED_PER_SM


def test_goal_layer_pools_fill_the_device():
    """bench.py --goal sizes its per-layer pools from the free memory: equal pools, the reserve kept,
    and a clear error when the goal rows would not fit (checked on CPU with an H200's numbers)."""
    from kernels.verify_attention.bench import GOAL_CASES as CASES
    from kernels.verify_attention.bench import layer_tokens, record_bytes

    assert record_bytes(4, 256) == 2080  # K int8 x 256 + fp32 scale + V + scale, 4 KV heads
    free, reserve = 140 * 10**9, 10 << 30
    tokens = layer_tokens(free, 16, reserve, 4, 256)
    assert 16 * tokens * 2080 <= free - reserve < 16 * (tokens + 1) * 2080
    assert tokens >= 4 * max(c[0] * c[2] for c in CASES)
    with pytest.raises(ValueError, match="too few"):
        layer_tokens(4 * 10**9, 16, 1 << 30, 4, 256)


def test_table_report_rows_against_their_own_vllm():
    """bench.report: a row's time is the median of its rounds, its speedup is against the same
    row's vLLM median (not another row's), and vLLM's own row has none."""
    from kernels.verify_attention.bench import Entry, report

    entries = [
        Entry("a", "vllm", print, 1000, 2e-3, [10.0, 12.0, 11.0]),
        Entry("a", "ours", print, 1000, 1e-3, [2.0, 1.0, 1.5]),
        Entry("b", "vllm", print, 1000, 2e-3, [40.0, 40.0, 40.0]),
        Entry("b", "ours", print, 1000, 1e-3, [4.0, 5.0, 4.0]),
    ]
    results: list[dict] = []
    report(entries, 1000.0, results)
    by = {r["case"]: r for r in results}
    assert by["a ours"]["us"] == 1.5 and by["a ours"]["speedup_vs_vllm"] == pytest.approx(11.0 / 1.5)
    assert by["b ours"]["speedup_vs_vllm"] == pytest.approx(10.0)
    assert "speedup_vs_vllm" not in by["a vllm"] and by["b ours"]["rounds"] == [4.0, 5.0, 4.0]
    assert by["a ours"]["GBps"] == pytest.approx(1000 / 1.5 / 1e3)
