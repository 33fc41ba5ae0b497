"""The headless browser the dashboard test drives: Debian's `chromium`, through the DevTools protocol.

    python -m backend.install browser      # as root: apt-get install chromium; else prints the command

No PyPI wheel ships a Chromium build (Playwright's browsers come from its own download host, which this
project does not use), so the system package is the one source, like redis-server/node where their
wheels cannot be had (backend/binaries.py). `make venv` does not install it (a browser is a test-only
dependency of one test); the dashboard test calls `ensure()` itself, and when the browser still cannot
be had it fails naming the command, never skipping.
"""

from __future__ import annotations

import os
import shutil
import subprocess

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
APT_PACKAGE = "chromium"


def find() -> str | None:
    """The browser's path: $HYPERHARNESS_CHROMIUM, else the first of CANDIDATES on PATH."""
    given = os.environ.get("HYPERHARNESS_CHROMIUM")
    if given:
        return given if os.access(given, os.X_OK) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def how_to_install() -> str:
    if shutil.which("brew"):
        return "brew install --cask chromium   (or set HYPERHARNESS_CHROMIUM to a Chrome/Chromium binary)"
    sudo = "" if os.geteuid() == 0 else "sudo "
    return (f"{sudo}apt-get update && {sudo}apt-get install -y {APT_PACKAGE}"
            "   (or set HYPERHARNESS_CHROMIUM to a Chrome/Chromium binary)")


def ensure(log: bool = True) -> tuple[str | None, str]:
    """(path, "") when a browser is there or could be installed (root + apt-get); else (None, why + how)."""
    path = find()
    if path is not None:
        return path, ""
    if os.environ.get("HYPERHARNESS_CHROMIUM"):
        return None, f"HYPERHARNESS_CHROMIUM={os.environ['HYPERHARNESS_CHROMIUM']} is not an executable"
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if log:
            print(f"browser: installing {APT_PACKAGE} with apt-get (once)", flush=True)
        subprocess.call(["apt-get", "update", "-qq"], env=env, stdout=subprocess.DEVNULL)
        subprocess.call(["apt-get", "install", "-y", "-qq", "--no-install-recommends", APT_PACKAGE], env=env,
                        stdout=subprocess.DEVNULL)
        path = find()
        if path is not None:
            return path, ""
        return None, f"apt-get could not install {APT_PACKAGE}; install a Chromium with: {how_to_install()}"
    return None, f"no Chromium found ({', '.join(CANDIDATES)} on PATH); install one with: {how_to_install()}"
