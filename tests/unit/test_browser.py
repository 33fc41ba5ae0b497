"""backend/browser.py: where the dashboard test's Chromium comes from, and what a user who cannot
install it is told (a plain user gets the exact command; the test then fails with it, never skips)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backend import browser

pytestmark = pytest.mark.unit


def test_plain_user_without_chromium_is_told_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no chromium, no apt-get, no brew
    monkeypatch.delenv("HYPERHARNESS_CHROMIUM", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    path, why = browser.ensure(log=False)
    assert path is None
    assert "sudo apt-get update && sudo apt-get install -y chromium" in why


def test_an_explicit_browser_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = tmp_path / "my-chrome"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("HYPERHARNESS_CHROMIUM", str(exe))
    assert browser.ensure(log=False) == (str(exe), "")
    monkeypatch.setenv("HYPERHARNESS_CHROMIUM", str(tmp_path / "missing"))
    path, why = browser.ensure(log=False)
    assert path is None and "is not an executable" in why
