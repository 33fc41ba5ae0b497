"""`hyperharness doctor` on a GPU: is each card the profile runs on ready for it?

For every card of the profile (its pipeline stages; card 0 without a profile):
  card           name, memory, MIG
  driver         the CUDA version the driver supports against the one torch was built for
  power limit    against the card's default and maximum (decode is power-bound below them)
  clocks         the SM clock during a few seconds of bf16 matmul, and why it is below its maximum
  processes      other compute processes on the card
  free memory    against what vLLM takes at start (memory × gpu_memory_utilization: vLLM refuses to
                 start with less free) and what the profile puts there (weights + pool pin + reserve)
Each finding says what to do. `findings()` is pure (unit-tested on recorded nvidia-smi output); the
queries and the load live in `check_gpus()`.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from . import gpu
from .doctor import FAIL, OK, WARN, Check

LOAD_SECONDS = 6.0
SAMPLE_AFTER = 4.0  # past the ramp: clocks and power settle within a couple of seconds
# A dense bf16 matmul on the card, until the deadline; prints torch's CUDA version first.
_LOAD = """import sys, time, torch
print(torch.version.cuda, flush=True)
d = torch.device(f"cuda:{int(sys.argv[1])}")
a = torch.randn(8192, 8192, device=d, dtype=torch.bfloat16)
b = torch.empty_like(a)
end = time.time() + float(sys.argv[2])
while time.time() < end:
    for _ in range(8):
        torch.matmul(a, a, out=b)
    torch.cuda.synchronize(d)
