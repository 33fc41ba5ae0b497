"""`hyperharness doctor [--profile P] [--live URL]`: is this install what the profile needs?

Offline checks: the vLLM version against the pin, every patch of the series applied, the plugin
entry point registered and importable, the profile's model files present with shapes matching
its config, and a key to serve with. On a machine with a GPU (or for a GPU profile) each card the
profile runs on: card, driver, power limit, clocks under a few seconds of load, other processes,
free memory against the profile's pool pin (backend/doctor_gpu.py). `--live URL` adds: /health,
/tokenize agreeing with the proxy's renderer on a tool-using conversation, and every route but
/health refusing a request without the key. Exit 1 when any check fails (warnings do not fail).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from backend import patchtool

OK, WARN, FAIL = "ok", "warn", "FAIL"

# Routes vLLM 0.32.0 serves that must refuse a keyless request (GET unless noted).
GUARDED_ROUTES = (
    ("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
    ("GET", "/load"), ("GET", "/ping"), ("GET", "/version"), ("GET", "/v1/models"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
)  # fmt: skip

SAMPLE_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
]  # fmt: skip
SAMPLE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "What is in README.md?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "read_file", "arguments": "{\"path\": \"README.md\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "# HyperHarness\nServing stack."},
    {"role": "user", "content": "Summarize it in one line."},
]  # fmt: skip


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str


Checks = Iterator[Check]


def check_engine() -> Checks:
    try:
        root = patchtool.vllm_root()
        series = patchtool.Series.load()
        version = patchtool.installed_version(root)
    except (FileNotFoundError, ValueError) as exc:
        yield Check("vllm", FAIL, str(exc))
        return
    yield Check("vllm", OK if version == series.pin else FAIL, f"{version} at {root} (pin {series.pin})")
    for path, state in patchtool.states(root, series):
        status = OK if state is patchtool.PatchState.APPLIED else FAIL
        yield Check(f"patch {path.name}", status, state.value)


def check_plugin() -> Checks:
    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "hyperharness"]
    if not eps:
        yield Check("plugin", FAIL, "entry point vllm.general_plugins:hyperharness missing (pip install -e .)")
        return
    try:
        eps[0].load()
        from backend.plugin import PluginSettings

        settings = PluginSettings.from_env()
    except Exception as exc:
        yield Check("plugin", FAIL, f"{eps[0].value}: {exc}")
        return
    yield Check("plugin", OK, f"{eps[0].value} ({settings})")


def _safetensors_shapes(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with file.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = (meta["dtype"], tuple(meta["shape"]))
    return shapes


def check_model_dir(model_dir: Path) -> Checks:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        yield Check("model files", FAIL, f"{config_path} missing")
        return
    config = json.loads(config_path.read_text())
    text = config.get("text_config", config)
    shapes = _safetensors_shapes(model_dir)
    if not shapes:
        yield Check("model files", FAIL, f"no *.safetensors in {model_dir}")
        return
    yield Check("model files", OK, f"{model_dir}: {len(shapes)} tensors, {config.get('architectures')}")
    layers = {int(m.group(1)) for n in shapes if (m := re.search(r"\.layers\.(\d+)\.", n))}
    want = text.get("num_hidden_layers")
    if want is not None:
        main = {i for i in layers if i < want}
        status = OK if main == set(range(want)) else FAIL
        yield Check("model layers", status, f"{len(main)} of num_hidden_layers={want} present")
    embeds = [n for n in shapes if n.endswith("embed_tokens.weight")]
    if embeds and "vocab_size" in text and "hidden_size" in text:
        want_shape = (text["vocab_size"], text["hidden_size"])
        got = shapes[embeds[0]][1]
        yield Check("model embeddings", OK if got == want_shape else FAIL, f"{embeds[0]} {got}, config {want_shape}")


def _resolve_model_dir(profile: object) -> Path | None:
    source = profile.model  # type: ignore[attr-defined]
    if source.path is not None:
        return Path(source.path)
    if source.embedded is not None:
        from backend.models import model_dir

        return model_dir(source.embedded)
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(source.hf_repo, "config.json", revision=source.hf_revision)
    return Path(found).parent if isinstance(found, str) else None


def check_profile(name: str) -> Checks:
    from backend.profiles import ProfileError, load_profile

    try:
        profile = load_profile(name)
    except ProfileError as exc:
        yield Check("profile", FAIL, str(exc))
        return
    yield Check("profile", OK, f"{profile.name}: {profile.engine.device}, {profile.engine.kv_cache_dtype} KV")
    engine = profile.engine
    spec = engine.speculative
    if spec is not None and spec.method == "dflash" and not spec.disable_eagle_block_drop:
        yield Check("dflash block drop", WARN, "set speculative.disable_eagle_block_drop: true (its context "
                    "K/V at p depends only on the target state at p; keeping the block saves re-prefill)")
    if engine.enable_prefix_caching and engine.prefix_match_unit is None:
        yield Check("prefix unit", WARN, "no prefix_match_unit: hits land on the scheduler block, not a hash unit")
    model_dir = _resolve_model_dir(profile)
    if model_dir is None or not model_dir.is_dir():
        hint = "make serve prepares embedded models" if profile.model.embedded else "download it first"
        yield Check("model files", FAIL, f"{profile.model} not on disk ({hint})")
        return
    if profile.model.prepare is not None:
        from backend.models import ModelPrepError, prepared

        try:
            model_dir = prepared.require(profile, model_dir)
            rep = prepared.report(model_dir)
            worst = max((e["rel_error"] for e in rep["tensors"].values()), default=0.0)
            yield Check("model prepared", OK, f"{model_dir}: {len(rep['tensors'])} int8 tensors, worst relative "
                        f"error {worst:.3%} (< {rep['recipe']['max_rel_error']:.0%})")
        except ModelPrepError as exc:
            yield Check("model prepared", FAIL, str(exc))
    yield from check_model_dir(model_dir)


def check_key(key: str | None) -> Checks:
    if key:
        yield Check("api key", OK, f"present ({len(key)} chars)")
    else:
        yield Check("api key", WARN, "no key (HYPERHARNESS_API_KEY / --key-file): bind 127.0.0.1 only")


def check_live(url: str, key: str | None, model_dir: Path | None, served_name: str | None) -> Checks:
    url = url.rstrip("/")
    with httpx.Client(timeout=30) as client:
        try:
            health = client.get(f"{url}/health")
        except httpx.HTTPError as exc:
            yield Check("live health", FAIL, f"{url}/health: {exc}")
            return
        yield Check("live health", OK if health.status_code == 200 else FAIL, f"/health {health.status_code}")
        open_routes = []
        for method, path in GUARDED_ROUTES:
            code = client.request(method, f"{url}{path}", json={} if method == "POST" else None).status_code
            if code != 401:
                open_routes.append(f"{method} {path} -> {code}")
        yield Check("live auth", FAIL if open_routes else OK, ", ".join(open_routes) or "every route refuses no key")
        if model_dir is None or served_name is None:
            yield Check("live tokenize", WARN, "no --profile: skipped the /tokenize agreement check")
            return
        from proxy.format import load_format

        expected = load_format(model_dir).render(SAMPLE_MESSAGES, SAMPLE_TOOLS).ids
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"model": served_name, "messages": SAMPLE_MESSAGES, "tools": SAMPLE_TOOLS, "add_generation_prompt": True}
        resp = client.post(f"{url}/tokenize", json=body, headers=headers)
        if resp.status_code != 200:
            yield Check("live tokenize", FAIL, f"/tokenize {resp.status_code}: {resp.text[:200]}")
            return
        got = resp.json()["tokens"]
        if got == expected:
            yield Check("live tokenize", OK, f"{len(got)} ids agree with the proxy's renderer")
            return
        pairs = zip(got, expected, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(got), len(expected)))
        yield Check("live tokenize", FAIL, f"differ at id {first} (engine {len(got)}, renderer {len(expected)})")


def run(checks: list[Callable[[], Checks]]) -> list[Check]:
    results = []
    for producer in checks:
        for check in producer():
            results.append(check)
            typer.echo(f"  {check.status:<4}  {check.name:<44} {check.detail}")
    return results


def doctor(
    profile: Annotated[str | None, typer.Option("--profile", help="profile name from configs/")] = None,
    live: Annotated[str | None, typer.Option("--live", help="engine or proxy base URL to probe")] = None,
    key_file: Annotated[Path | None, typer.Option("--key-file", help="file holding the API key")] = None,
    gpu_load: Annotated[bool, typer.Option("--gpu-load/--no-gpu-load",
                                           help="load each card for a few seconds to read its clocks")] = True,
) -> None:
    """Check the engine install (version, patch series, plugin), a profile's model, the GPUs it runs on,
    and a live server."""
    key = os.environ.get("HYPERHARNESS_API_KEY") or os.environ.get("VLLM_API_KEY")
    if key_file is not None:
        key = key_file.read_text().strip()
    checks: list[Callable[[], Checks]] = [check_engine, check_plugin, lambda: check_key(key)]
    model_dir = served = None
    if profile is not None:
        checks.append(lambda: check_profile(profile))
        from backend.profiles import ProfileError, load_profile

        try:
            loaded = load_profile(profile)
            model_dir, served = _resolve_model_dir(loaded), loaded.model.served_name
        except ProfileError:
            pass
    gpu_profile = None
    if profile is not None:
        from backend.profiles import ProfileError, load_profile

        with contextlib.suppress(ProfileError):  # check_profile reports it
            gpu_profile = load_profile(profile)
    if shutil.which("nvidia-smi") or (gpu_profile is not None and gpu_profile.engine.device == "cuda"):
        from backend.doctor_gpu import check_gpus

        checks.append(lambda: check_gpus(gpu_profile, load=gpu_load))
    if live is not None:
        checks.append(lambda: check_live(live, key, model_dir, served))
    results = run(checks)
    failed = [c for c in results if c.status == FAIL]
    typer.echo(f"{len(failed)} failed, {sum(c.status == WARN for c in results)} warnings, {len(results)} checks")
    if failed:
        raise typer.Exit(1)
