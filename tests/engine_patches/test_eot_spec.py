"""Patch 0005: 0002's end-of-turn snapshot with a speculator (align mode), scheduler and worker.

vLLM 0.32.0's own KV cache manager (full attention + Mamba align with `num_speculative_blocks`
= k, block 8, unit 4) runs requests step by step the way its scheduler does, with k drafts per
verify step and a scripted number of accepted drafts; the patch's scheduler methods
(`Scheduler._reserve_eot_snapshots` / `_resolve_eot_snapshots`, called on a stand-in `self`)
reserve and key the snapshot blocks, and the patch's worker copy (`MambaSpecDecodeGPUContext.
run_eot_snapshot`, vLLM's `_copy_mamba_state_block` under Triton's interpreter) fills them from
a toy state pool whose every verify column holds its own token count (temporal state = count,
conv row j of column 0's block = count + j).  A keyed block must hold exactly the count it is
keyed at, in both states; sync and async scheduling (two steps in flight, placeholders as
`AsyncScheduler` keeps them).  The GDN-layer side (lazy == eager, and equality with vLLM's own
`run_fused_postprocess` on real states) is test_eot_spec_copy.py.
"""
from __future__ import annotations

import os
import random
import types
from collections import deque
from dataclasses import dataclass

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

import vllm.v1.core.single_type_kv_cache_manager as stm  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_group_id, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.utils import CpuGpuBuffer  # noqa: E402
from vllm.v1.worker import mamba_utils  # noqa: E402

from tests.engine_patches.test_gdn_align import interpret_mamba_kernels  # noqa: E402

pytestmark = pytest.mark.unit

BS, UNIT, K = 8, 4, 3  # scheduler/Mamba block, prefix-match unit, drafts per step (k + 1 <= unit)
CONV_LEN = 3 + K  # conv state rows with a speculator (width - 1 + k)
NUM_BLOCKS = 160
MAMBA_GROUP = 1


def eot_spec_patched() -> bool:
    return hasattr(stm.MambaManager, "reserve_eot_snapshot")


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not eot_spec_patched():
        pytest.skip("patch 0005 not applied (hyperharness patches apply --ensure)")
    interpret_mamba_kernels()


def _kv_manager() -> KVCacheManager:
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(block_size=BS, shapes=((CONV_LEN, 2), (1, 4)), dtypes=(torch.float32, torch.float32),
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align",
                      num_speculative_blocks=K)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], hash_block_size=UNIT,
                           kv_cache_groups=[KVCacheGroupSpec(["attn"], attn), KVCacheGroupSpec(["gdn"], mamba)])
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=UNIT,
                          enable_caching=True)


