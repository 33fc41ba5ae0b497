"""Drive vLLM 0.32.0's own KVCacheManager the way its scheduler does, without a model.

One `Sim` holds a manager for a hybrid layout (full attention + Mamba "align" + optionally the
DFlash2 drafter's sliding-window group). `turn()` runs one request the scheduler's way: prefix
lookup, slot allocation per prefill chunk / decode step, the per-step copy-on-write drain and
skipped-block release, then free. It returns the prefix-cache hit, so tests can count how many
previously seen tokens a follow-up turn must re-prefill.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request


@dataclass(frozen=True)
class Layout:
    block_size: int = 64  # scheduler block = attention block = Mamba block (align mode)
    unit: int = 16  # --prefix-match-unit (hash_block_size)
    sliding_window: int | None = 128  # the drafter's window; None = no drafter group
    num_blocks: int = 400
    retention_interval: int | None = 0  # vLLM's default


def _groups(layout: Layout) -> list[KVCacheGroupSpec]:
    attn = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=layout.block_size, **attn)),
        KVCacheGroupSpec(
            ["gdn"],
            MambaSpec(
                block_size=layout.block_size,
                shapes=((4,),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
                num_prefill_checkpoint_blocks=1,
                prefill_checkpoint_alignment=layout.unit,
            ),
        ),
    ]
    if layout.sliding_window is not None:
        groups.append(
            KVCacheGroupSpec(
                ["draft"],
                SlidingWindowSpec(
                    block_size=layout.block_size, sliding_window=layout.sliding_window, **attn
                ),
            )
        )
    return groups


@dataclass(frozen=True)
class Probe:
    hit: int
    mamba_block: KVCacheBlock | None


class Sim:
    def __init__(self, layout: Layout = Layout()) -> None:
        self.layout = layout
        init_none_hash(sha256_cbor)
        self.hasher = get_request_block_hasher(layout.unit, sha256_cbor)
        config = KVCacheConfig(
            num_blocks=layout.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=_groups(layout),
            prefix_cache_retention_interval=layout.retention_interval,
            hash_block_size=layout.unit,
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=8192,
            scheduler_block_size=layout.block_size,
            hash_block_size=layout.unit,
            enable_caching=True,
        )
        self._next_id = 0
        # The fields Scheduler._mamba_block_aligned_split reads, so chunks stop where the real
        # scheduler stops them (block boundaries, the prompt's hash-aligned tail).
        self._split_state = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=layout.block_size),
            block_size=layout.block_size,
            hash_block_size=layout.unit,
            mamba_partial_cache_hit=layout.unit < layout.block_size and self.fine_grained,
            mamba_shared_prefix_checkpoint=False,
            mamba_has_prefill_checkpoint_blocks=True,
            mamba_prefill_checkpoint_alignment=layout.unit,
            use_eagle_block_drop=False,
            max_num_scheduled_tokens=2048,
            scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
            kv_cache_manager=self.manager,
        )

    @property
    def fine_grained(self) -> bool:
        return self.manager.coordinator.enable_partial_hash_hits

    def _step_end(self, request: Request) -> None:
        # What Scheduler.schedule/update_from_output do around each forward.
        _, retained = self.manager.take_kv_cache_block_copies()
        self.manager.block_pool.free_blocks(retained)
        self.manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        self.manager.new_step_starts()

    def probe(self, tokens: list[int]) -> Probe:
        """The prefix hit a new request for `tokens` would get (nothing is allocated)."""
        request = self._request(tokens, max_tokens=1)
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        mamba = blocks.blocks[1]
        return Probe(hit=hit, mamba_block=mamba[-1] if mamba else None)

    def _request(self, prompt: list[int], max_tokens: int) -> Request:
        self._next_id += 1
        return Request(
            request_id=f"r{self._next_id}",
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            block_hasher=self.hasher,
        )

    def turn(self, prompt: list[int], output: list[int], chunk: int = 2048) -> int:
        """Run one request (prompt, then `output` decoded one token per step); return its hit."""
        request = self._request(prompt, max_tokens=len(output) or 1)
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        new_computed = blocks
        while request.num_computed_tokens < len(prompt):
            start = request.num_computed_tokens or hit
            n = Scheduler._mamba_block_aligned_split(
                self._split_state,  # type: ignore[arg-type]
                request,
                min(chunk, len(prompt) - start),
                hit if new_computed is not None else 0,
            )
            allocated = self.manager.allocate_slots(
                request,
                n,
                num_new_computed_tokens=hit if new_computed is not None else 0,
                new_computed_blocks=new_computed,
            )
            assert allocated is not None, "pool exhausted"
            new_computed = None
            request.num_computed_tokens = start + n
            self._step_end(request)
        # The token sampled from the prompt's last logits, then one per decode step; the final
        # sampled token is never fed back (its KV/state is never computed).
        for i, token in enumerate(output):
            request.append_output_token_ids(token)
            if i == len(output) - 1:
                break
            assert self.manager.allocate_slots(request, 1) is not None, "pool exhausted"
            request.num_computed_tokens += 1
            self._step_end(request)
        self.manager.free(request)
        return hit
