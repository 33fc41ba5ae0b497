"""Which tensors of a Qwen3.x hybrid checkpoint `models prepare` turns into int8, and the
`quantization_config` that tells vLLM so.

Three parts, named as in the real Qwen3-Next / Qwen3.5 checkpoints (either naming):
  lm_head       `lm_head.weight`                                  [vocab, hidden]
  embed_tokens  `model.embed_tokens.weight` or `model.language_model.embed_tokens.weight`
  mtp           the MTP head's linears: `mtp.fc`, `mtp.layers.N.self_attn.{q,k,v,o}_proj`,
                `mtp.layers.N.mlp.{gate,up,down}_proj` (dense) or `...mlp.shared_expert.*_proj` (MoE).
                Routed experts, router gates and norms stay as they are: vLLM runs routed experts
                through its fused-MoE path, which this recipe does not produce.

Each quantized module becomes one compressed-tensors config group (int8, group 128, symmetric,
weight-only, `pack-quantized`), targeted by a regex on vLLM's module name. Regexes, because vLLM
rewrites exact layer paths through each model class's name mapper (`model.language_model.` ->
`model.`, and the target model drops `mtp.` altogether) but leaves `re:` targets alone, so one
config serves the target model, its `*ForConditionalGeneration` wrapper and the MTP drafter.
An existing `ignore` entry that would shadow a new target is dropped (an exact name) or narrowed
with a negative look-ahead (a regex), so everything else it ignored stays ignored.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from .int8 import GROUP_SIZE, MAX_REL_ERROR, NUM_BITS

PARTS = ("lm_head", "embed_tokens", "mtp")

# vLLM module names (re.match, anchored at the start by vLLM); checkpoint names end in ".weight".
TARGETS = {
    "lm_head": r"(.*\.)?lm_head",
    "embed_tokens": r"(.*\.)?embed_tokens",
    "mtp": (r"mtp\.(fc|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
            r"|mlp\.shared_expert\.(gate|up|down)_proj))"),
}
GROUP_NAMES = {"lm_head": "hh_int8_lm_head", "embed_tokens": "hh_int8_embed_tokens", "mtp": "hh_int8_mtp"}
_MTP_FC = re.compile(r"mtp\.fc$")


@dataclass(frozen=True)
class Recipe:
    parts: tuple[str, ...] = PARTS
    keep_mtp_fc: bool = False  # the seeds' --keep-fc: mtp.fc stays in the model dtype
    group_size: int = GROUP_SIZE
    max_rel_error: float = MAX_REL_ERROR

    def __post_init__(self) -> None:
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")

    def as_dict(self) -> dict:
        return {"parts": list(self.parts), "keep_mtp_fc": self.keep_mtp_fc, "group_size": self.group_size,
                "num_bits": NUM_BITS, "symmetric": True, "max_rel_error": self.max_rel_error}


def part_of(tensor_name: str) -> str | None:
    """The part a checkpoint tensor belongs to (None: not a candidate)."""
    if not tensor_name.endswith(".weight"):
        return None
    module = tensor_name[: -len(".weight")]
    if module.startswith("mtp."):
        return "mtp" if re.fullmatch(TARGETS["mtp"], module) else None
    if "visual" in module:
        return None
    for part in ("lm_head", "embed_tokens"):
        if re.fullmatch(TARGETS[part], module):
            return part
    return None


def selected(tensor_name: str, recipe: Recipe) -> str | None:
    part = part_of(tensor_name)
    if part is None or part not in recipe.parts:
        return None
    if part == "mtp" and recipe.keep_mtp_fc and _MTP_FC.match(tensor_name[: -len(".weight")]):
        return None
    return part


def group_scheme(group_size: int, targets: list[str]) -> dict:
    """One compressed-tensors config group: int8 weight-only, symmetric, per group."""
    return {
        "targets": targets,
        "weights": {
            "num_bits": NUM_BITS, "type": "int", "symmetric": True, "strategy": "group",
            "group_size": group_size, "dynamic": False, "actorder": None, "observer": "minmax",
            "observer_kwargs": {},
        },
        "input_activations": None,
        "output_activations": None,
        "format": "pack-quantized",
    }  # fmt: skip


def _targets_for(part: str, modules: list[str], recipe: Recipe) -> list[str]:
    if part == "mtp":
        # Name the quantized MTP modules one by one: --keep-fc and an input dim off the group size
        # leave some MTP linears in the model dtype, which a regex over all of them would claim.
        return ["re:" + re.escape(m) + "$" for m in sorted(modules)]
    return ["re:" + TARGETS[part] + "$"]


def quantization_config(original: dict | None, quantized: dict[str, list[str]], recipe: Recipe) -> dict:
    """The checkpoint's quantization_config with our groups added (or a new one).

    quantized: part -> the checkpoint module names (no `.weight`) that were written in int8."""
    qc = copy.deepcopy(original) if original else None
    if qc is not None and qc.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"the checkpoint is quantized with {qc.get('quant_method')!r}; int8 heads are written as "
            "compressed-tensors config groups, which vLLM cannot combine with another method"
        )
    if qc is None:
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {},
              "ignore": [], "quantization_status": "compressed", "kv_cache_scheme": None}
    groups = qc.setdefault("config_groups", {})
    new_targets: list[str] = []
    for part in PARTS:
        modules = quantized.get(part) or []
        if not modules:
            continue
        targets = _targets_for(part, modules, recipe)
        groups[GROUP_NAMES[part]] = group_scheme(recipe.group_size, targets)
        new_targets += targets
    qc["ignore"] = _unshadow(qc.get("ignore") or [], new_targets,
                             [m for ms in quantized.values() for m in ms])
    return qc


def _unshadow(ignore: list[str], targets: list[str], modules: list[str]) -> list[str]:
    """Drop or narrow the ignore entries that match a module we quantized."""
    look_ahead = "|".join(f"(?:{t[3:].removesuffix('$')})" for t in targets)
    out = []
    for entry in ignore:
        if entry.startswith("re:"):
            pattern = entry[3:]
            if any(re.match(pattern, m) for m in modules):
                entry = f"re:(?!(?:{look_ahead})$)(?:{pattern})"
            out.append(entry)
        elif entry not in modules and not any(re.match(t[3:], entry) for t in targets):
            out.append(entry)
    return out
