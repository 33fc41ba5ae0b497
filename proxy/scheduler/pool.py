"""What the engine's pool holds, in engine blocks: geometry from vLLM's `/metrics` and live gauges.

The pool's size comes from `vllm:cache_config_info` (a gauge fixed at 1 whose labels are the
CacheConfig, vllm032.md §6): `num_gpu_blocks`, `block_size`, `mamba_cache_mode`, `prefix_match_unit`.
What a seat costs beyond its tokens comes from the runtime config (`EngineGeometry`, computed by
`serve` from the profile): for hybrid models every KV-cache group draws from the same block pool
(vLLM's uniform-page grouping), so a seat costs `attention blocks × attention groups` plus
`state slots × GDN groups` (2+k slots in align mode, 1+k otherwise) plus the drafter's own KV.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

from proxy.settings import EngineGeometry

log = logging.getLogger("proxy.scheduler")

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str, names: tuple[str, ...] = ()) -> dict[str, list[tuple[dict[str, str], float]]]:
    """`name -> [(labels, value)]` for the sample lines of a Prometheus text exposition (only those
    starting with one of `names` when given: vLLM's page is long and is read every second)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or (names and not line.startswith(names)):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = {lm["key"]: lm["value"] for lm in _LABEL.finditer(m["labels"] or "")}
        try:
            value = float(m["value"])
        except ValueError:
            continue
        out.setdefault(m["name"], []).append((labels, value))
    return out


def _int(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key)
    if raw is None or raw in ("None", ""):
        return None
    try:
        return int(float(raw))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """The engine's block pool and what one seat costs in it beyond its tokens."""

    num_blocks: int  # blocks in the shared pool (all groups)
    block_size: int  # tokens per attention block
    attn_groups: int = 1  # attention KV-cache groups: each token block is allocated once per group
    state_blocks_per_seat: int = 0  # GDN state pages per running request, all GDN groups together
    spec_tokens: int = 0  # lookahead slots vLLM allocates for speculative decoding
    mamba_cache_mode: str = "none"
    prefix_match_unit: int | None = None
    prefix_caching: bool = True

    @property
    def shares_prefixes(self) -> bool:
        """Whether a running request's prompt blocks can serve another's. Not counted on hybrid
        models: a hit there needs a GDN state at the same boundary, so it may stop short of what
        the attention blocks alone would share, and counting it would under-reserve."""
        return self.prefix_caching and self.state_blocks_per_seat == 0

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size // self.attn_groups

    def token_blocks(self, tokens: int) -> int:
        """Blocks for `tokens` of KV across all attention groups."""
        return math.ceil(tokens / self.block_size) * self.attn_groups

    @classmethod
    def from_cache_config(cls, labels: dict[str, str], engine: EngineGeometry | None = None) -> PoolGeometry:
        """The engine's pool (its own counts) with the per-seat costs the runtime config states."""
        blocks = _int(labels, "num_gpu_blocks")
        block = _int(labels, "block_size")
        if not blocks or not block:
            raise ValueError(f"cache_config_info has no num_gpu_blocks/block_size: {labels}")
        engine = engine or EngineGeometry()
        mode = labels.get("mamba_cache_mode") or "none"
        if engine.block_size is not None and engine.block_size != block:
            log.warning("scheduler: the engine's block is %d tokens, the runtime config computed %d; using the"
                        " engine's", block, engine.block_size)
        if mode != "none" and engine.gdn_groups == 0:
            log.warning("scheduler: the engine keeps recurrent state (mamba_cache_mode=%s) but the runtime config"
                        " states no GDN groups: state pages are not counted", mode)
        return cls(num_blocks=blocks, block_size=block, attn_groups=engine.attn_groups,
                   state_blocks_per_seat=engine.state_blocks_per_seat, spec_tokens=engine.spec_tokens,
                   mamba_cache_mode=mode, prefix_match_unit=_int(labels, "prefix_match_unit"),
                   prefix_caching=labels.get("enable_prefix_caching", "True") == "True")


@dataclass(frozen=True, slots=True)
class LiveGauges:
    """The engine's own view, refreshed: for observability and for spotting load we did not admit."""

    kv_usage: float = 0.0  # 0..1
    running: int = 0
    waiting: int = 0
    preemptions: int = 0


_READ = ("vllm:cache_config_info", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
         "vllm:num_requests_waiting", "vllm:num_preemptions_total")


def read_metrics(text: str, engine: EngineGeometry | None = None) -> tuple[PoolGeometry | None, LiveGauges]:
    samples = parse_prometheus(text, _READ)

    def total(name: str) -> float:
        return sum(v for _, v in samples.get(name, ()))

    geom = None
    info = samples.get("vllm:cache_config_info")
    if info:
        geom = PoolGeometry.from_cache_config(info[0][0], engine)
    usage = samples.get("vllm:kv_cache_usage_perc") or [({}, 0.0)]
    live = LiveGauges(
        kv_usage=max(v for _, v in usage),
        running=int(total("vllm:num_requests_running")),
        waiting=int(total("vllm:num_requests_waiting")),
        preemptions=int(total("vllm:num_preemptions_total")),
    )
    return geom, live
