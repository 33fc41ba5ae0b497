"""The proxy's bearer key: from the environment, else a file generated once with mode 0600."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

ENV_VAR = "HYPERHARNESS_API_KEY"


def default_key_file() -> Path:
    base = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config"))
    return base / "hyperharness" / "api_key"


def load_or_create_key(path: Path, create: bool = True) -> tuple[str | None, str]:
    """Return (key, where it came from). Creates the file (0600) on first use, unless `create` is off
    (a dry run), when a missing file gives (None, "<path> (created on first run)")."""
    if env := os.environ.get(ENV_VAR):
        return env.strip(), f"${ENV_VAR}"
    if path.is_file():
        key = path.read_text().strip()
        if key:
            return key, str(path)
    if not create:
        return None, f"{path} (created on first run)"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "hh-" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, f"{path} (created)"
