"""Does each card hold its weights, its KV pool and a reserve, within what vLLM may take of it?

vLLM takes `gpu_memory_utilization` × the card's memory. With the pool pinned by
`kv_cache_memory_bytes` (the GPU profiles), weights + pool + reserve (CUDA graphs, activations) must
fit in that; the weights are the checkpoint's as it will be served, read from its headers
(backend/weights.py), so `models prepare` (int8 heads: about 2.5 GB less for the 27B) is what makes a
profile fit. Unknown until the checkpoint is on disk: reported, not refused.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .profiles import Profile
from .weights import CheckpointWeights

GiB = 1 << 30


@dataclass(frozen=True)
class CardFit:
    """One card: weights + KV pool + reserve against what vLLM may take of it (memory × utilization).
    Unknown (and not refused) until the checkpoint is on disk."""

    stage: int
    weight_bytes: int | None
    pool_bytes: int
    reserve_bytes: int
    usable_bytes: int | None
    note: str = ""

    @property
    def known(self) -> bool:
        return self.weight_bytes is not None and self.usable_bytes is not None

    @property
    def total_bytes(self) -> int | None:
        """weights + pool + reserve (None: weights unknown)."""
        return None if self.weight_bytes is None else self.weight_bytes + self.pool_bytes + self.reserve_bytes

    @property
    def fits(self) -> bool:
        total = self.total_bytes
        return total is None or self.usable_bytes is None or total <= self.usable_bytes

    def describe(self, staged: bool) -> tuple[str, str]:
        gib = lambda b: f"{b / GiB:,.2f} GiB"  # noqa: E731
        key = f"GPU {self.stage} memory" if staged else "GPU memory"
        total = self.total_bytes
        if self.weight_bytes is None or total is None or self.usable_bytes is None:
            why = "weights unknown: checkpoint not on disk" if self.weight_bytes is None else "device memory unknown"
            return key, f"not checked ({why}{'; ' + self.note if self.note else ''})"
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return key, (f"weights {gib(self.weight_bytes)} + pool {gib(self.pool_bytes)} + reserve "
                     f"{gib(self.reserve_bytes)} = {gib(total)} of {gib(self.usable_bytes)} usable: {verdict}"
                     + (f" ({self.note})" if self.note else ""))



def stage_weights(profile: Profile, weights: CheckpointWeights | None, drafter_bytes: int | None,
                   stages: list[tuple[int, int]]) -> list[int | None]:
    """Each stage's weight bytes; None where unknown (no checkpoint, or a drafter not on disk)."""
    spec = profile.engine.speculative
    if weights is None:
        return [None] * len(stages)
    out: list[int | None] = []
    for r, (s, e) in enumerate(stages):
        last = r == len(stages) - 1
        b = weights.stage(s, e, first=r == 0, last=last, with_mtp=spec is not None and spec.method == "mtp")
        if last and spec is not None and spec.method == "dflash":
            out.append(None if drafter_bytes is None else b + drafter_bytes)
        else:
            out.append(b)
    return out


def card_fits(profile: Profile, device_memory_bytes: int | None, budget: int, stage_weights: list[int | None],
           drafter_bytes: int | None) -> tuple[CardFit, ...]:
    eng = profile.engine
    if eng.device != "cuda":
        return ()
    gib = profile.memory.device_memory_gib
    mem = device_memory_bytes or (int(gib * GiB) if gib else None)
    usable = int(mem * (eng.gpu_memory_utilization or 0.9)) if mem else None
    reserve = int(profile.memory.reserve_gib * GiB)
    pinned = eng.kv_cache_memory_bytes is not None
    note = ""
    if eng.speculative is not None and eng.speculative.method == "dflash" and drafter_bytes is None:
        note = f"drafter {eng.speculative.model} not on disk"
    if not pinned:  # the budget already is what is left after the weights
        return ()
    return tuple(CardFit(r, w, budget, reserve, usable, note if r == len(stage_weights) - 1 else "")
                 for r, w in enumerate(stage_weights))


def local_weights(profile: Profile, model_path) -> tuple[CheckpointWeights | None, int | None]:
    """What `geometry.compute(..., weights=, drafter_weight_bytes=)` needs, from whatever is on disk:
    the served checkpoint's headers and the DFlash drafter's (from the Hugging Face cache)."""
    from pathlib import Path

    from .weights import from_checkpoint, total_bytes

    path = Path(model_path)
    weights = from_checkpoint(path) if (path / "config.json").is_file() else None
    spec = profile.engine.speculative
    drafter = None
    if spec is not None and spec.method == "dflash" and spec.model:
        local: Path | None = Path(spec.model).expanduser()
        if local is None or not local.is_dir():
            try:
                from huggingface_hub import try_to_load_from_cache
            except ImportError:
                return weights, None
            found = try_to_load_from_cache(spec.model, "config.json")
            local = Path(found).parent if isinstance(found, str) else None
        drafter = total_bytes(local) if local is not None else None
    return weights, drafter


def served_weights(profile: Profile) -> tuple[CheckpointWeights | None, int | None]:
    """The weights the profile would serve, from disk only: the prepared copy when finished (the
    prepared sizes), else the download; (None, None) when neither is there."""
    if profile.model.embedded is not None:
        return None, None
    from .models import ModelPrepError, prepared

    try:
        source = prepared.source_dir(profile, download=False)
    except ModelPrepError:
        return None, None
    served = source  # until prepared, counted as downloaded: the card check then shows what preparing saves
    if profile.model.prepare is not None:
        with contextlib.suppress(ModelPrepError):
            served = prepared.require(profile, source)
    return local_weights(profile, served)