class ToyWorker:
    """One request's Mamba block-table row and toy states, vLLM's align bookkeeping."""

    def __init__(self) -> None:
        spec = MambaSpec(block_size=BS, shapes=((CONV_LEN, 2), (1, 4)), dtypes=(torch.float32, torch.float32),
                         mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align",
                         num_speculative_blocks=K)
        cfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["gdn"], spec)])
        funcs = {MambaAttentionBackendEnum.GDN_ATTN: (get_conv_copy_spec, get_temporal_copy_spec)}
        self.conv = torch.full((NUM_BLOCKS, CONV_LEN, 2), float("nan"))  # [blocks, L, dim]
        self.ssm = torch.full((NUM_BLOCKS, 1, 4), float("nan"))  # [blocks, heads, state]
        self.table = torch.zeros(1, 64, dtype=torch.int32)  # the worker's persistent row

        def make_buffer(*size, dtype):
            return CpuGpuBuffer(*size, dtype=dtype, device="cpu", with_numpy=True)

        self.ctx = mamba_utils.MambaSpecDecodeGPUContext.create(1, cfg, funcs, torch.device("cpu"), make_buffer)
        layer = types.SimpleNamespace(kv_cache=[self.conv, self.ssm])
        self.ctx.initialize_from_forward_context(cfg, {"gdn": layer}, funcs, [self.table])

    def verify(self, ids: list[int], running: int, end: int) -> int:
        """The forward of a verify step starting at `running` tokens and scheduled up to `end`:
        column j of the window holds the state after running + j tokens.  Returns the window's
        first column (state_idx)."""
        self.table[0].zero_()
        self.table[0, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        state_idx = -(-end // BS) - 1  # preprocess_mamba: cdiv(computed + scheduled, BS) - 1
        window = ids[state_idx : state_idx + K + 1]
        assert len(window) == K + 1 and 0 not in window, (state_idx, ids)
        for j, block in enumerate(window):
            self.ssm[block] = running + j
        self.conv[window[0]] = (running + torch.arange(CONV_LEN, dtype=torch.float32))[:, None]
        return state_idx

    def snapshot(self, state_idx: int, running: int, accepted: int, z: int | None) -> None:
        """The worker's copy after the step's postprocess (num_accepted = accepted + 1)."""
        blocks = torch.tensor([[-1 if z is None else z]], dtype=torch.int32)
        new = torch.tensor([running + accepted])
        self.ctx.run_eot_snapshot(1, blocks, torch.tensor([accepted + 1]), torch.tensor([state_idx]), new, UNIT)


def _scheduler(manager: KVCacheManager, request: Request) -> types.SimpleNamespace:
    """What Scheduler._reserve_eot_snapshots / _resolve_eot_snapshots read of `self`."""
    sched = types.SimpleNamespace(kv_cache_manager=manager, requests={request.request_id: request},
                                  running=[request], parallel_config=types.SimpleNamespace(
                                      pipeline_parallel_size=1, prefill_context_parallel_size=1))
    sched._eot_snapshot_managers = types.MethodType(Scheduler._eot_snapshot_managers, sched)
    return sched


@dataclass
class Step:
    table: list[int]  # the request's Mamba block ids when scheduled (the worker's row)
    z: int | None  # the reserved Mamba snapshot block
    blocks: dict | None
    running: int = -1  # the worker's count whose state is column 0
    state_idx: int = -1


def expected_boundary(prompt_len: int, running: int, accepted: int) -> int | None:
    new = running + accepted
    b = new // UNIT * UNIT
    return b if running <= b and b % BS and b > prompt_len else None


def run_request(manager: KVCacheManager, worker: ToyWorker, prompt: list[int], output: list[int],
                accepts: list[int], async_sched: bool, hasher) -> dict:
    """One request: prompt prefill, then verify steps of K drafts accepting accepts[i] each (cut at
    the output's end).  Async: step N + 1 is scheduled before step N's output is processed (as
    the engine core does), with AsyncScheduler's placeholder counts."""
    request = Request(request_id=f"r{random.random()}", prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=len(output)), pooling_params=None, block_hasher=hasher)
    sched = _scheduler(manager, request)
    mamba = manager.coordinator.single_type_managers[MAMBA_GROUP]
    blocks, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(prompt) - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    request.num_computed_tokens = len(prompt)
    manager.take_kv_cache_block_copies()
    request.append_output_token_ids(output[0])  # sampled from the prompt's last logits
    emitted, true_computed = 1, len(prompt)
    inflight: deque[Step] = deque()
    keyed: list[tuple[int, int]] = []  # (boundary, block id)
    cases: set[str] = set()  # which columns the script's snapshots came from
    accepts_iter = iter(accepts)

    def schedule() -> None:
        num_new = 1 + K
        reserved = Scheduler._reserve_eot_snapshots(sched, {request.request_id: num_new})
        assert manager.allocate_slots(request, num_new) is not None, "pool exhausted"
        per_req = (reserved or {}).get(request.request_id)
        request.num_computed_tokens += num_new
        if async_sched:
            request.num_output_placeholders += num_new
        manager.take_kv_cache_block_copies()
        table = [b.block_id for b in mamba.req_to_blocks[request.request_id]]
        inflight.append(Step(table, None if per_req is None else per_req[MAMBA_GROUP], per_req))

    def execute_and_output(step: Step, accepted: int) -> None:
        nonlocal emitted, true_computed
        # Worker: verify forward, align postprocess (no block boundary copies in this toy:
        # checked below), then the snapshot copy.
        step.running = true_computed + 1
        step.state_idx = worker.verify(step.table, step.running, true_computed + 1 + K)
        accepted = min(accepted, len(output) - emitted - 1)
        worker.snapshot(step.state_idx, step.running, accepted, step.z)
        true_computed = step.running + accepted
        # Scheduler: update_from_output.
        rejected = K - accepted
        request.num_computed_tokens -= rejected
        if async_sched:
            request.num_output_placeholders -= rejected + accepted + 1
        for token in output[emitted : emitted + accepted + 1]:
            request.append_output_token_ids(token)
        emitted += accepted + 1
        want = expected_boundary(len(prompt), step.running, accepted)
        if step.blocks:
            assert manager.block_pool.blocks[step.z].block_hash is None
            Scheduler._resolve_eot_snapshots(sched, request, step.blocks, accepted + 1)
            block = manager.block_pool.blocks[step.z]
            if want is None:  # not filled by the worker: freed, unkeyed
                assert block.block_hash is None and block.ref_cnt == 0, (step, accepted)
                cases.add("not accepted")
            else:
                assert block.block_hash_num_tokens == want and block.ref_cnt == 0, (step, want)
                keyed.append((want, step.z))
                c = want - step.running
                cases.add("c=0" if c == 0 else "last column" if c == K else "mid-window")
                # The worker copied column want - running: its count, in both states.
                assert float(worker.ssm[step.z].max()) == float(worker.ssm[step.z].min()) == want
                assert float(worker.conv[step.z][0, 0]) == want
        else:
            assert want is None, (step, accepted)  # a boundary that could be passed was reserved
        manager.remove_skipped_blocks(request.request_id, true_computed)
        manager.new_step_starts()

    schedule()
    while emitted < len(output):
        if async_sched:
            schedule()  # step N + 1 before step N's acceptance is known
        execute_and_output(inflight.popleft(), next(accepts_iter, K))
        if not async_sched and emitted < len(output):
            schedule()
    # Finished with a step still in flight (async): its block goes back with the request.
    manager.free(request)
    return {"keyed": keyed, "request": request, "pending": len(inflight), "cases": cases}


def _mamba_decode_snapshots(manager: KVCacheManager, prompt_len: int) -> list[int]:
    """Cached Mamba entries inside the output that are not block multiples (vLLM's own align
    states at block multiples are upstream's)."""
    cache = manager.block_pool.cached_block_hash_to_block
    found = []
    for key in list(cache._cache.keys()):
        block = cache.get_one_block(key)
        n = block.block_hash_num_tokens
        if get_group_id(key) == MAMBA_GROUP and n > prompt_len and n % BS:
            found.append(n)
    return found


# Accepted drafts per step around boundaries; with a 21-token prompt the running counts walk
# through c = 0 (running on a unit multiple), mid-window, the last column (a = K) and boundaries
# not accepted, and past block multiples (the postprocess's own copy, no snapshot).
SCRIPTS = [[0, 1, 2, 3, 3, 0, 2, 1, 3, 0, 0, 1, 2], [3] * 12, [0] * 20, [2, 0, 3, 1] * 4]


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("script", range(len(SCRIPTS)))
def test_snapshot_blocks_hold_the_boundary_column(async_sched: bool, script: int) -> None:
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(UNIT, sha256_cbor)
    manager, worker = _kv_manager(), ToyWorker()
    rng = random.Random(script)
    prompt = [rng.randrange(1000, 9000) for _ in range(21)]
    output = [rng.randrange(1000, 9000) for _ in range(40)]
    run = run_request(manager, worker, prompt, output, SCRIPTS[script], async_sched, hasher)
    pool = manager.block_pool
    # No block leak: everything but the null block is free (cached entries are evictable).
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert run["keyed"], "the script passes several boundaries"
    if script == 0:
        assert run["cases"] == {"c=0", "mid-window", "last column", "not accepted"}, run["cases"]
    last_boundary, last_block = run["keyed"][-1]
    # One snapshot per request: the latest boundary only.
    live = [b for _, b in run["keyed"] if pool.blocks[b].block_hash is not None]
    assert live == [last_block], run["keyed"]
    assert _mamba_decode_snapshots(manager, len(prompt)) == [last_boundary]
    # A follow-up turn (prompt + reply + new tokens) resumes there: its Mamba hit is the snapshot.
    request = run["request"]
    follow = Request(request_id="follow", prompt_token_ids=list(request.all_token_ids) + [7] * 9,
                     sampling_params=SamplingParams(max_tokens=1), pooling_params=None, block_hasher=hasher)
    blocks, hit, _ = manager.get_computed_blocks(follow)
    assert hit == last_boundary
    assert blocks.blocks[MAMBA_GROUP][-1].block_id == last_block
    assert float(worker.ssm[last_block].max()) == last_boundary


def test_no_reservation_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stm, "END_OF_TURN_STATE", False)
    init_none_hash(sha256_cbor)
    manager = _kv_manager()
    request = Request(request_id="r", prompt_token_ids=list(range(1000, 1021)),
                      sampling_params=SamplingParams(max_tokens=9), pooling_params=None,
                      block_hasher=get_request_block_hasher(UNIT, sha256_cbor))
    assert manager.allocate_slots(request, 21)
    request.num_computed_tokens = 21
    request.append_output_token_ids(5)
    assert Scheduler._reserve_eot_snapshots(_scheduler(manager, request), {"r": 1 + K}) is None


