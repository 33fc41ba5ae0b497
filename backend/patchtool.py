"""`hyperharness patches apply|check|revert`: our vLLM patch series on the installed package.

The series lives in `patches/`: `vllm.pin` (the one vLLM version the diffs were made against),
`series` (order; `#` comments) and one `NNNN-area-what.patch` per change, each a unified diff with
`a/vllm/...` / `b/vllm/...` paths relative to the directory that holds the `vllm` package
(site-packages). Every operation goes through `git apply` with its default zero-fuzz matching, run
outside any repository (`GIT_CEILING_DIRECTORIES`), so a hunk whose context moved is a *mismatch*,
never a silent near-miss.

Each patch is in exactly one state:
  applied      its reverse applies cleanly (and its forward does not);
  not applied  its forward applies cleanly (and its reverse does not);
  mismatch     neither: the installed file is neither pristine 0.32.0 nor ours.
`apply` refuses a second application (exit 3) unless `--ensure`, which applies only the missing
patches and succeeds when everything ends up applied; any mismatch refuses before anything changes.
Each applied patch is recorded under `vllm/.hyperharness-patches/`; when the series is edited,
`apply --ensure` and `revert` first take the recorded (old) versions back out.
"""
from __future__ import annotations

import enum
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import typer

PATCH_DIR = Path(__file__).resolve().parent.parent / "patches"

# Exit codes (stable: the Makefile, CI and `doctor` rely on them).
EXIT_OK = 0
EXIT_MISMATCH = 2
EXIT_ALREADY = 3
EXIT_NOT_APPLIED = 4
EXIT_VERSION = 5

_NAME_RE = re.compile(r"^\d{4}-[a-z0-9]+(?:[-_][a-z0-9]+)*\.patch$")


class PatchState(enum.Enum):
    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    MISMATCH = "mismatch"


