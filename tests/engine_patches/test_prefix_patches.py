"""Patches 0001/0002 through vLLM 0.32.0's own KV cache manager (no model, CPU, < 2 s).

The layout is the seed's hybrid: full attention + GDN in Mamba "align" mode + the DFlash2 drafter's
sliding-window group, scheduler block 64, prefix-match unit 16. Agent turns are exact token
extensions: turn n+1 = prompt n + its reply + new tokens. "Re-prefilled" counts previously seen
tokens (prompt + reply) the next turn computes again; the floor is 1, the reply's last token,
whose KV/state no forward ever produced.
"""
from __future__ import annotations

import random

import pytest
import vllm.v1.core.single_type_kv_cache_manager as stm
from vllm.v1.core.kv_cache_utils import get_group_id

from tests.engine_patches.kv_sim import Layout, Sim

pytestmark = pytest.mark.unit

MAMBA_GROUP = 1


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switch both patches off in-process (what HYPERHARNESS_*=0 does at import)."""
    monkeypatch.setattr(stm.SlidingWindowManager, "supports_fine_grained_hash_lookup", False)
    monkeypatch.setattr(stm, "END_OF_TURN_STATE", False)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 50_000) for _ in range(n)]


def _replay(sim: Sim, seed: int, turns: int = 6) -> list[int]:
    """Previously seen tokens re-prefilled by turns 2..N."""
    rng = random.Random(seed)
    prompt = _tokens(rng, 300)
    seen = 0
    reprefilled = []
    for turn in range(turns):
        reply = _tokens(rng, rng.randrange(1, 140))
        hit = sim.turn(prompt, reply)
        if turn:
            reprefilled.append(seen - hit)
        seen = len(prompt) + len(reply)
        prompt = prompt + reply + _tokens(rng, rng.randrange(5, 80))
    return reprefilled


def test_patches_are_applied() -> None:
    assert hasattr(stm, "END_OF_TURN_STATE"), "run `hyperharness patches apply` first"
    assert hasattr(stm.SlidingWindowManager, "_find_fine_grained_hit")


def test_sliding_window_group_keeps_fine_grained_hits() -> None:
    assert Sim(Layout(sliding_window=128)).fine_grained


def test_sliding_window_group_disables_fine_grained_hits_upstream(upstream: None) -> None:
    assert not Sim(Layout(sliding_window=128)).fine_grained
    assert Sim(Layout(sliding_window=None)).fine_grained


@pytest.mark.parametrize("window", [128, 100, 1000], ids=["W128", "W100", "W1000"])
def test_fine_grained_hit_with_sliding_window(window: int) -> None:
    # One prompt, then an extension: the hit lands on the prompt's last hash boundary (496),
    # not on the scheduler block below it (448), whatever the window.
    sim = Sim(Layout(sliding_window=window))
    rng = random.Random(1)
    prompt = _tokens(rng, 500)
    sim.turn(prompt, [])
    assert sim.turn(prompt + _tokens(rng, 100), []) == 496


def test_fine_grained_hit_with_sliding_window_upstream(upstream: None) -> None:
    sim = Sim(Layout(sliding_window=128))
    rng = random.Random(1)
    prompt = _tokens(rng, 500)
    sim.turn(prompt, [])
    assert sim.turn(prompt + _tokens(rng, 100), []) == 448


@pytest.mark.parametrize("window", [128, None], ids=["drafter", "no-drafter"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_end_of_turn_reprefill_is_below_one_unit(window: int | None, seed: int) -> None:
    layout = Layout(sliding_window=window)
    reprefilled = _replay(Sim(layout), seed)
    assert all(1 <= n <= layout.unit for n in reprefilled), reprefilled


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_upstream_replays_the_reply(upstream: None, seed: int) -> None:
    reprefilled = _replay(Sim(Layout(sliding_window=None)), seed)
    assert sum(reprefilled) > 4 * 16 * len(reprefilled) // 2, reprefilled


@pytest.mark.parametrize("reply_len", [1, 15, 16, 17, 52, 53, 64, 65, 150])
def test_hit_block_holds_the_boundary_state(reply_len: int) -> None:
    # The Mamba block a follow-up turn resumes from is keyed at exactly the hit length: the
    # snapshot taken when decode passed that boundary, not a later overwrite of the running block.
    sim = Sim(Layout())
    rng = random.Random(reply_len)
    prompt, reply = _tokens(rng, 203), _tokens(rng, reply_len)
    sim.turn(prompt, reply)
    follow_up = sim.probe(prompt + reply + _tokens(rng, 30))
    end = len(prompt) + len(reply) - 1
    assert follow_up.hit == max(end // 16 * 16, 192)
    assert follow_up.mamba_block.block_hash_num_tokens == follow_up.hit


def _mamba_states(sim: Sim) -> int:
    keys = sim.manager.block_pool.cached_block_hash_to_block._cache.keys()
    return sum(1 for k in keys if get_group_id(k) == MAMBA_GROUP)


def test_no_block_leaks_and_one_snapshot_per_request() -> None:
    sim = Sim(Layout())
    _replay(sim, seed=3, turns=8)
    pool = sim.manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block
    before = _mamba_states(sim)
    sim.turn(_tokens(random.Random(9), 100), _tokens(random.Random(10), 600))
    # A 600-token reply passes 37 unit boundaries; only its prompt tail and the latest
    # snapshot stay cached, not one state per 16 tokens.
    assert _mamba_states(sim) - before == 2


def test_identical_resend_still_hits_the_prompt_tail() -> None:
    sim = Sim(Layout())
    rng = random.Random(4)
    prompt = _tokens(rng, 333)
    sim.turn(prompt, _tokens(rng, 90))
    assert sim.turn(prompt, []) == 320


@pytest.mark.parametrize("unit", [1, 16])
def test_warm_up_makes_the_next_turn_resume_at_the_exact_end(unit: int) -> None:
    # The proxy's warm-up (prompt + reply sent with max_tokens 1 while the harness runs its tools)
    # feeds the reply's last token, the one no forward has seen; 0002 keys the state at the
    # prompt's own end, so the next turn re-prefills nothing it has seen. Without the warm-up the
    # floor is that one token (unit 1) or the distance to the last unit boundary.
    sim = Sim(Layout(unit=unit, sliding_window=None))
    rng = random.Random(unit)
    prompt, reply = _tokens(rng, 203 if unit == 1 else 196), _tokens(rng, 60)
    seen = len(prompt) + len(reply)  # 263 / 256: a unit multiple in both layouts
    sim.turn(prompt, reply)
    assert sim.probe(prompt + reply + _tokens(rng, 30)).hit == (seen - 1) // unit * unit
    sim.turn(prompt + reply, _tokens(rng, 1))  # the warm-up: prefills 1 token (unit 1)
    follow_up = sim.probe(prompt + reply + _tokens(rng, 30))
    assert follow_up.hit == seen
    assert follow_up.mamba_block.block_hash_num_tokens == seen


def test_warm_up_reaches_the_exact_end_only_with_the_patch(upstream: None) -> None:
    sim = Sim(Layout(unit=1, sliding_window=None))
    rng = random.Random(5)
    prompt, reply = _tokens(rng, 203), _tokens(rng, 60)
    sim.turn(prompt, reply)
    sim.turn(prompt + reply, _tokens(rng, 1))
    assert sim.probe(prompt + reply + _tokens(rng, 30)).hit == len(prompt) + len(reply) - 1