"""


@dataclass(frozen=True)
class CardNeed:
    """What the profile asks of one card (geometry.CardFit's numbers, in bytes)."""

    utilization: float
    pool_bytes: int | None  # kv_cache_memory_bytes; None: vLLM sizes the pool from what is left
    reserve_bytes: int
    weight_bytes: int | None  # None: checkpoint not local


def _version(v: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (v or "").split("."))
    except ValueError:
        return ()


def findings(card: int, info: gpu.CardInfo, idle: gpu.CardState, loaded: gpu.CardState | None,
             apps: list[gpu.ComputeApp], need: CardNeed | None, torch_cuda: str | None = None,
             own_pids: frozenset[int] = frozenset()) -> list[Check]:
    gib = lambda mib: f"{mib / 1024:,.1f} GiB"  # noqa: E731
    name = f"gpu {card}"
    out = []
    # card
    detail = f"{idle.name}, {gib(idle.mem_total_mib)}, {idle.pstate}, persistence {'on' if info.persistence else 'off'}"
    if info.mig:
        out.append(Check(f"{name} card", WARN, detail + f"; MIG is on, so vLLM gets one slice: serve on the whole "
                         f"card with `sudo nvidia-smi -i {card} -mig 0` (then reset the card)"))
    else:
        out.append(Check(f"{name} card", OK, detail))
    # driver
    detail = f"driver {info.driver}, supports CUDA {info.cuda}"
    if torch_cuda and _version(torch_cuda) > _version(info.cuda):
        out.append(Check(f"{name} driver", FAIL, f"{detail}; this torch is built for CUDA {torch_cuda}: upgrade the "
                         f"NVIDIA driver to one that supports CUDA {torch_cuda} (or install a torch/vLLM build for "
                         f"CUDA {info.cuda})"))
    else:
        out.append(Check(f"{name} driver", OK, detail + (f"; torch built for CUDA {torch_cuda}" if torch_cuda else "")))
    # power limit
    limit, default, top = idle.power_limit_w, info.default_power_w, info.max_power_w or idle.power_max_w
    if limit is None:
        out.append(Check(f"{name} power limit", WARN, "not reported by this card: clocks below show what it sustains"))
    elif default is not None and limit < default - 0.5:
        out.append(Check(f"{name} power limit", WARN,
                         f"{limit:.0f} W, below the card's default {default:.0f} W (max {top:.0f} W): decode is "
                         f"power-bound at a low limit (the seeds: a 3090 Ti at 300 -> 350 W went from 24.3 to 22.0 ms "
                         f"per step); raise it with `sudo nvidia-smi -i {card} -pl {default:.0f}`"))
    else:
        out.append(Check(f"{name} power limit", OK,
                         f"{limit:.0f} W (default {default or limit:.0f} W, max {top or limit:.0f} W)"))
    # clocks under load
    out.append(_clocks(name, card, loaded))
    # other processes
    others = [a for a in apps if a.pid not in own_pids and (a.gpu_uuid is None or a.gpu_uuid == idle.uuid)]
    if others:
        held = ", ".join(f"pid {a.pid} {a.name} ({a.used_mib or 0:,.0f} MiB)" for a in others)
        kill = " ".join(str(a.pid) for a in others)
        out.append(Check(f"{name} processes", WARN, f"{held} on this card: stop {'it' if len(others) == 1 else 'them'} "
                         f"(`kill {kill}`) or serve on another card (CUDA_VISIBLE_DEVICES)"))
    else:
        out.append(Check(f"{name} processes", OK, "no other compute process"))
    if need is not None:
        out.append(_memory(name, idle, need, others))
    return out


def _clocks(name: str, card: int, s: gpu.CardState | None) -> Check:
    key = f"{name} clocks under load"
    if s is None:
        return Check(key, WARN, "not measured (no CUDA torch in this environment to load the card)")
    if not s.sm_mhz or not s.sm_max_mhz:
        return Check(key, WARN, "the card reports no SM clock")
    at = (f"SM {s.sm_mhz:.0f} of {s.sm_max_mhz:.0f} MHz at {s.power_draw_w or 0:.0f} W of "
          f"{s.power_limit_w or 0:.0f} W, {s.temp_c or 0:.0f} °C")
    if s.sm_mhz >= 0.9 * s.sm_max_mhz:
        return Check(key, OK, at)
    limit = s.power_limit_w
    power_bound = s.power_draw_w is not None and limit is not None and s.power_draw_w >= 0.95 * limit
    if power_bound and s.power_max_w and limit is not None and limit < s.power_max_w - 0.5:
        return Check(key, WARN, f"{at}: power-limited below the card's maximum; raise the limit "
                     f"(`sudo nvidia-smi -i {card} -pl {s.power_max_w:.0f}`)")
    if power_bound:
        return Check(key, OK, f"{at}: at the card's maximum power limit, as a dense matmul runs; nothing to raise "
                     f"(decode reads memory more than it multiplies and draws less)")
    if s.temp_c is not None and s.temp_c >= 85:
        return Check(key, WARN, f"{at}: thermal: improve the card's cooling or airflow")
    return Check(key, WARN, f"{at}: held below its maximum without a power or thermal cause; see "
                 f"`nvidia-smi -i {card} -q -d PERFORMANCE` and reset locked clocks with "
                 f"`sudo nvidia-smi -i {card} -rgc`")


def _memory(name: str, s: gpu.CardState, need: CardNeed, others: list[gpu.ComputeApp]) -> Check:
    mib = 1 << 20
    total = s.mem_total_mib * mib
    wanted = math.ceil(total * need.utilization)  # what vLLM takes at start (v1/worker/utils.request_memory)
    free = s.mem_free_mib * mib
    g = lambda b: f"{b / (1 << 30):,.1f} GiB"  # noqa: E731
    if free < wanted:
        held = (f" ({len(others)} other process{'es hold' if len(others) != 1 else ' holds'} memory)"
                if others else "")
        return Check(f"{name} free memory", FAIL,
                     f"{g(free)} free{held}, and vLLM takes {need.utilization:.2f} × {g(total)} = {g(wanted)} at start "
                     f"and refuses with less: free the card, or lower gpu_memory_utilization to "
                     f"{math.floor(free / total * 100) / 100:.2f} in a copy of the profile")
    if need.pool_bytes is None:
        return Check(f"{name} free memory", OK, f"{g(free)} free; vLLM takes {g(wanted)}")
    parts = need.pool_bytes + need.reserve_bytes + (need.weight_bytes or 0)
    detail = (f"{g(free)} free; vLLM takes {g(wanted)}: pool pin {g(need.pool_bytes)} + reserve {g(need.reserve_bytes)}"
              + (f" + weights {g(need.weight_bytes)}" if need.weight_bytes is not None else ""))
    if parts > wanted:
        fitting = g(max(0, wanted - parts + need.pool_bytes))
        return Check(f"{name} free memory", FAIL, f"{detail} = {g(parts)} > {g(wanted)}: lower kv_cache_memory_bytes "
                     f"to {fitting} or less (or prepare the checkpoint: int8 heads)")
    left = wanted - parts
    if need.weight_bytes is None:
        return Check(f"{name} free memory", OK, f"{detail}; {g(left)} left for the weights (not local to count)")
    return Check(f"{name} free memory", OK, f"{detail}; {g(left)} to spare")


def run_load(cards: list[int], seconds: float = LOAD_SECONDS, sample_after: float = SAMPLE_AFTER
             ) -> tuple[dict[int, gpu.CardState], str | None, frozenset[int]]:
    """A bf16 matmul on each card at once; the cards' state mid-run, torch's CUDA version, the load pids."""
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD, str(c), str(seconds)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ)) for c in cards]
    try:
        time.sleep(sample_after)
        sampled = {s.index: s for s in gpu.query_gpus() if s.index in cards}
    finally:
        outs = [p.communicate(timeout=seconds + 60) for p in procs]
    torch_cuda: str | None = None
    for p, (out, _) in zip(procs, outs, strict=True):
        if p.returncode != 0:  # no CUDA torch here, or the card refused: no load measurement
            return {}, None, frozenset()
        words = out.split()
        torch_cuda = torch_cuda or (words[0] if words else None)
    return sampled, torch_cuda, frozenset(p.pid for p in procs)


