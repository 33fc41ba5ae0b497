"""The real harness CLIs, pinned, installed once into `.cache/harnesses/` (git-ignored) for the tests and CI.

    python -m harness_adapters.clients [dsh pi hermes]     # install (idempotent); prints each binary

Pins are the versions the issue recorded on the wire. Each install goes into its own directory (a venv
for the Python ones: Hermes pulls ~60 packages that must not meet ours) and ends with a stamp file naming
the pin, so a second run costs a stat; a changed pin re-installs.
- DeepSeek Harness: PyPI `deepseek-harness-runtime-bin` with `--no-deps` (a 95 MB wheel carrying a
  self-contained `dsh`; the npm package did not resolve here). `dsh` needs an explicit `DSH_HOME`.
- Pi: npm `@mariozechner/pi-coding-agent` (needs node >= 20).
- Hermes: PyPI `hermes-agent`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("HYPERHARNESS_HARNESS_CACHE", REPO / ".cache" / "harnesses"))


@dataclass(frozen=True, slots=True)
class Client:
    name: str
    pin: str  # what is installed, also the stamp's content
    kind: str  # "pip" | "npm"
    binary: str  # path of the entry point inside the install directory
    no_deps: bool = False

    @property
    def root(self) -> Path:
        return CACHE / self.name

    @property
    def path(self) -> Path:
        return self.root / self.binary

    @property
    def stamp(self) -> Path:
        return self.root / ".installed"


CLIENTS = {
    "dsh": Client("dsh", "deepseek-harness-runtime-bin==0.2.1rc2", "pip", "venv/bin/dsh", no_deps=True),
    "pi": Client("pi", "@mariozechner/pi-coding-agent@0.73.1", "npm", "node_modules/.bin/pi"),
    "hermes": Client("hermes", "hermes-agent==0.19.0", "pip", "venv/bin/hermes"),
}


class InstallError(Exception):
    pass


def installed(client: Client) -> bool:
    try:
        return client.stamp.read_text().strip() == client.pin and client.path.exists()
    except FileNotFoundError:
        return False


def _run(argv: list[str], log: Path) -> None:
    with log.open("a") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text()[-2000:]
        raise InstallError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}); log {log}:\n{tail}")


def _install(client: Client, log: Path) -> None:
    if client.kind == "pip":
        env_dir = client.root / "venv"
        if not (env_dir / "bin" / "python").exists():
            venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
        argv = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run(argv + (["--no-deps"] if client.no_deps else []) + [client.pin], log)
        return
    npm = shutil.which("npm")
    if npm is None:
        raise InstallError(f"{client.name} needs npm (node >= 20) on PATH")
    _run([npm, "install", "--prefix", str(client.root), "--no-audit", "--no-fund", "--loglevel=error", client.pin],
         log)


def ensure(name: str) -> Path:
    """The client's binary, installing it first if needed (serialized across processes by a lock)."""
    client = CLIENTS[name]
    if installed(client):
        return client.path
    client.root.mkdir(parents=True, exist_ok=True)
    with (CACHE / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if installed(client):
            return client.path
        client.stamp.unlink(missing_ok=True)
        _install(client, CACHE / f"{name}-install.log")
        if not client.path.exists():
            raise InstallError(f"{client.pin} installed but {client.path} is missing")
        client.stamp.write_text(client.pin + "\n")
    return client.path


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(CLIENTS)
    unknown = [n for n in names if n not in CLIENTS]
    if unknown:
        print(f"unknown harness {unknown}; one of {list(CLIENTS)}", file=sys.stderr)
        return 2
    for name in names:
        try:
            print(f"{name}: {ensure(name)}")
        except InstallError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
