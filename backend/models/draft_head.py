"""A prepared checkpoint plus the MTP drafter's head over a draft vocabulary (draft_vocab.py).

`add_draft_head(prepared, vocab, target)` writes `target`: every file of `prepared` hard-linked, and
  model-mtp-draft-vocab.safetensors   mtp.draft_lm_head.{weight_packed, weight_scale, weight_shape}
                                      (the vocabulary's rows of the int8 lm_head, copied as packed:
                                      packing runs along the hidden dim, so rows slice as they are;
                                      `.weight` rows when lm_head is not quantized) and
                                      mtp.draft_vocab_ids int64 [N]
  config.json                         + `mtp_draft_vocab_size` (and in text_config), + the draft head
                                      in the lm_head's int8 group
  draft_vocab.json                    the vocabulary and its coverage
Patch 0008 makes vLLM's MTP drafter score these rows only. Rows stream through in chunks of lm_head.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from .cache import MANIFEST, build_lock, fresh_staging, publish, sha256_file
from .heads import GROUP_NAMES
from .prepare import INDEX, link_file
from .safetensors_io import Planned, StreamWriter, TensorInfo, read_header, read_rows

SHARD = "model-mtp-draft-vocab.safetensors"
VOCAB = "draft_vocab.json"
PREFIX = "mtp.draft_lm_head"
ROWS_PER_READ = 4096


def _lm_head(prepared: Path) -> tuple[dict[str, tuple[Path, TensorInfo]], bool]:
    index = json.loads((prepared / INDEX).read_text())["weight_map"]
    names = [n for n in index if n.startswith("lm_head.")]
    found = {}
    for n in names:
        f = prepared / index[n]
        found[n.removeprefix("lm_head.")] = (f, read_header(f)[0][n])
    if "weight_packed" in found:
        return found, True
    if "weight" in found:
        return found, False
    raise ValueError(f"{prepared}: no lm_head.weight or lm_head.weight_packed in its index")


def _rows(path: Path, info: TensorInfo, ids: list[int]) -> Iterator[torch.Tensor]:
    """The `ids` rows of a tensor (ids ascending), chunk by chunk: yields [k, ...] tensors in order."""
    i = 0
    rows = info.shape[0]
    for r0 in range(0, rows, ROWS_PER_READ):
        r1 = min(rows, r0 + ROWS_PER_READ)
        j = i
        while j < len(ids) and ids[j] < r1:
            j += 1
        if j > i:
            block = read_rows(path, info, r0, r1)
            yield block[torch.tensor(ids[i:j]) - r0].contiguous()
        i = j


def add_draft_head(prepared: Path, vocab: dict, target: Path) -> Path:
    ids = list(vocab["ids"])
    if ids != sorted(set(ids)):
        raise ValueError("draft vocabulary ids must be unique and ascending")
    head, quantized = _lm_head(prepared)
    parts = ("weight_packed", "weight_scale") if quantized else ("weight",)
    with build_lock(target):
        staging = fresh_staging(target)
        planned = [Planned(f"{PREFIX}.{p}", head[p][1].dtype, (len(ids), *head[p][1].shape[1:])) for p in parts]
        if quantized:
            planned.append(Planned(f"{PREFIX}.weight_shape", "I64", (2,)))
        planned.append(Planned("mtp.draft_vocab_ids", "I64", (len(ids),)))
        writer = StreamWriter(staging / SHARD, planned, metadata={"format": "pt"})
        try:
            for p in parts:
                for block in _rows(*head[p], ids):
                    writer.write(f"{PREFIX}.{p}", block)
            if quantized:
                hidden = int(read_rows(*head["weight_shape"], 0, 2)[1])
                writer.write(f"{PREFIX}.weight_shape", torch.tensor([len(ids), hidden], dtype=torch.int64))
            writer.write("mtp.draft_vocab_ids", torch.tensor(ids, dtype=torch.int64))
            shard_hash = writer.close()
        except BaseException:
            writer.abort()
            raise
        manifest = json.loads((prepared / MANIFEST).read_text())
        files = {}
        for f in sorted(prepared.iterdir()):
            if f.name in ("config.json", INDEX, MANIFEST) or f.name.startswith(".") or not f.is_file():
                continue
            link_file(f, staging / f.name)
            files[f.name] = manifest["files"].get(f.name) or sha256_file(staging / f.name)
        files[SHARD] = shard_hash
        config = json.loads((prepared / "config.json").read_text())
        config["mtp_draft_vocab_size"] = len(ids)
        if isinstance(config.get("text_config"), dict):  # Qwen3.5: the MTP drafter reads the text config
            config["text_config"]["mtp_draft_vocab_size"] = len(ids)
        group = (config.get("quantization_config") or {}).get("config_groups", {}).get(GROUP_NAMES["lm_head"])
        if quantized and group is not None:
            group["targets"] = sorted(set(group["targets"]) | {"re:" + re.escape(PREFIX) + "$"})
        index = json.loads((prepared / INDEX).read_text())
        index["weight_map"].update({p.name: SHARD for p in planned})
        for name, data in (("config.json", config), (INDEX, index), (VOCAB, vocab)):
            (staging / name).write_text(json.dumps(data, indent=2) + "\n")
            files[name] = sha256_file(staging / name)
        meta = {**manifest.get("meta", {}), "draft_vocab": {"size": len(ids), **vocab.get("coverage", {})}}
        manifest = {"meta": meta, "files": dict(sorted(files.items()))}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        publish(staging, target)
    return target
