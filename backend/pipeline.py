"""Pipeline parallel over several cards: which layers each stage holds and what its pool must carry.

vLLM 0.32.0 with `--pipeline-parallel-size P`:
- stage r holds layers [start_r, end_r): an even split, the remainder spread over all stages but the
  last, or `VLLM_PP_LAYER_PARTITION` from the profile's env (distributed/utils.py get_pp_indices);
- the speculator (DFlash2's five sliding-window layers) lives on the last stage only, which receives the
  target's hidden states of the drafter's layers from earlier stages (patch 0007);
- KV-cache groups are formed over the whole model, each group taking every n-th layer of its kind
  (`layers[i::n]`, kv_cache_utils._get_kv_cache_groups_uniform_page_size), so a stage's share of a
  group is its layers among those; a block id costs a stage (its fullest group's layers) × page, every
  stage allocates `kv_cache_memory_bytes` // that, and the engine keeps the smallest count
  (get_kv_cache_configs, step 5). The pool is that many block ids.
The worst case held against it is the single-card one in block ids: one request at max context in
every attention group, the other seats one block each, every seat's state pages in every GDN group and
its drafter window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 1 << 30


def stage_layers(num_layers: int, size: int, partition: str | None = None) -> list[tuple[int, int]]:
    """[start, end) of every stage, as vLLM's get_pp_indices."""
    if partition:
        parts = [int(x) for x in partition.split(",")]
        if len(parts) != size or sum(parts) != num_layers:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION={partition!r}: needs {size} counts summing to {num_layers}")
    else:
        parts = [num_layers // size] * size
        for i in range(2, num_layers % size + 2):
            parts[-i] += 1
    starts = [sum(parts[:r]) for r in range(size)]
    return [(s, s + p) for s, p in zip(starts, parts, strict=True)]


def _groups(layers: list[int], count: int) -> list[list[int]]:
    """vLLM's assignment of one kind's layers to its `count` groups: layers[i::count]."""
    return [layers[i::count] for i in range(count)] if count else []


@dataclass(frozen=True)
class Stage:
    index: int
    start: int
    end: int
    attn_layers: int
    gdn_layers: int
    drafter: bool
    group_layers: int  # the fullest KV-cache group's layers on this stage
    block_bytes: int  # one block id on this stage
    budget_bytes: int
    weight_bytes: int | None  # from the checkpoint's headers (prepared sizes), None if not local

    @property
    def blocks(self) -> int:
        return self.budget_bytes // self.block_bytes if self.block_bytes else 0


@dataclass(frozen=True)
class PipelinePool:
    stages: tuple[Stage, ...]
    block_size: int
    attn_groups: int
    gdn_groups: int
    worst_case_blocks: int
    drafter_blocks_per_seat: int

    @property
    def blocks(self) -> int:
        return min(s.blocks for s in self.stages)

    @property
    def fits(self) -> bool:
        return self.worst_case_blocks <= self.blocks

    @property
    def pool_tokens(self) -> int:
        """KV tokens the unified pool holds (every block id as attention blocks of every group)."""
        return self.blocks // max(1, self.attn_groups) * self.block_size

    def describe(self) -> list[tuple[str, str]]:
        mib = lambda b: f"{b / (1 << 20):,.1f} MiB"  # noqa: E731
        rows = []
        for s in self.stages:
            tag = f"stage {s.index} (GPU {s.index})"
            where = f"layers {s.start}-{s.end - 1}: {s.attn_layers} attention + {s.gdn_layers} GDN"
            rows.append((tag, where + (" + the drafter" if s.drafter else "")))
            rows.append((f"  {tag} weights", mib(s.weight_bytes) if s.weight_bytes is not None
                         else "checkpoint not on disk (`hyperharness models prepare --profile …` gets it)"))
            rows.append((f"  {tag} block id", f"{s.group_layers} layers × page = {s.block_bytes:,} B"))
            rows.append((f"  {tag} pool", f"{mib(s.budget_bytes)} → {s.blocks:,} block ids"))
        rows.append(("pool (the smallest stage's count)", f"{self.blocks:,} block ids × {self.block_size} tokens"))
        rows.append(("worst case in block ids", f"{self.worst_case_blocks:,} ({self.attn_groups} attention + "
                     f"{self.gdn_groups} GDN groups, drafter {self.drafter_blocks_per_seat} per seat)"))
        return rows


def pool(*, stages: list[tuple[int, int]], attention: list[bool], page_bytes: int, block_size: int,
         slots_per_seat: int, seats: int, max_model_len: int, budget_bytes: int, drafter_bytes_per_seat: int,
         attn_groups: int, gdn_groups: int, stage_weights: list[int | None]) -> PipelinePool:
    """`attention[i]`: layer i is full attention (else GDN). Every stage gets the same budget (vLLM
    applies --kv-cache-memory-bytes per worker)."""
    attn_ids = [i for i, a in enumerate(attention) if a]
    gdn_ids = [i for i, a in enumerate(attention) if not a]
    groups = _groups(attn_ids, attn_groups) + _groups(gdn_ids, gdn_groups)
    last = len(stages) - 1
    out = []
    for r, (s, e) in enumerate(stages):
        fullest = max((sum(s <= i < e for i in g) for g in groups), default=0)
        out.append(Stage(r, s, e, sum(attention[s:e]), (e - s) - sum(attention[s:e]), r == last, fullest,
                         fullest * page_bytes, budget_bytes, stage_weights[r]))
    last_block = out[last].block_bytes
    drafter_blocks = math.ceil(drafter_bytes_per_seat / last_block) if drafter_bytes_per_seat and last_block else 0
    kv = (math.ceil(max_model_len / block_size) + seats - 1) * attn_groups
    worst = kv + seats * (slots_per_seat * gdn_groups + drafter_blocks)
    return PipelinePool(tuple(out), block_size, attn_groups, gdn_groups, worst, drafter_blocks)
