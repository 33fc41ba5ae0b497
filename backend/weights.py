"""The bytes a checkpoint puts on a card, read from its safetensors headers (no tensor is loaded).

The pool check holds these beside the KV pool: a prepared checkpoint (int8 lm_head and embed_tokens,
backend/models/prepare.py) is counted at its prepared size, the download at its own. Tensors are
sorted by where the engine keeps them:
  layers      `[model.][language_model.]layers.N.*`, by N (pipeline stages split these)
  embed       `*embed_tokens*` outside the MTP head (Qwen3-Next / Qwen3.5 build it on every stage)
  head        `lm_head.*` and the final `norm` (the last stage)
  mtp         `mtp.*` (loaded only by the MTP drafter)
  skipped     the vision tower (`visual.*`; profiles serve --language-model-only)
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .models.safetensors_io import read_header

_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")


@dataclass(frozen=True)
class CheckpointWeights:
    layers: tuple[int, ...]  # bytes of layer i
    embed: int
    head: int  # lm_head + final norm
    mtp: int
    other: int  # anything else the target model loads
    skipped: int = 0
    source: str = ""
    files: tuple[str, ...] = field(default=(), repr=False)

    @property
    def total(self) -> int:
        return sum(self.layers) + self.embed + self.head + self.other

    def stage(self, start: int, end: int, *, first: bool, last: bool, with_mtp: bool = False) -> int:
        """Bytes on the pipeline stage holding layers [start, end). The embedding is on every stage:
        vLLM 0.32's Qwen3-Next / Qwen3.5 build embed_tokens unconditionally (a DFlash or MTP drafter on
        the last stage reads it there too)."""
        b = sum(self.layers[start:end]) + self.embed
        if first:
            b += self.other
        if last:
            b += self.head + (self.mtp if with_mtp else 0)
        return b


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def from_checkpoint(model_dir: Path) -> CheckpointWeights | None:
    """None when the directory holds no safetensors (not downloaded yet)."""
    files = shard_files(model_dir)
    if not files or not all(f.is_file() for f in files):
        return None
    per_layer: dict[int, int] = {}
    embed = head = mtp = other = skipped = 0
    for f in files:
        for name, info in read_header(f)[0].items():
            n = info.nbytes
            if name.startswith("mtp."):
                mtp += n
            elif "visual" in name.split(".")[:3] or name.startswith(("visual.", "model.visual.")):
                skipped += n
            elif (m := _LAYER.match(name)) is not None:
                per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + n
            elif "embed_tokens" in name:
                embed += n
            elif name.startswith("lm_head.") or re.match(r"^(?:model\.)?(?:language_model\.)?norm\.", name):
                head += n
            else:
                other += n
    count = max(per_layer) + 1 if per_layer else 0
    return CheckpointWeights(tuple(per_layer.get(i, 0) for i in range(count)), embed, head, mtp, other, skipped,
                             str(model_dir), tuple(f.name for f in files))


def total_bytes(model_dir: Path) -> int | None:
    """Every tensor of a checkpoint (a drafter: all of it goes on the card)."""
    files = shard_files(model_dir)
    if not files or not all(f.is_file() for f in files):
        return None
    return sum(i.nbytes for f in files for i in read_header(f)[0].values())
