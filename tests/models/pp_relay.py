"""Child of test_pp_relay.py: one pipeline stage of vLLM's Qwen3NextModel on CPU (patch 0007's relay).

    python -m tests.models.pp_relay MODEL_DIR OUT_DIR PP_SIZE RANK PORT

Builds vLLM's own Qwen3NextForCausalLM for tiny-qwen-hybrid inside a real vLLM distributed setup
(gloo, pipeline parallel over PP_SIZE processes), sets the drafter's aux layers the way the V2 model
runner does (the model's set_aux_hidden_state_layers, then verify_supports_aux_hidden_states_over_pp),
and runs the decoder's forward for a fixed batch. The decoder layers' token mixers need an engine's
attention metadata to run, so each layer of the stack is swapped for a fixed affine map of its
input (seeded by its index): what is under test is the stack around them, the stage split, the aux
capture, its packing into the intermediate tensors, vLLM's stage-to-stage send/recv, and the
collection on the last stage. The last stage (or the single one) saves its final hidden states and
aux states to OUT_DIR/stage{RANK}.pt.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

AUX_LAYERS = (1, 2, 3)  # captured after layers 0, 1 and 2: two on stage 0, one on stage 1 of two


def main(model_dir: Path, out: Path, size: int, rank: int, port: int) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    from torch import nn
    from vllm.config import CompilationConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import get_pp_group, init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import verify_supports_aux_hidden_states_over_pp

    class Affine(nn.Module):
        """Stands in for decoder layer i: (h, r) -> (h W_i + b_i, h + r), fixed by i."""

        use_attn_reduce_scatter_for_moe = False  # as the real layer without tensor parallel

        def __init__(self, index: int, hidden: int) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(1000 + index)
            self.w = torch.randn(hidden, hidden, generator=g) / hidden**0.5
            self.b = torch.randn(hidden, generator=g) * 0.1

        def forward(self, positions, hidden_states, residual):
            residual = hidden_states if residual is None else hidden_states + residual
            return hidden_states.float() @ self.w + self.b, residual

    config = VllmConfig(model_config=ModelConfig(model=str(model_dir), dtype="float32", enforce_eager=True),
                        parallel_config=ParallelConfig(pipeline_parallel_size=size),
                        compilation_config=CompilationConfig(mode=0))
    # vLLM's CPU worker names the ranks' shared-memory group by this before it starts the group (the
    # SHM communicator is used where vllm._C has init_shm_manager, i.e. on some CPUs only)
    os.environ.setdefault("VLLM_DIST_IDENT", str(port))
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=size, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=size, backend="gloo")
        model = Qwen3NextForCausalLM(vllm_config=config, prefix="")
        model.set_aux_hidden_state_layers(AUX_LAYERS)
        if size > 1:
            verify_supports_aux_hidden_states_over_pp(model, "dflash")  # raises without patch 0007
    inner = model.model
    hidden = inner.config.hidden_size
    for i in range(inner.start_layer, inner.end_layer):
        inner.layers[i] = Affine(i, hidden)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        inner.embed_tokens.weight.copy_(torch.randn(inner.embed_tokens.weight.shape, generator=g) * 0.02)
    ids = torch.tensor([3, 17, 248045, 42, 9, 100])
    positions = torch.arange(ids.numel())
    pp = get_pp_group()
    with torch.no_grad(), set_current_vllm_config(config):
        received = None if pp.is_first_rank else IntermediateTensors(pp.recv_tensor_dict())
        result = inner(ids, positions, received)
        if not pp.is_last_rank:
            assert isinstance(result, IntermediateTensors)
            pp.send_tensor_dict(result.tensors)
            return
    final, aux = result
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"hidden": final, "aux": list(aux), "sent_keys": sorted(received.tensors) if received else []},
               out / f"stage{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