@dataclass(frozen=True)
class Series:
    pin: str
    patches: tuple[Path, ...]

    @classmethod
    def load(cls, patch_dir: Path = PATCH_DIR) -> Series:
        pin = (patch_dir / "vllm.pin").read_text().strip()
        names = [
            line.split("#", 1)[0].strip()
            for line in (patch_dir / "series").read_text().splitlines()
        ]
        names = [n for n in names if n]
        bad = [n for n in names if not _NAME_RE.match(n)]
        if bad:
            raise ValueError(f"series: names must look like NNNN-area-what.patch, got {bad}")
        missing = [n for n in names if not (patch_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"series lists patches that are not in {patch_dir}: {missing}")
        if len(set(names)) != len(names):
            raise ValueError(f"series lists a patch twice: {names}")
        return cls(pin=pin, patches=tuple(patch_dir / n for n in names))


def vllm_root() -> Path:
    """The directory holding the installed `vllm` package, without importing vllm (slow)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vllm is not installed in this interpreter's environment")
    return Path(next(iter(spec.submodule_search_locations))).parent


def installed_version(root: Path) -> str:
    text = (root / "vllm" / "_version.py").read_text()
    match = re.search(r"^__version__ = version = '([^']+)'", text, re.M)
    if match is None:
        raise ValueError(f"cannot read the vLLM version from {root / 'vllm' / '_version.py'}")
    return match.group(1)


def _git_apply(root: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    # Outside any repository, `git apply` patches plain files relative to cwd. The ceiling stops
    # discovery of an enclosing repo (a venv inside a checkout), which would re-root the paths.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent), LC_ALL="C")
    return subprocess.run(
        ["git", "apply", "-p1", *flags, str(patch)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def patch_state(root: Path, patch: Path) -> PatchState:
    forward = _git_apply(root, patch, "--check").returncode == 0
    reverse = _git_apply(root, patch, "--check", "--reverse").returncode == 0
    if reverse and not forward:
        return PatchState.APPLIED
    if forward and not reverse:
        return PatchState.NOT_APPLIED
    return PatchState.MISMATCH


def touched_files(patch: Path) -> set[str]:
    names = set()
    for line in patch.read_text().splitlines():
        if line.startswith(("--- a/", "+++ b/")):
            names.add(line[6:].strip())
    return names


def states(root: Path, series: Series) -> list[tuple[Path, PatchState]]:
    """Each patch's state, judged in series order on a scratch copy of the touched files.

    Later patches may have earlier ones in their context, so a patch is judged against the tree
    as it would be with exactly its predecessors applied: peel applied patches off from the end
    (reverse walk), then re-apply in order, marking any patch that fits neither way a mismatch.
    """
    with tempfile.TemporaryDirectory(prefix="hh-patches-") as tmp:
        scratch = Path(tmp)
        for name in set().union(*(touched_files(p) for p in series.patches)):
            src = root / name
            if src.is_file():
                (scratch / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, scratch / name)
        applied: dict[Path, bool] = {}
        for patch in reversed(series.patches):
            applied[patch] = patch_state(scratch, patch) is PatchState.APPLIED
            if applied[patch]:
                _git_apply(scratch, patch, "--reverse")
        rows = []
        for patch in series.patches:
            if _git_apply(scratch, patch, "--check").returncode != 0:
                rows.append((patch, PatchState.MISMATCH))
                continue
            _git_apply(scratch, patch)
            rows.append((patch, PatchState.APPLIED if applied[patch] else PatchState.NOT_APPLIED))
        return rows


def _check_pin(root: Path, series: Series) -> None:
    version = installed_version(root)
    if version != series.pin:
        typer.echo(
            f"vLLM {version} is installed at {root}; the series is pinned to {series.pin}",
            err=True,
        )
        raise typer.Exit(EXIT_VERSION)


def _print(rows: list[tuple[Path, PatchState]]) -> None:
    for path, state in rows:
        typer.echo(f"  {state.value:<12} {path.name}")


def _drop_bytecode(root: Path, patch: Path) -> None:
    # Sources get new mtimes so stale .pyc would be rejected anyway; removing them keeps a
    # read-only __pycache__ (system installs) from serving the old code.
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            src = root / line[6:].strip()
            cache = src.parent / "__pycache__"
            for pyc in cache.glob(f"{src.stem}.*.pyc") if cache.is_dir() else ():
                pyc.unlink(missing_ok=True)


RECORD_DIR = Path("vllm") / ".hyperharness-patches"


def _record(root: Path, patch: Path, applied: bool) -> None:
    """Keep a copy of each applied patch beside the files it changed, so a later edit of the
    series can still take the old version back out (`_revert_stale`)."""
    copy = root / RECORD_DIR / patch.name
    if applied:
        copy.parent.mkdir(exist_ok=True)
        shutil.copyfile(patch, copy)
    else:
        copy.unlink(missing_ok=True)


def _revert_stale(root: Path, series: Series) -> None:
    """If any recorded patch differs from (or is gone from) the series, revert every recorded
    patch, newest first, with the recorded copies: the series is then re-applied from pristine."""
    records = sorted((root / RECORD_DIR).glob("*.patch")) if (root / RECORD_DIR).is_dir() else []
    current = {p.name: p.read_bytes() for p in series.patches}
    if all(current.get(r.name) == r.read_bytes() for r in records):
        return
    for record in reversed(records):
        if _git_apply(root, record, "--check").returncode == 0:
            record.unlink()  # the package was reinstalled under the record: nothing to take out
            continue
        result = _git_apply(root, record, "--reverse")
        if result.returncode != 0:
            typer.echo(f"stale {record.name} no longer reverts: {result.stderr.strip()}", err=True)
            raise typer.Exit(EXIT_MISMATCH)
        _drop_bytecode(root, record)
        record.unlink()
        typer.echo(f"  reverted     {record.name} (recorded version; the series changed)")


app = typer.Typer(help="Apply, check or revert our patch series on the installed vLLM.")

_TargetOpt = typer.Option(None, "--target", help="directory holding vllm/ (default: installed)")
_SeriesOpt = typer.Option(PATCH_DIR, "--series-dir", hidden=True, help="patches/ directory (tests)")


@app.command()
def check(target: Path | None = _TargetOpt, series_dir: Path = _SeriesOpt) -> None:
    """Show each patch's state; exit 0 only if every patch is applied."""
    root = target or vllm_root()
    series = Series.load(series_dir)
    _check_pin(root, series)
    rows = states(root, series)
    typer.echo(f"vLLM {series.pin} at {root}")
    _print(rows)
    found = {state for _, state in rows}
    if PatchState.MISMATCH in found:
        raise typer.Exit(EXIT_MISMATCH)
    if PatchState.NOT_APPLIED in found:
        raise typer.Exit(EXIT_NOT_APPLIED)


@app.command()
def apply(
    target: Path | None = _TargetOpt,
    ensure: bool = typer.Option(False, "--ensure", help="apply only what is missing; ok if all applied"),
    series_dir: Path = _SeriesOpt,
) -> None:
    """Apply the series (all or nothing); a second application is refused."""
    root = target or vllm_root()
    series = Series.load(series_dir)
    _check_pin(root, series)
    if ensure:
        _revert_stale(root, series)
    rows = states(root, series)
    mismatched = [p.name for p, s in rows if s is PatchState.MISMATCH]
    if mismatched:
        _print(rows)
        typer.echo(f"refusing: {len(mismatched)} patch(es) match neither pristine nor patched", err=True)
        raise typer.Exit(EXIT_MISMATCH)
    todo = [p for p, s in rows if s is PatchState.NOT_APPLIED]
    if not ensure and len(todo) != len(rows):
        _print(rows)
        typer.echo("refusing: the series is already (partly) applied; use --ensure or revert first", err=True)
        raise typer.Exit(EXIT_ALREADY)
    for patch in todo:
        result = _git_apply(root, patch)
        if result.returncode != 0:  # checked above; only a concurrent writer gets here
            typer.echo(f"{patch.name}: {result.stderr.strip()}", err=True)
            raise typer.Exit(EXIT_MISMATCH)
        _drop_bytecode(root, patch)
        _record(root, patch, applied=True)
        typer.echo(f"  applied      {patch.name}")
    for patch in series.patches:  # also those found in place, so a later edit can revert them
        _record(root, patch, applied=True)
    typer.echo(f"{len(todo)} applied, {len(rows) - len(todo)} already in place ({root})")


@app.command()
def revert(target: Path | None = _TargetOpt, series_dir: Path = _SeriesOpt) -> None:
    """Revert every applied patch (reverse order), restoring the pristine files."""
    root = target or vllm_root()
    series = Series.load(series_dir)
    _check_pin(root, series)
    _revert_stale(root, series)
    rows = states(root, series)
    if any(s is PatchState.MISMATCH for _, s in rows):
        _print(rows)
        typer.echo("refusing: a patch matches neither pristine nor patched", err=True)
        raise typer.Exit(EXIT_MISMATCH)
    done = [p for p, s in reversed(rows) if s is PatchState.APPLIED]
    for patch in done:
        result = _git_apply(root, patch, "--reverse")
        if result.returncode != 0:
            typer.echo(f"{patch.name}: {result.stderr.strip()}", err=True)
            raise typer.Exit(EXIT_MISMATCH)
        _drop_bytecode(root, patch)
        _record(root, patch, applied=False)
        typer.echo(f"  reverted     {patch.name}")
    typer.echo(f"{len(done)} reverted ({root})")


def series_applied() -> dict[str, str]:
    """For `doctor` and the plugin: patch name -> state on the installed package."""
    root = vllm_root()
    return {p.name: s.value for p, s in states(root, Series.load())}


if __name__ == "__main__":  # `python -m backend.patchtool ...` before the console script exists
    app()
