"""A profile's prepared model: where its checkpoint comes from, where the prepared copy lives, and
whether it is ready. `serve` runs the prepared copy of a profile that has `model.prepare`.

The prepared directory is `<cache>/prepared/<source>-<digest>`, the digest covering the resolved source
directory (a Hugging Face snapshot path names its commit) and the recipe, so two profiles with the
same checkpoint and recipe share one preparation, and a new revision or recipe gets its own.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from . import heads
from .cache import ModelPrepError, cache_root, verify_manifest
from .prepare import REPORT, ProgressSink, prepare_checkpoint


def recipe(profile) -> heads.Recipe:
    prep = profile.model.prepare
    if prep is None:
        raise ModelPrepError(f"profile {profile.name} has no model.prepare section: nothing to prepare")
    return heads.Recipe(parts=tuple(prep.parts), keep_mtp_fc=prep.keep_mtp_fc)


def source_dir(profile, *, download: bool) -> Path:
    """The downloaded checkpoint (`download`: fetch it with huggingface_hub, resumable)."""
    m = profile.model
    if m.path is not None:
        path = Path(m.path).expanduser()
        if not (path / "config.json").is_file():
            raise ModelPrepError(f"{path}: no config.json; model.path must be a downloaded checkpoint")
        return path
    if m.hf_repo is None:
        raise ModelPrepError(f"profile {profile.name}: an embedded model needs no preparation")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(m.hf_repo, revision=m.hf_revision, local_files_only=not download))
    except LocalEntryNotFoundError as exc:
        raise ModelPrepError(
            f"{m.hf_repo} is not downloaded; run `huggingface-cli download {m.hf_repo}` or "
            f"`hyperharness models prepare --profile {profile.name}` (which downloads it)") from exc


def prepared_dir(profile, source: Path) -> Path:
    m = profile.model
    name = m.hf_repo.replace("/", "--") if m.hf_repo else source.name
    key = json.dumps({"source": str(source.resolve()), "recipe": recipe(profile).as_dict()}, sort_keys=True)
    return cache_root() / "prepared" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def require(profile, source: Path) -> Path:
    """The finished prepared copy of `source` for this profile, or an error saying how to make it."""
    target = prepared_dir(profile, source)
    if not verify_manifest(target):
        raise ModelPrepError(
            f"profile {profile.name} serves a prepared copy of {source} (int8 {', '.join(profile.model.prepare.parts)}); "
            f"run `hyperharness models prepare --profile {profile.name}` first (resumable)")
    return target


def report(target: Path) -> dict:
    return json.loads((target / REPORT).read_text())


def prepare_profile(profile, *, download: bool = True, progress: ProgressSink | None = None) -> tuple[Path, dict]:
    """Prepare the profile's checkpoint (resuming an interrupted run); (directory, report)."""
    src = source_dir(profile, download=download)
    target = prepared_dir(profile, src)
    if verify_manifest(target):
        return target, report(target)
    meta = {"profile": profile.name, "hf_repo": profile.model.hf_repo, "hf_revision": profile.model.hf_revision}
    return target, prepare_checkpoint(src, target, recipe(profile), meta=meta, progress=progress)
