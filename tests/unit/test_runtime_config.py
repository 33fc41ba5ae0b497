"""The runtime config `serve` hands the proxy, against backend/geometry.py's own count.

Regression (issue 22): `serve` never handed the scheduler the speculative tokens, so on the gpu-* profiles
(k=7) it counted (2+0) GDN state pages per seat per group where the geometry counts (2+k), and admitted
requests the pool cannot hold. Here the gpu-long config is built as `serve --dry-run` builds it, the
scheduler is fed only that config and an engine /metrics page with the geometry's pool, and it must
admit exactly what the geometry says fits.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backend import geometry
from backend.profiles import load_profile
from backend.serve import plan
from proxy.admission import Footprint, Priority
from proxy.scheduler import open_scheduler
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.unit


def gpu_long(tmp_path: Path):  # type: ignore[no-untyped-def]
    return plan(load_profile("gpu-long"), host=None, port=None, engine_port=None, use_key=False, key_file=None,
                prepare=False, run_dir=tmp_path)


def engine_metrics(view: geometry.BlockView) -> str:
    """What vLLM's /metrics says of a pool of the geometry's size (only the labels the proxy reads)."""
    return (f'vllm:cache_config_info{{block_size="{view.block_size}",enable_prefix_caching="True",'
            f'mamba_cache_mode="align",num_gpu_blocks="{view.pool_blocks}",prefix_match_unit="16"}} 1.0\n')


def test_gpu_long_config_carries_spec_tokens_and_state_pages(tmp_path: Path) -> None:
    p = gpu_long(tmp_path)
    facts = p.proxy.upstream.geometry
    geom = p.geometry  # what the boot check holds against the pool
    assert facts.spec_tokens == 7 == geom.spec_tokens
    assert facts.state_slots_per_seat == 2 + 7 == geom.state_slots_per_seat  # align mode: (2 + k) per group
    assert (facts.attn_groups, facts.gdn_groups) == (1, 3)  # 16 attention + 48 GDN layers, groups of 16
    assert facts.seats == 2 and facts.block_size == geom.block_size
    view = geometry.block_view(geom)
    # In bytes, the seat's state as block ids equals the geometry's own state bytes per seat.
    assert facts.state_slots_per_seat * facts.gdn_groups * view.block_bytes == geom.state_bytes_per_seat


async def _admitted_at_once(tmp_path: Path, prompt: int, max_tokens: int) -> tuple[int, int]:
    """(requests the scheduler runs at once, its state blocks per seat) for identical requests."""
    p = gpu_long(tmp_path)
    view = geometry.block_view(p.geometry)
    text = engine_metrics(view)

    async def read(_: str) -> str:
        return text

    sched = open_scheduler(read, CollectorRegistry(), p.proxy.scheduler, p.proxy.upstream.geometry)
    await sched.refresh()
    assert sched.geometry is not None and sched.geometry.num_blocks == view.pool_blocks
    waiting = [asyncio.ensure_future(sched.acquire(Footprint(f"s{i}", prompt, max_tokens, 0, Priority.INTERACTIVE)))
               for i in range(3)]
    for _ in range(5):
        await asyncio.sleep(0)
    admitted = [w.result() for w in waiting if w.done()]
    for w in waiting:
        w.cancel()
    for t in admitted:
        t.release()
    await sched.close()
    return len(admitted), sched.geometry.state_blocks_per_seat


@pytest.mark.parametrize("prompt, max_tokens", [(1_000, 1_000), (60_000, 4_000), (65_000, 4_000), (90_000, 8_000)])
async def test_admits_exactly_what_the_geometry_says_fits(tmp_path: Path, prompt: int, max_tokens: int) -> None:
    view = geometry.block_view(gpu_long(tmp_path).geometry)
    admitted, state_blocks = await _admitted_at_once(tmp_path, prompt, max_tokens)
    assert state_blocks == view.seat_blocks == 9 * 3 + view.drafter_blocks_per_seat
    assert admitted == view.concurrent(prompt, max_tokens)


async def test_the_edge_case_tells_the_counts_apart(tmp_path: Path) -> None:
    """At 65K + 4K tokens one request fits with (2+7) state pages (and the drafter's window), while the
    (2+0) count the scheduler had before would run two and let vLLM preempt."""
    view = geometry.block_view(gpu_long(tmp_path).geometry)
    tokens_blocks = -(-(65_000 + 4_000) // view.block_size)
    assert 2 * (tokens_blocks + 2 * view.gdn_groups) <= view.pool_blocks  # the old count: two fit
    assert view.concurrent(65_000, 4_000) == 1
    assert (await _admitted_at_once(tmp_path, 65_000, 4_000))[0] == 1
