"""What `nvidia-smi` says about the cards: the queries doctor runs, and their parsers.

Three outputs, parsed as nvidia-smi 580 prints them (tests/unit/fixtures/nvidia-smi: an H200's, idle
and under a matmul):
  `--query-gpu=<QUERY_FIELDS> --format=csv`        one row per card: clocks, power, memory now
  `--query-compute-apps=pid,process_name,used_gpu_memory --format=csv`   who holds memory
  `-q -x`                                          the CUDA version the driver supports, the default
                                                   and max power limits, MIG, clock-event reasons
`CUDA_VISIBLE_DEVICES` decides which cards vLLM sees; `visible_count` honours it as vLLM does.
"""
from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass

QUERY_FIELDS = (
    "index", "name", "uuid", "driver_version", "pstate", "memory.total", "memory.used", "memory.free",
    "power.draw", "power.limit", "power.max_limit", "clocks.current.sm", "clocks.current.memory",
    "clocks.max.sm", "clocks.max.memory", "temperature.gpu", "utilization.gpu",
)  # fmt: skip
APPS_FIELDS = ("gpu_uuid", "pid", "process_name", "used_gpu_memory")


class SmiError(RuntimeError):
    pass


@dataclass(frozen=True)
class CardState:
    """One card at one moment (--query-gpu)."""

    index: int
    name: str
    uuid: str
    driver: str
    pstate: str
    mem_total_mib: float
    mem_used_mib: float
    mem_free_mib: float
    power_draw_w: float | None
    power_limit_w: float | None
    power_max_w: float | None
    sm_mhz: float | None
    mem_mhz: float | None
    sm_max_mhz: float | None
    mem_max_mhz: float | None
    temp_c: float | None
    util_pct: float | None


@dataclass(frozen=True)
class CardInfo:
    """The slower facts (-q -x)."""

    name: str
    uuid: str
    driver: str
    cuda: str  # the newest CUDA the driver supports
    default_power_w: float | None
    min_power_w: float | None
    max_power_w: float | None
    mig: bool
    persistence: bool
    clock_events: tuple[str, ...]  # the clock-event (throttle) reasons active when sampled


@dataclass(frozen=True)
class ComputeApp:
    pid: int
    name: str
    used_mib: float | None
    gpu_uuid: str | None = None


def _number(text: str) -> float | None:
    """'694.05 W' -> 694.05; '[N/A]', 'N/A', '[Not Supported]' -> None."""
    head = text.strip().split(" ")[0]
    try:
        return float(head)
    except ValueError:
        return None


def _table(text: str) -> list[dict[str, str]]:
    """csv with a header -> rows keyed by field name ('memory.total [MiB]' -> 'memory.total')."""
    rows = [r for r in csv.reader(io.StringIO(text.strip()), skipinitialspace=True) if r]
    if not rows:
        return []
    keys = [h.strip().split(" [")[0] for h in rows[0]]
    out = []
    for r in rows[1:]:
        if len(r) != len(keys):
            raise SmiError(f"nvidia-smi csv row has {len(r)} fields, its header {len(keys)}: {r}")
        out.append({k: v.strip() for k, v in zip(keys, r, strict=True)})
    return out


def parse_query_gpu(text: str) -> list[CardState]:
    out = []
    for f in _table(text):
        missing = [k for k in QUERY_FIELDS if k not in f]
        if missing:
            raise SmiError(f"--query-gpu output lacks {missing}")
        n = {k: _number(f[k]) for k in QUERY_FIELDS}
        out.append(CardState(int(f["index"]), f["name"], f["uuid"], f["driver_version"], f["pstate"],
                             n["memory.total"] or 0.0, n["memory.used"] or 0.0, n["memory.free"] or 0.0,
                             n["power.draw"], n["power.limit"], n["power.max_limit"], n["clocks.current.sm"],
                             n["clocks.current.memory"], n["clocks.max.sm"], n["clocks.max.memory"],
                             n["temperature.gpu"], n["utilization.gpu"]))
    return out


def parse_compute_apps(text: str) -> list[ComputeApp]:
    """`gpu_uuid` is optional: without it a process is not tied to a card."""
    return [ComputeApp(int(f["pid"]), f.get("process_name", ""), _number(f.get("used_gpu_memory", "N/A")),
                       f.get("gpu_uuid") or None) for f in _table(text)]


def _reading(block: ET.Element | None, tag: str) -> float | None:
    return _number(block.findtext(tag, "N/A")) if block is not None else None


def parse_smi_xml(text: str) -> list[CardInfo]:
    root = ET.fromstring(text)
    driver = root.findtext("driver_version", "").strip()
    cuda = root.findtext("cuda_version", "").strip()
    out = []
    for g in root.findall("gpu"):
        pw = g.find("gpu_power_readings")
        if pw is None:  # older drivers: power_readings
            pw = g.find("power_readings")
        readings = pw
        events = g.find("clocks_event_reasons")
        if events is None:
            events = g.find("clocks_throttle_reasons")
        active = tuple(
            e.tag.removeprefix("clocks_event_reason_").removeprefix("clocks_throttle_reason_")
            for e in (events if events is not None else []) if (e.text or "").strip() == "Active"
        )
        out.append(CardInfo(
            name=g.findtext("product_name", "").strip(), uuid=g.findtext("uuid", "").strip(), driver=driver,
            cuda=cuda, default_power_w=_reading(readings, "default_power_limit"),
            min_power_w=_reading(readings, "min_power_limit"), max_power_w=_reading(readings, "max_power_limit"),
            mig=(g.findtext("mig_mode/current_mig", "") or "").strip() == "Enabled",
            persistence=(g.findtext("persistence_mode", "") or "").strip() == "Enabled",
            clock_events=active,
        ))
    return out


def smi(*args: str, timeout: float = 30) -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise SmiError("nvidia-smi not found: no NVIDIA driver on this machine (or not on PATH)")
    res = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if res.returncode != 0:
        said = (res.stderr or res.stdout).strip()[:300]
        raise SmiError(f"nvidia-smi {' '.join(args)}: exit {res.returncode}: {said}")
    return res.stdout


def query_gpus() -> list[CardState]:
    return parse_query_gpu(smi(f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv"))


def query_apps() -> list[ComputeApp]:
    return parse_compute_apps(smi(f"--query-compute-apps={','.join(APPS_FIELDS)}", "--format=csv"))


def query_info() -> list[CardInfo]:
    return parse_smi_xml(smi("-q", "-x"))


def visible_count(env: Mapping[str, str] | None = None) -> int:
    """The cards vLLM will see: CUDA_VISIBLE_DEVICES if set (empty or -1: none), else nvidia-smi's."""
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [x for x in visible.split(",") if x.strip()]
        return 0 if not ids or ids[0].strip() == "-1" else len(ids)
    try:
        return len(query_gpus())
    except SmiError:
        return 0