@pytest.mark.parametrize("eot", [True, False], ids=["series", "upstream"])
def test_warm_up_keys_the_prompt_end_with_a_speculator(monkeypatch: pytest.MonkeyPatch, eot: bool) -> None:
    """The proxy's warm-up (prompt + reply, max_tokens 1) under align mode with k spec blocks: its
    prefill ends on a unit (20 tokens, not a block multiple), 0002 keys that state (copy-on-write
    of the running block, as the upstream prompt tail's), so the next turn resumes at exactly 20;
    upstream stops at the prompt tail's cap, one unit short.  (States resumed this way equal cold
    recomputes in the engine: patches/README.md, the 0005 replay.)"""
    monkeypatch.setattr(stm, "END_OF_TURN_STATE", eot)
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(UNIT, sha256_cbor)
    manager = _kv_manager()
    prompt = [random.Random(7).randrange(1000, 50_000) for _ in range(20)]

    def request(ids: list[int]) -> Request:
        return Request(request_id=f"w{len(ids)}", prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=1),
                       pooling_params=None, block_hasher=hasher)

    warm = request(prompt)
    blocks, hit, _ = manager.get_computed_blocks(warm)
    assert manager.allocate_slots(warm, len(prompt) - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    warm.num_computed_tokens = len(prompt)
    manager.take_kv_cache_block_copies()
    manager.free(warm)
    _, hit, _ = manager.get_computed_blocks(request(prompt + [7, 8, 9, 10, 11]))
    # Upstream: short of 20 (here 0: this one-step prefill does not stop at the prompt tail's
    # checkpoint as the real scheduler's chunking does; the engine's upstream run stops one unit short).
    assert hit == 20 if eot else hit < 20, hit
