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


def draft_vocab_dir(profile, source: Path) -> Path | None:
    """The prepared copy with the MTP drafter's head over the profile's draft vocabulary (draft_head.py)."""
    dv = profile.model.prepare.draft_vocab if profile.model.prepare else None
    if dv is None:
        return None
    base = prepared_dir(profile, source)
    return base.with_name(f"{base.name}-dv{dv.size}-{dv.prompt_set}")


def draft_vocab_file(profile, source: Path) -> Path:
    from .draft_vocab import vocab_path

    dv = profile.model.prepare.draft_vocab
    return vocab_path(cache_root(), prepared_dir(profile, source).name, dv.prompt_set, dv.size)


def require(profile, source: Path) -> Path:
    """The finished prepared copy of `source` for this profile, or an error saying how to make it."""
    target = prepared_dir(profile, source)
    if not verify_manifest(target):
        raise ModelPrepError(
            f"profile {profile.name} serves a prepared copy of {source} "
            f"(int8 {', '.join(profile.model.prepare.parts)}); "
            f"run `hyperharness models prepare --profile {profile.name}` first (resumable)")
    dv_dir = draft_vocab_dir(profile, source)
    if dv_dir is not None and not verify_manifest(dv_dir):
        raise ModelPrepError(
            f"profile {profile.name}'s MTP drafter needs its draft vocabulary: serve {target} (e.g. with a copy of "
            f"this profile without model.prepare.draft_vocab), then run `hyperharness models draft-vocab "
            f"--profile {profile.name} --base-url URL`")
    return dv_dir or target


def report(target: Path) -> dict:
    return json.loads((target / REPORT).read_text())


def prepare_profile(profile, *, download: bool = True, progress: ProgressSink | None = None) -> tuple[Path, dict]:
    """Prepare the profile's checkpoint (resuming an interrupted run); (directory, report)."""
    src = source_dir(profile, download=download)
    target = prepared_dir(profile, src)
    if verify_manifest(target):
        rep = report(target)
    else:
        meta = {"profile": profile.name, "hf_repo": profile.model.hf_repo, "hf_revision": profile.model.hf_revision}
        rep = prepare_checkpoint(src, target, recipe(profile), meta=meta, progress=progress)
    dv_dir = draft_vocab_dir(profile, src)
    if dv_dir is not None and not verify_manifest(dv_dir) and draft_vocab_file(profile, src).is_file():
        from .draft_head import add_draft_head

        add_draft_head(target, json.loads(draft_vocab_file(profile, src).read_text()), dv_dir)
    return target, rep


def build_draft_vocab(profile, base_url: str, *, model: str | None = None, api_key: str | None = None,
                      concurrency: int = 8, progress=None) -> tuple[Path, dict]:
    """Count the profile's model's own outputs on the shipped prompts, choose the draft vocabulary and
    give the prepared checkpoint its drafter head; (served directory, vocabulary)."""
    from .draft_head import add_draft_head
    from .draft_vocab import build, collect, load_prompts, special_ids, vocab_size_of

    dv = profile.model.prepare.draft_vocab if profile.model.prepare else None
    if dv is None:
        raise ModelPrepError(f"profile {profile.name} has no model.prepare.draft_vocab")
    src = source_dir(profile, download=False)
    base = prepared_dir(profile, src)
    if not verify_manifest(base):
        raise ModelPrepError(f"run `hyperharness models prepare --profile {profile.name}` first")
    prompts = load_prompts(dv.prompt_set)
    outputs = collect(base_url, model or profile.model.served_name, prompts, max_tokens=dv.max_tokens,
                      api_key=api_key, concurrency=concurrency, progress=progress)
    meta = {"prompt_set": dv.prompt_set, "max_tokens": dv.max_tokens, "base_url": base_url, "model": str(base)}
    vocab = build(outputs, special_ids(base), dv.size, vocab_size_of(base), meta)
    path = draft_vocab_file(profile, src)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(vocab) + "\n")
    target = draft_vocab_dir(profile, src)
    if target is None:  # unreachable: the profile has a draft_vocab (checked above)
        raise ModelPrepError(f"profile {profile.name} has no model.prepare.draft_vocab")
    return add_draft_head(base, vocab, target), vocab
