"""TRITON_ATTN verify override: multi-token verify batches on the int8 per-token-head cache go to
`kernels.verify_attention`; everything else stays on vLLM's `unified_attention`.

vLLM 0.32.0's `TritonAttentionImpl.forward` ends in one call to the module-level name
`unified_attention` (v1/attention/backends/triton_attn.py:665), whose 3D split-KV path is off
whenever `max_seqlen_q > 1` (triton_unified_attention.py:1054): a k=7 verify at 100K context runs
~20 CTAs over the whole cache. Rebinding that one name to `routed_unified_attention` keeps the
backend's metadata, KV write, CUDA-graph support and name (`TRITON_ATTN`) untouched; the router
decides per call, from the call's own arguments, so it also holds under graph capture (the
decision is made at capture time for that batch shape and baked into the graph).
"""
from __future__ import annotations

from typing import Any

# Features of the upstream call that our kernel does not implement: any of them set means upstream.
_UNSUPPORTED_WHEN_SET = (
    "alibi_slopes", "q_descale", "k_descale", "v_descale", "sinks", "output_scale",
    "mm_prefix_range", "rswa_prefix_lens", "rswa_window", "qq_bias",
)  # fmt: skip


def route_to_verify_kernel(call: dict[str, Any], max_verify_tokens: int) -> bool:
    """Pure routing rule (unit-tested on CPU): does this unified_attention call go to our kernel?

    Yes only for int8 per-token-head caches, 1 < max_seqlen_q <= max_verify_tokens (verify, or a
    tiny prefill chunk, which the kernel also computes exactly), plain causal attention, no
    soft-cap, no chunked-local lookback and none of the extras above. Sliding windows are
    supported by the kernel (window_size = (W - 1, 0)).
    """
    mode = call.get("kv_quant_mode")
    if getattr(mode, "name", mode) != "INT8_PER_TOKEN_HEAD":
        return False
    if not 1 < int(call.get("max_seqlen_q", 0)) <= max_verify_tokens:
        return False
    if call.get("causal") is not True:  # a per-sequence causal tensor or non-causal: upstream
        return False
    if call.get("softcap") or call.get("chunk_lookback", -1) != -1 or call.get("use_alibi_sqrt"):
        return False
    if call.get("k_scale_cache") is None or call.get("v_scale_cache") is None:
        return False
    if call.get("use_td") or call.get("mm_prefix_clamp_sliding_window"):
        return False
    window = call.get("window_size")
    if window is not None and tuple(window)[1] not in (-1, 0):
        return False
    return all(call.get(name) is None for name in _UNSUPPORTED_WHEN_SET)


def make_router(upstream: Any, kernel: Any, max_verify_tokens: int) -> Any:
    def routed_unified_attention(**call: Any) -> Any:
        if not route_to_verify_kernel(call, max_verify_tokens):
            return upstream(**call)
        window = call.get("window_size")
        return kernel(
            q=call["q"], k=call["k"], v=call["v"], out=call["out"],
            cu_seqlens_q=call["cu_seqlens_q"], max_seqlen_q=call["max_seqlen_q"],
            seqused_k=call["seqused_k"], max_seqlen_k=call["max_seqlen_k"],
            softmax_scale=call["softmax_scale"],
            window_size=tuple(window) if window is not None else (-1, -1),
            block_table=call["block_table"],
            k_scale_cache=call["k_scale_cache"], v_scale_cache=call["v_scale_cache"],
        )  # fmt: skip

    routed_unified_attention.hyperharness = True  # type: ignore[attr-defined]
    return routed_unified_attention


def install(max_verify_tokens: int) -> bool:
    """Rebind TRITON_ATTN's `unified_attention` (idempotent). CUDA workers only (caller checks)."""
    import vllm.v1.attention.backends.triton_attn as triton_attn

    upstream = getattr(triton_attn, "unified_attention")  # noqa: B009 - not re-exported
    if getattr(upstream, "hyperharness", False):
        return True
    from kernels.verify_attention import split_kv_verify_attention

    router = make_router(upstream, split_kv_verify_attention, max_verify_tokens)
    setattr(triton_attn, "unified_attention", router)  # noqa: B010 - rebinding a module global
    return True
