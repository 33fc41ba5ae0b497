"""Child process of test_prepare_engine.py: load a prepared tiny-qwen-hybrid in vLLM (in process, CPU)
and compare what vLLM's layers compute against the original bf16 tensors.

    python -m tests.models.load_prepared PREPARED ORIGINAL  -> one JSON line on stdout
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(prepared: Path, original: Path) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the kernels registered here serve the engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("start with TRITON_INTERPRET=1 (the embedding kernel runs interpreted)")
    import torch

    from backend.models.safetensors_io import read_header, read_tensor
    from tests.models.cpu_int8 import interpret_embedding_kernel, register_reference_kernel

    register_reference_kernel()
    interpret_embedding_kernel()
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(prepared), max_model_len=1024, max_num_seqs=1, enforce_eager=True,
              dtype="bfloat16", mamba_ssm_cache_dtype="bfloat16", enable_prefix_caching=False)
    ids = [248045, 74455, 198, 248068, 198, 0, 1, 248319]
    gen = torch.Generator().manual_seed(0)

    def probe(model):  # runs on the worker: vLLM's own layers on the loaded weights
        hidden = model.config.hidden_size
        h = torch.randn(6, hidden, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            emb = model.embed_input_ids(torch.tensor(ids))
            logits = model.compute_logits(h)
        kinds = {"embed": type(model.model.embed_tokens.quant_method).__name__,
                 "lm_head": type(model.lm_head.quant_method).__name__,
                 "lm_head_kernel": type(getattr(model.lm_head.scheme, "kernel", None)).__name__}
        return emb.float(), h.float(), logits.float(), kinds

    emb, h, logits, kinds = llm.apply_model(probe)[0]
    files = {}
    for shard in sorted(original.glob("*.safetensors")):
        for name, info in read_header(shard)[0].items():
            files[name] = (shard, info)

    def tensor(name):
        shard, info = files[name]
        return read_tensor(shard, info).float()

    ref_emb = tensor("model.embed_tokens.weight")[ids]
    ref_logits = h @ tensor("lm_head.weight").T
    vocab = ref_logits.shape[1]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    out = llm.generate(["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"],
                       SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    return {"kinds": kinds, "embed_rel_error": rel(emb, ref_emb),
            "logits_rel_error": rel(logits[:, :vocab], ref_logits),
            "argmax_agree": float((logits[:, :vocab].argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "generated": list(out.token_ids)}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))), flush=True)
