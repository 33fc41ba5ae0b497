"""GDN lazy-commit override (kernels.gdn_verify): the routing rule and `install()`.

The kernel (kernels/gdn_verify) folds the previous verify step's accepted tokens into the base
state at the start of the next step instead of storing T per-token states per layer.
`install()` registers the out-of-tree `QwenGatedDeltaNetAttention` (gdn_layer.py, through
`PluggableLayer.register_oot`); the per-layer token log, parity and slot bookkeeping are in
gdn_lazy.py.  With a speculator and `--mamba-cache-mode align`, vLLM's align-mode copies read
column `num_accepted - 1` of a verify window as a materialised state: patch 0003 hands the GDN
temporal copies to the layer (`mamba_align_temporal_copy`); without it the layer refuses at model
construction.
"""
from __future__ import annotations

import os
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
    """Register the lazy-commit GDN layer (backend/plugin/gdn_layer.py) in this process.

    Without CUDA the kernel runs through Triton's interpreter, which must be switched on before
    kernels/ is imported: correct but slow, for CPU tests only.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from backend.plugin import cpu_align

        cpu_align.install()  # HYPERHARNESS_CPU_ALIGN_INTERPRET=1: align copies on CPU (cpu_align.py)
    from backend.plugin.gdn_layer import register_layer

    return register_layer()
