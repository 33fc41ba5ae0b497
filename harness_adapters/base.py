"""What every adapter shares: the proxy's model facts, planned file changes (diff, backup, write) and
the merge helpers that keep a user's unrelated settings.

An adapter never writes directly: it returns `FileChange`s (path, text before, text after); the CLI shows
them as a unified diff under `--dry-run`, else writes each one after copying the old file to
`<file>.hyperharness-backup`. A key never appears in a config file as a literal: it goes to the harness'
own secrets file (`.env`) as `HYPERHARNESS_API_KEY`, or is read from the key file by command (Pi).
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import yaml

PROVIDER_ID = "hyperharness"  # the provider name each adapter adds; `remove` deletes only this
KEY_ENV = "HYPERHARNESS_API_KEY"
BACKUP_SUFFIX = ".hyperharness-backup"
# Output cap when the server does not say: a quarter of the window, at most 32K (what the research
# found harnesses default to when they are sane; DSH's 256K and Hermes' whole-window caps are not).
MAX_OUTPUT_CAP = 32768


class AdapterError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Target:
    """Where and what the harness should talk to."""

    base_url: str  # ends in /v1
    model: str
    context_window: int
    max_output: int
    key: str | None  # the proxy's bearer key; None for a keyless loopback proxy
    key_file: Path | None = None


def default_max_output(context_window: int) -> int:
    return max(256, min(MAX_OUTPUT_CAP, context_window // 4))


def fetch_target(base_url: str, *, key: str | None, model: str | None = None, max_output: int | None = None,
                 key_file: Path | None = None, timeout_s: float = 10.0) -> Target:
    """Model id and window from the proxy's `/v1/models` (`context_length` / `max_model_len`)."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.get(base + "/models", headers=headers, timeout=timeout_s)
        resp.raise_for_status()
        entries = resp.json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise AdapterError(f"cannot read {base}/models: {exc}") from exc
    if not entries:
        raise AdapterError(f"{base}/models lists no model")
    entry = next((e for e in entries if e.get("id") == model), None) if model else entries[0]
    if entry is None:
        raise AdapterError(f"{base}/models has no model {model!r} (has {[e.get('id') for e in entries]})")
    window = entry.get("context_length") or entry.get("max_model_len") or entry.get("context_window")
    if not isinstance(window, int) or window <= 0:
        raise AdapterError(f"{base}/models does not say the context window of {entry.get('id')!r}")
    out = max_output if max_output is not None else default_max_output(window)
    return Target(base_url=base, model=str(entry["id"]), context_window=window, max_output=min(out, window),
                  key=key, key_file=key_file)


@dataclass(frozen=True, slots=True)
class FileChange:
    path: Path
    before: str | None  # None: the file does not exist
    after: str | None  # None: delete the file

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        a = (self.before or "").splitlines(keepends=True)
        b = (self.after or "").splitlines(keepends=True)
        name = str(self.path)
        return "".join(difflib.unified_diff(a, b, fromfile=name if self.before is not None else "/dev/null",
                                            tofile=name if self.after is not None else "/dev/null"))

    def apply(self) -> Path | None:
        """Write (or delete) the file; returns the backup path when an existing file was replaced."""
        if not self.changed:
            return None
        backup = None
        if self.before is not None:
            backup = self.path.with_name(self.path.name + BACKUP_SUFFIX)
            shutil.copy2(self.path, backup)
        if self.after is None:
            self.path.unlink(missing_ok=True)
            return backup
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(self.after)
        if self.path.name == ".env" or self.path.suffix == ".env":
            os.chmod(tmp, 0o600)  # holds the key
        tmp.replace(self.path)
        return backup


class Adapter(Protocol):
    name: str

    def home(self, env: Mapping[str, str]) -> Path:
        """The harness' config directory (its own env override, else the default under $HOME)."""
        ...

    def install(self, target: Target, home: Path) -> list[FileChange]: ...

    def remove(self, home: Path) -> list[FileChange]: ...

    def show(self, home: Path) -> dict[str, Any]:
        """What the harness is configured to use now (our provider's entry, or {})."""
        ...

    def run_hint(self, home: Path) -> str:
        """The command that starts the harness on the proxy after `install`."""
        ...


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def load_yaml(text: str | None, path: Path) -> dict[str, Any]:
    if not text or not text.strip():
        return {}
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AdapterError(f"{path} is not valid YAML; fix or move it first: {exc}") from exc
    if not isinstance(data, dict):
        raise AdapterError(f"{path} must hold a mapping at the top level")
    return data


def dump_yaml(data: Mapping[str, Any]) -> str:
    return str(yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False, allow_unicode=True))


def load_json(text: str | None, path: Path) -> dict[str, Any]:
    if not text or not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise AdapterError(f"{path} is not valid JSON; fix or move it first: {exc}") from exc
    if not isinstance(data, dict):
        raise AdapterError(f"{path} must hold a JSON object")
    return data


def dump_json(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def set_env_line(text: str | None, name: str, value: str | None) -> str | None:
    """`.env` text with `name=value` set (or removed when value is None); other lines untouched."""
    lines = (text or "").splitlines()
    kept = [ln for ln in lines if ln.split("=", 1)[0].strip().removeprefix("export ").strip() != name]
    if value is not None:
        kept.append(f"{name}={value}")
    if not kept:
        return None if text is None else ""
    return "\n".join(kept) + "\n"


def env_value(text: str | None, name: str) -> str | None:
    for ln in (text or "").splitlines():
        key, sep, value = ln.partition("=")
        if sep and key.strip().removeprefix("export ").strip() == name:
            return value.strip().strip("'\"")
    return None


def key_change(home: Path, target: Target, env_file: str = ".env") -> FileChange:
    """The harness' `.env` with our key set (a placeholder for a keyless proxy: the harnesses refuse an
    empty key)."""
    path = home / env_file
    before = read_text(path)
    return FileChange(path, before, set_env_line(before, KEY_ENV, target.key or "none"))


def key_removal(home: Path, env_file: str = ".env") -> FileChange:
    path = home / env_file
    before = read_text(path)
    return FileChange(path, before, set_env_line(before, KEY_ENV, None) if before is not None else None)
