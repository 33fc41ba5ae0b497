"""The model cache: where prepared models live, how a finished one is recognised, and the lock that
keeps two processes (a test fixture and `make serve`, say) from building the same model at once.

A prepared model is a directory holding its files plus `manifest.json` (sha256 of every file). A
directory without a manifest is an interrupted build and is rebuilt; one whose files no longer match
their hashes is reported, never silently reused.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

MANIFEST = "manifest.json"


class ModelPrepError(RuntimeError):
    """A model could not be prepared; the message says what to do."""


def cache_root() -> Path:
    env = os.environ.get("HYPERHARNESS_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hyperharness"
    return base


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(model_dir: Path, meta: dict) -> None:
    files = {
        p.name: sha256_file(p) for p in sorted(model_dir.iterdir()) if p.is_file() and p.name != MANIFEST
    }
    (model_dir / MANIFEST).write_text(json.dumps({"meta": meta, "files": files}, indent=2) + "\n")


def verify_manifest(model_dir: Path, deep: bool = False) -> bool:
    """True when the directory holds a finished build. `deep` re-hashes every file."""
    path = model_dir / MANIFEST
    if not path.is_file():
        return False
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as exc:
        raise ModelPrepError(f"{path}: unreadable manifest ({exc}); delete {model_dir} to rebuild") from exc
    for name, digest in files.items():
        f = model_dir / name
        if not f.is_file():
            raise ModelPrepError(f"{model_dir}: {name} is missing; delete the directory to rebuild")
        if deep and sha256_file(f) != digest:
            raise ModelPrepError(f"{model_dir}: {name} does not match its sha256; delete the directory to rebuild")
    return True


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fresh_staging(target: Path) -> Path:
    """A clean sibling directory to build into; renamed over `target` only when complete."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
