"""`hyperharness patches apply|check|revert` on a scratch copy of the installed vLLM files."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backend import patchtool
from backend.patchtool import PatchState, Series

pytestmark = pytest.mark.unit

runner = CliRunner()


def _invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(patchtool.app, list(args))
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def series() -> Series:
    return Series.load()


@pytest.fixture
def pristine(tmp_path: Path, series: Series) -> Path:
    """The files the series touches, copied from the installed package and reverted to 0.32.0."""
    installed = patchtool.vllm_root()
    names = set().union(*(patchtool.touched_files(p) for p in series.patches)) | {"vllm/_version.py"}
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(installed / name, tmp_path / name)
    code, out = _invoke("revert", "--target", str(tmp_path))
    assert code == 0, out
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.py")}


def test_series_is_pinned_and_named(series: Series) -> None:
    assert series.pin == "0.32.0"
    assert [p.name[:4] for p in series.patches] == sorted(p.name[:4] for p in series.patches)


def test_installed_package_has_the_series_applied(series: Series) -> None:
    code, out = _invoke("check")
    assert code == 0, out
    assert out.count("applied") == len(series.patches)


def test_apply_check_twice_revert_round_trip(pristine: Path, series: Series) -> None:
    before = _snapshot(pristine)
    assert _invoke("check", "--target", str(pristine))[0] == patchtool.EXIT_NOT_APPLIED
    code, out = _invoke("apply", "--target", str(pristine))
    assert code == 0, out
    assert _invoke("check", "--target", str(pristine))[0] == 0
    patched = _snapshot(pristine)

    code, out = _invoke("apply", "--target", str(pristine))
    assert code == patchtool.EXIT_ALREADY and "refusing" in out
    assert _snapshot(pristine) == patched  # refused cleanly: nothing touched
    assert _invoke("apply", "--ensure", "--target", str(pristine))[0] == 0

    assert _invoke("revert", "--target", str(pristine))[0] == 0
    assert _snapshot(pristine) == before


def test_partial_state_is_reported_per_patch(pristine: Path, series: Series) -> None:
    first = series.patches[0]
    assert patchtool._git_apply(pristine, first).returncode == 0
    rows = dict(patchtool.states(pristine, series))
    assert rows[first] is PatchState.APPLIED
    assert all(rows[p] is PatchState.NOT_APPLIED for p in series.patches[1:])
    assert _invoke("apply", "--target", str(pristine))[0] == patchtool.EXIT_ALREADY
    assert _invoke("apply", "--ensure", "--target", str(pristine))[0] == 0
    assert all(s is PatchState.APPLIED for _, s in patchtool.states(pristine, series))


def test_mismatch_refuses_without_touching_files(pristine: Path, series: Series) -> None:
    target = pristine / "vllm/v1/core/single_type_kv_cache_manager.py"
    text = target.read_text()
    # Edit a line inside a hunk's context: neither the pristine nor the patched text fits.
    edited = text.replace(
        "class SlidingWindowManager(SingleTypeKVCacheManager):", "class SlidingWindowManager(object):"
    )
    assert edited != text
    target.write_text(edited)
    before = _snapshot(pristine)
    code, out = _invoke("apply", "--target", str(pristine))
    assert code == patchtool.EXIT_MISMATCH and "mismatch" in out
    assert _snapshot(pristine) == before
    assert _invoke("check", "--target", str(pristine))[0] == patchtool.EXIT_MISMATCH
    assert _invoke("revert", "--target", str(pristine))[0] == patchtool.EXIT_MISMATCH


def test_fuzz_is_refused(pristine: Path, series: Series) -> None:
    # A context line two lines away from a change: GNU patch would apply with fuzz 2; we must not.
    target = pristine / "vllm/v1/core/single_type_kv_cache_manager.py"
    text = target.read_text()
    edited = text.replace(
        "    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs) -> None:\n",
        "    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs) -> None:  # edited\n",
    )
    assert edited != text
    target.write_text(edited)
    assert patchtool.states(pristine, series)[0][1] is PatchState.MISMATCH


def test_wrong_version_is_refused(pristine: Path) -> None:
    version = pristine / "vllm/_version.py"
    version.write_text(version.read_text().replace("'0.32.0'", "'0.32.1'"))
    code, out = _invoke("apply", "--target", str(pristine))
    assert code == patchtool.EXIT_VERSION and "pinned to 0.32.0" in out


def test_edited_series_replaces_the_recorded_version(
    pristine: Path, series: Series, tmp_path_factory: pytest.TempPathFactory
) -> None:
    patches = tmp_path_factory.mktemp("series")
    for name in ("vllm.pin", "series", *(p.name for p in series.patches)):
        shutil.copy2(patchtool.PATCH_DIR / name, patches / name)
    assert _invoke("apply", "--target", str(pristine), "--series-dir", str(patches))[0] == 0
    # A new version of 0002: one added comment line changes.
    edited = patches / series.patches[1].name
    text = edited.read_text()
    assert "+# HYPERHARNESS_EOT_STATE=0 restores upstream.\n" in text
    old, new = "+# HYPERHARNESS_EOT_STATE=0 restores upstream.\n", "+# HYPERHARNESS_EOT_STATE=0: upstream.\n"
    edited.write_text(text.replace(old, new))
    assert _invoke("check", "--target", str(pristine), "--series-dir", str(patches))[0] == patchtool.EXIT_MISMATCH
    code, out = _invoke("apply", "--ensure", "--target", str(pristine), "--series-dir", str(patches))
    assert code == 0 and "recorded version" in out, out
    assert _invoke("check", "--target", str(pristine), "--series-dir", str(patches))[0] == 0
    patched = (pristine / "vllm/v1/core/single_type_kv_cache_manager.py").read_text()
    assert "HYPERHARNESS_EOT_STATE=0: upstream." in patched
    assert _invoke("revert", "--target", str(pristine), "--series-dir", str(patches))[0] == 0
    assert not list((pristine / patchtool.RECORD_DIR).glob("*.patch"))


def test_reinstalled_package_with_old_records_is_patched_again(pristine: Path, series: Series) -> None:
    # pip reinstalls vllm's files but leaves our record folder (not in its RECORD) behind.
    records = pristine / patchtool.RECORD_DIR
    records.mkdir()
    (records / "0001-prefix-old-version.patch").write_bytes(series.patches[0].read_bytes())
    code, out = _invoke("apply", "--ensure", "--target", str(pristine))
    assert code == 0, out
    assert sorted(p.name for p in records.glob("*.patch")) == [p.name for p in series.patches]
