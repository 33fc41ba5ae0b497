"""`hyperharness adapters install|show|remove {dsh,pi,hermes}`.

`make_app(keys)` builds the command group; the composition root (backend/cli.py) says where the proxy's
key lives (`KeySource`), so this package imports nothing of backend/."""


from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console

from harness_adapters import ADAPTERS, Adapter, AdapterError, FileChange, fetch_target

out = Console()
err = Console(stderr=True)
DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


def _adapter(name: str) -> Adapter:
    if name not in ADAPTERS:
        err.print(f"[red]error:[/] unknown harness {name!r}; one of {', '.join(ADAPTERS)}")
        raise typer.Exit(2)
    return ADAPTERS[name]


def _home(adapter: Adapter, home: Path | None) -> Path:
    return home if home is not None else adapter.home(os.environ)


@dataclass(frozen=True)
class KeySource:
    """Where `hyperharness serve` takes the proxy's key from: an environment variable, else a file."""

    env_var: str
    default_file: Path


def resolve_key(keys: KeySource, key_file: Path | None, no_key: bool) -> tuple[str | None, Path | None]:
    """The proxy key: --key-file, else the key's environment variable, else the file `serve` made."""
    if no_key:
        return None, None
    if key_file is not None:
        try:
            key = key_file.read_text().strip()
        except OSError as exc:
            raise AdapterError(f"cannot read key file {key_file}: {exc}") from exc
        if not key:
            raise AdapterError(f"key file {key_file} is empty")
        return key, key_file
    if os.environ.get(keys.env_var):
        return os.environ[keys.env_var].strip(), None
    default = keys.default_file
    if default.is_file() and default.read_text().strip():
        return default.read_text().strip(), default
    return None, None


def _apply(changes: list[FileChange], dry_run: bool) -> None:
    for change in changes:
        if not change.changed:
            out.print(f"unchanged: {change.path}")
            continue
        if dry_run:
            out.print(change.diff(), markup=False, highlight=False)
            continue
        backup = change.apply()
        verb = "removed" if change.after is None else "wrote"
        out.print(f"{verb}: {change.path}" + (f" (backup: {backup})" if backup else ""))


def make_app(keys: KeySource) -> typer.Typer:
    app = typer.Typer(help="Point an agent harness (dsh, pi, hermes) at the proxy.", no_args_is_help=True)

    @app.command()
    def install(
        harness: str = typer.Argument(..., help="dsh | pi | hermes"),
        base_url: str = typer.Option(DEFAULT_BASE_URL, help="the proxy's OpenAI base URL"),
        model: str = typer.Option(None, help="model id (default: the first one the proxy serves)"),
        key_file: Path = typer.Option(None, help="proxy key file (default: $HYPERHARNESS_API_KEY, else the serve key)"),
        no_key: bool = typer.Option(False, "--no-key", help="the proxy runs without a key"),
        max_output: int = typer.Option(None, help="output token cap (default: a quarter of the window, <= 32768)"),
        home: Path = typer.Option(None, help="the harness' config directory (default: its env var, else ~)"),
        dry_run: bool = typer.Option(False, "--dry-run", help="print the diff; write nothing"),
    ) -> None:
        """Write or merge the harness' config so it uses the proxy (unrelated settings are kept)."""
        adapter = _adapter(harness)
        try:
            key, kfile = resolve_key(keys, key_file, no_key)
            target = fetch_target(base_url, key=key, model=model, max_output=max_output, key_file=kfile)
            where = _home(adapter, home)
            _apply(adapter.install(target, where), dry_run)
        except AdapterError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        out.print(f"{harness}: model {target.model}, window {target.context_window:,}, "
                  f"output cap {target.max_output:,}")
        if not dry_run:
            out.print(f"run: {adapter.run_hint(where)}")


    @app.command()
    def show(harness: str = typer.Argument(None, help="default: all"),
             home: Path = typer.Option(None, help="the harness' config directory")) -> None:
        """Print what each harness is configured to use (our provider entry), as JSON."""
        names = [harness] if harness else list(ADAPTERS)
        report = {}
        for name in names:
            adapter = _adapter(name)
            try:
                report[name] = {"home": str(_home(adapter, home)), **adapter.show(_home(adapter, home))}
            except AdapterError as exc:
                report[name] = {"error": str(exc)}
        out.print_json(json.dumps(report))


    @app.command()
    def remove(harness: str = typer.Argument(..., help="dsh | pi | hermes"),
               home: Path = typer.Option(None, help="the harness' config directory"),
               dry_run: bool = typer.Option(False, "--dry-run", help="print the diff; write nothing")) -> None:
        """Remove our provider and key from the harness' config (a backup of each file is kept)."""
        adapter = _adapter(harness)
        try:
            _apply(adapter.remove(_home(adapter, home)), dry_run)
        except AdapterError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None

    return app
