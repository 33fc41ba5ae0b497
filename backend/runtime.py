"""The proxy's runtime config, computed once from a profile and its pool geometry.

`serve` (and the tools that start a proxy) build one frozen `proxy.settings.Settings` here, write it as
one file and start `python -m proxy --config FILE`. What the scheduler must count per seat (speculative
tokens, recurrent-state pages, KV groups, the drafter's window) comes from backend/geometry.py, the same
arithmetic the boot check holds against the pool, so admission and the boot check cannot disagree.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from proxy.settings import EngineGeometry, SchedulerConfig, Settings, UpstreamConfig

from . import geometry
from .profiles import Profile

ENGINE_HOST = "127.0.0.1"


def engine_geometry(profile: Profile, geom: geometry.Geometry) -> EngineGeometry:
    """What admission needs to know of one engine of this profile."""
    view = geometry.block_view(geom)
    pool_blocks = _blocks_override(profile) or view.pool_blocks
    return EngineGeometry(
        seats=profile.engine.max_num_seqs,
        max_model_len=profile.engine.max_model_len,
        block_size=view.block_size,
        pool_blocks=pool_blocks,
        attn_groups=view.attn_groups,
        gdn_groups=view.gdn_groups,
        state_slots_per_seat=view.state_slots_per_seat,
        drafter_blocks_per_seat=view.drafter_blocks_per_seat,
        spec_tokens=view.spec_tokens,
    )


def _blocks_override(profile: Profile) -> int | None:
    """A profile that pins the pool with vLLM's `--num-gpu-blocks-override N` (the small fan-out pool)."""
    args = list(profile.engine.extra_args)
    for i, arg in enumerate(args):
        if arg == "--num-gpu-blocks-override" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--num-gpu-blocks-override="):
            return int(arg.split("=", 1)[1])
    return None


def engine_name(index: int) -> str:
    return f"engine-{index}"


def upstream_configs(profile: Profile, geom: geometry.Geometry,
                     engines: Sequence[tuple[str, Path | None]]) -> tuple[UpstreamConfig, ...]:
    """One `UpstreamConfig` per engine (URL, its own key file), named engine-0..N-1 in order; every engine
    of one profile has the same pool geometry (remote ones are taken to run the same profile)."""
    facts = engine_geometry(profile, geom)
    return tuple(UpstreamConfig(name=engine_name(i), url=url, api_key_file=key_file, geometry=facts)
                 for i, (url, key_file) in enumerate(engines))


def proxy_settings(profile: Profile, geom: geometry.Geometry, *, model_path: Path, host: str, port: int,
                   engine_url: str | None = None, api_key_file: Path | None,
                   engine_key_file: Path | None = None,
                   redis_url: str | None = None, scheduler: SchedulerConfig | None = None,
                   log_level: str = "info",
                   engines: Sequence[tuple[str, Path | None]] = (),
                   client_key_files: Sequence[Path] = ()) -> Settings:
    """`engines`: (URL, key file) of each engine; `engine_url`/`engine_key_file` is short for one."""
    if engine_url is not None:
        engines = ((engine_url, engine_key_file), *engines)
    if not engines:
        raise ValueError("proxy_settings: no engine given")
    return Settings(host=host, port=port, upstreams=upstream_configs(profile, geom, engines), model_dir=model_path,
                    model_name=profile.model.served_name, api_key_file=api_key_file,
                    api_key_files=tuple(client_key_files), redis_url=redis_url,
                    scheduler=scheduler or SchedulerConfig(), log_level=log_level)


def proxy_argv(config_path: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "proxy", "--config", str(config_path)]