def check_gpus(profile=None, load: bool = True) -> Iterator[Check]:
    """The GPU checks for `profile`'s cards (card 0 without one)."""
    needed = profile.engine.pipeline_parallel_size if profile is not None else 1
    try:
        infos, states, apps = gpu.query_info(), gpu.query_gpus(), gpu.query_apps()
    except gpu.SmiError as exc:
        cuda = profile is not None and profile.engine.device == "cuda"
        yield Check("gpu", FAIL if cuda else WARN, f"{exc}; install the NVIDIA driver (580+ for CUDA 13)")
        return
    visible = gpu.visible_count()
    if visible < needed:
        yield Check("gpu count", FAIL, f"profile {profile.name} runs on {needed} GPUs (pipeline parallel); "
                    f"{visible} visible (nvidia-smi, CUDA_VISIBLE_DEVICES): serve a one-card profile here")
        return
    cards = list(range(needed))
    loaded, torch_cuda, own = run_load(cards) if load else ({}, None, frozenset())
    needs = _needs(profile, states) if profile is not None and profile.engine.device == "cuda" else {}
    for c in cards:
        yield from findings(c, infos[c], states[c], loaded.get(c), apps, needs.get(c), torch_cuda, own)


def _needs(profile, states: list[gpu.CardState]) -> dict[int, CardNeed]:
    """Each card's share, from the same geometry the boot check uses (the served checkpoint's weights,
    prepared sizes when prepared, if it is on disk)."""
    from . import geometry

    if not profile.model.shape:
        return {}
    total = int(states[0].mem_total_mib * (1 << 20))
    geom = geometry.compute(profile, geometry.ModelShape.named(profile.model.shape), total)
    util = profile.engine.gpu_memory_utilization or 0.9
    if not geom.cards:
        return {c: CardNeed(util, None, int(profile.memory.reserve_gib * (1 << 30)), None)
                for c in range(profile.engine.pipeline_parallel_size)}
    return {c.stage: CardNeed(util, c.pool_bytes, c.reserve_bytes, c.weight_bytes) for c in geom.cards}
