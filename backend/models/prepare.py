"""Prepare a downloaded checkpoint for the GPU profiles: int8 heads, streamed, checked, resumable.

`prepare_checkpoint(source, target, recipe)` writes a directory vLLM serves in place of `source`:
  - every shard holding a tensor of the recipe (heads.py) is rewritten: the other tensors are copied
    byte for byte, each selected weight [R, C] becomes `weight_packed` int32 [R, C/4],
    `weight_scale` [R, C/128] in the model dtype and `weight_shape` int64 [2] (int8.py), quantized
    a row chunk at a time (4 MiB of source), so peak memory is a chunk, not a tensor, not a shard;
  - every other shard is hard-linked (a symlink across file systems), never copied;
  - config.json gets the compressed-tensors groups (heads.quantization_config), the index its new
    names, and `hyperharness-prepare.json` the recipe, the source and the error of every tensor;
  - manifest.json holds the sha256 of every file (the hashes of written shards come from the write).
A tensor whose relative error reaches the bound is never written: its shard is discarded and the run
stops, naming it. Each shard is one unit of work, written to `name.tmp` and renamed when complete,
then recorded (sha256, size, errors) in `.prepare-state.json` inside `<target>.partial`; a run that
is interrupted resumes there, keeping every recorded shard whose file still hashes to its record.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import heads, int8
from .cache import MANIFEST, ModelPrepError, sha256_file
from .safetensors_io import NAMES, Planned, StreamWriter, TensorInfo, raw_chunks, read_header, read_rows

INDEX = "model.safetensors.index.json"
STATE = ".prepare-state.json"
REPORT = "hyperharness-prepare.json"
CHUNK_BYTES = 4 << 20  # source bytes quantized at a time (its temporaries are ~20x this)


@dataclass(frozen=True)
class Item:
    """One tensor of an output shard: copied as is (part None) or quantized (part set)."""

    src: TensorInfo
    part: str | None


@dataclass(frozen=True)
class Unit:
    shard: str  # file name, the same in source and target
    items: tuple[Item, ...]

    @property
    def rewrite(self) -> bool:
        return any(i.part for i in self.items)

    @property
    def source_bytes(self) -> int:
        return sum(i.src.nbytes for i in self.items)


@dataclass
class Plan:
    source: Path
    recipe: heads.Recipe
    scale_dtype: torch.dtype
    units: list[Unit]
    skipped: dict[str, str] = field(default_factory=dict)  # candidate tensor -> why it stays as is

    def digest(self) -> str:
        """What the output depends on: the recipe, the scale dtype and every source tensor's place."""
        h = hashlib.sha256(json.dumps(self.recipe.as_dict(), sort_keys=True).encode())
        h.update(str(self.scale_dtype).encode())
        for u in self.units:
            for i in u.items:
                h.update(f"{u.shard}|{i.src.name}|{i.src.dtype}|{i.src.shape}|{i.src.begin}|{i.part}".encode())
            h.update(str((self.source / u.shard).stat().st_size).encode())
        return h.hexdigest()

    def quantized(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for u in self.units:
            for i in u.items:
                if i.part:
                    out.setdefault(i.part, []).append(i.src.name.removesuffix(".weight"))
        return out


def shards_of(source: Path) -> list[str]:
    index = source / INDEX
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    found = sorted(p.name for p in source.glob("*.safetensors"))
    if not found:
        raise ModelPrepError(f"{source}: no *.safetensors and no {INDEX}; is this a downloaded checkpoint?")
    return found


def model_dtype(config: dict) -> torch.dtype:
    c = config.get("text_config", config)
    name = str(c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(name.removeprefix("torch."), torch.bfloat16)


def make_plan(source: Path, recipe: heads.Recipe) -> Plan:
    config = json.loads((source / "config.json").read_text())
    plan = Plan(source, recipe, model_dtype(config), [])
    for shard in shards_of(source):
        tensors, _ = read_header(source / shard)
        items = []
        for info in tensors.values():
            part = heads.selected(info.name, recipe)
            if part is not None:
                why = int8.can_group(info.shape, recipe.group_size)
                if why is None and info.dtype not in ("BF16", "F16", "F32"):
                    why = f"dtype {info.dtype} is not a float weight (already quantized?)"
                if why is not None:
                    plan.skipped[info.name] = why
                    part = None
            items.append(Item(info, part))
        plan.units.append(Unit(shard, tuple(items)))
    if not any(u.rewrite for u in plan.units):
        raise ModelPrepError(f"{source}: no tensor of {list(recipe.parts)} to quantize"
                             + (f" ({plan.skipped})" if plan.skipped else ""))
    return plan


def output_tensors(item: Item, scale_dtype: torch.dtype, group: int) -> list[Planned]:
    info = item.src
    if item.part is None:
        return [Planned(info.name, info.dtype, info.shape)]
    base = info.name.removesuffix(".weight")
    rows, cols = info.shape
    return [
        Planned(f"{base}.weight_packed", "I32", (rows, cols // int8.PACK_FACTOR)),
        Planned(f"{base}.weight_scale", NAMES[scale_dtype], (rows, cols // group)),
        Planned(f"{base}.weight_shape", "I64", (2,)),
    ]


Progress = Callable[[int], None]  # called with source bytes done since the last call


def _rewrite(plan: Plan, unit: Unit, out: Path, advance: Progress) -> tuple[str, dict]:
    """Write one rewritten shard; (sha256, {tensor: error stats}); raises before committing a bad one."""
    src = plan.source / unit.shard
    _, meta = read_header(src)
    planned = [p for i in unit.items for p in output_tensors(i, plan.scale_dtype, plan.recipe.group_size)]
    writer = StreamWriter(out / unit.shard, planned, metadata=meta or {"format": "pt"})
    errors: dict[str, dict] = {}
    try:
        for item in unit.items:
            info = item.src
            if item.part is None:
                for block in raw_chunks(src, info):
                    writer.write(info.name, block)
                    advance(len(block))
                continue
            base = info.name.removesuffix(".weight")
            rows, cols = info.shape
            step = max(1, CHUNK_BYTES // (cols * (info.nbytes // (rows * cols))))
            stats = int8.ErrorStats()
            scales = []  # scales: [rows, cols/group], small (1/64 of the int8 bytes at group 128)
            for r0 in range(0, rows, step):
                w = read_rows(src, info, r0, min(rows, r0 + step))  # w: [r, C]
                packed, scale = int8.quantize_chunk(w, plan.scale_dtype, stats, plan.recipe.group_size)
                writer.write(f"{base}.weight_packed", packed)
                scales.append(scale)
                advance(w.numel() * w.element_size())
            if stats.rel_error >= plan.recipe.max_rel_error:
                raise ModelPrepError(
                    f"{info.name}: int8 group-{plan.recipe.group_size} relative error "
                    f"{stats.rel_error:.4%} >= the bound {plan.recipe.max_rel_error:.2%}; refusing to write it "
                    f"(leave `{item.part}` out of the profile's model.prepare.parts to keep it as is)"
                )
            writer.write(f"{base}.weight_scale", torch.cat(scales))
            writer.write(f"{base}.weight_shape", torch.tensor([rows, cols], dtype=torch.int64))
            errors[info.name] = {"part": item.part, "shape": [rows, cols], "source_dtype": info.dtype,
                                 "source_bytes": info.nbytes,
                                 "prepared_bytes": sum(p.nbytes for p in output_tensors(item, plan.scale_dtype,
                                                                                       plan.recipe.group_size)),
                                 **stats.as_dict()}
        return writer.close(), errors
    except BaseException:
        writer.abort()
        raise


def link_file(src: Path, dst: Path) -> None:
    """Hard link (symlink across file systems) `dst` to the file behind `src`."""
    dst.unlink(missing_ok=True)
    real = src.resolve()  # a Hugging Face snapshot holds symlinks into its blob store
    try:
        os.link(real, dst)
    except OSError:
        dst.symlink_to(real)


def _steady_malloc() -> None:
    """Make glibc return freed chunk temporaries to the OS.

    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after which
    a chunk's temporaries come from the heap and fragment it: measured here, a 512 MiB checkpoint's
    run then held ~230 MiB more than its ~40 MiB working set. A fixed 1 MiB threshold keeps every
    temporary in its own mapping, unmapped on free. No-op off glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


class _State:
    """The journal of finished units in the staging directory."""

    def __init__(self, staging: Path, digest: str) -> None:
        self.path, self.digest = staging / STATE, digest
        self.units: dict[str, dict] = {}
        if self.path.is_file():
            saved = json.loads(self.path.read_text())
            if saved.get("plan") == digest:
                self.units = saved.get("units", {})

    def done(self, staging: Path, shard: str) -> bool:
        rec = self.units.get(shard)
        f = staging / shard
        if rec is None or not f.exists() or f.stat().st_size != rec["size"]:
            return False
        return sha256_file(f) == rec["sha256"]

    def record(self, shard: str, rec: dict) -> None:
        self.units[shard] = rec
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"plan": self.digest, "units": self.units}, indent=1))
        tmp.replace(self.path)


def _staging(target: Path) -> Path:
    staging = target.with_name(target.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def _finish(plan: Plan, staging: Path, state: _State, meta: dict) -> dict:
    src = plan.source
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = heads.quantization_config(config.get("quantization_config"),
                                                              plan.quantized(), plan.recipe)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weight_map, total = {}, 0
    for u in plan.units:
        for i in u.items:
            for p in output_tensors(i, plan.scale_dtype, plan.recipe.group_size):
                weight_map[p.name] = u.shard
                total += p.nbytes
    (staging / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                            indent=2) + "\n")
    shards = {u.shard for u in plan.units}
    for f in sorted(src.iterdir()):  # tokenizer, templates, generation config, ...
        if f.name in shards or f.name in ("config.json", INDEX, MANIFEST) or f.name.startswith("."):
            continue
        if f.is_file():
            shutil.copyfile(f, staging / f.name)
    tensors = {name: e for rec in state.units.values() for name, e in rec.get("errors", {}).items()}
    report = {**meta, "recipe": plan.recipe.as_dict(), "scale_dtype": str(plan.scale_dtype).removeprefix("torch."),
              "tensors": tensors, "kept": plan.skipped,
              "source_bytes": sum((src / s).stat().st_size for s in shards),
              "prepared_bytes": sum((staging / s).stat().st_size for s in shards)}
    (staging / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    files = {}
    for f in sorted(staging.iterdir()):
        if f.name in (MANIFEST, STATE) or f.name.endswith(".tmp"):
            continue
        rec = state.units.get(f.name)
        files[f.name] = rec["sha256"] if rec else sha256_file(f)
    (staging / MANIFEST).write_text(json.dumps({"meta": report | {"tensors": len(tensors)}, "files": files},
                                               indent=2) + "\n")
    return report


def prepare_checkpoint(source: Path, target: Path, recipe: heads.Recipe, meta: dict | None = None,
                       progress: ProgressSink | None = None) -> dict:
    """Prepare `source` into `target` (resuming an interrupted run); return the report."""
    from .cache import build_lock, publish

    plan = make_plan(source, recipe)
    sink = progress or ProgressSink()
    _steady_malloc()
    with build_lock(target):
        staging = _staging(target)
        state = _State(staging, plan.digest())
        with sink.run(plan) as bar:
            for unit in plan.units:
                if state.done(staging, unit.shard):
                    bar.skip(unit)
                    continue
                bar.start(unit)
                if unit.rewrite:
                    digest, errors = _rewrite(plan, unit, staging, bar.advance)
                else:
                    link_file(source / unit.shard, staging / unit.shard)
                    digest, errors = sha256_file(staging / unit.shard), {}
                    bar.advance(unit.source_bytes)
                state.record(unit.shard, {"sha256": digest, "size": (staging / unit.shard).stat().st_size,
                                          "errors": errors})
        report = _finish(plan, staging, state, {"source": str(source), **(meta or {})})
        (staging / STATE).unlink(missing_ok=True)
        publish(staging, target)
    return report


class ProgressSink:
    """Rich progress bars over source bytes: one for the run, one for the shard at hand."""

    def run(self, plan: Plan):
        from contextlib import contextmanager

        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        from .progress import console

        @contextmanager
        def bars():
            with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                          TimeRemainingColumn(), console=console) as prog:
                total = prog.add_task("prepare", total=sum(u.source_bytes for u in plan.units))
                yield _Bars(prog, total)

        return bars()


class _Bars:
    def __init__(self, prog, total) -> None:
        self.prog, self.total, self.task = prog, total, None

    def start(self, unit: Unit) -> None:
        if self.task is not None:
            self.prog.remove_task(self.task)
        verb = "int8" if unit.rewrite else "link"
        self.task = self.prog.add_task(f"  {verb} {unit.shard}", total=unit.source_bytes)

    def skip(self, unit: Unit) -> None:
        self.prog.advance(self.total, unit.source_bytes)

    def advance(self, n: int) -> None:
        self.prog.advance(self.total, n)
        if self.task is not None:
            self.prog.advance(self.task, n)
