"""The non-Python binaries the tests run (backend/binaries.py): each resolves to one copy, the venv's when it
has one, which the test session's PATH also finds first, and it runs; and when none can be found, a test
session fails once, naming the binary and the command that installs it, and skips the other tests that
need it (tests/preflight.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend import binaries
from tests.preflight import need

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(binaries.BINARIES))
def test_binary_resolves_to_one_running_copy(name: str) -> None:
    path = need(name)[name]
    own = binaries.binaries_dir() / name
    if own.exists():
        assert path == str(own), "the venv's copy must win over PATH's"
    assert shutil.which(name) == path, "the session's PATH (for processes the tests start) finds the same copy"
    assert os.environ["PATH"].split(os.pathsep)[0] == str(binaries.binaries_dir())
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\d+\.\d+", out.stdout), out.stdout


def test_missing_binary_fails_once_with_the_install_command(tmp_path: Path) -> None:
    """A session with no redis-server anywhere (an empty binaries dir, an empty PATH): the Redis variants of
    the store tests give one failure that says what to run, and skips, not one error each."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PATH=str(empty), HYPERHARNESS_BINARIES_DIR=str(empty))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-m", "redis",
         "tests/proxy/test_store.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary)}
    assert proc.returncode == 1, out
    assert counts.get("error") == 1 and counts.get("skipped", 0) >= 2, summary
    assert "passed" not in counts and "failed" not in counts, summary
    assert out.count("needs redis-server") == 1 and "redis-server not found" in out, out
    assert "-m backend.install binaries" in out and "apt-get install -y redis-server" in out, out
    assert "reported once, by tests/proxy/test_store.py::" in out, out
