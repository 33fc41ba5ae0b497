"""How vLLM 0.32's Python sources run without their compiled extensions (the H200 has no vLLM).

The archive from `tests/gpu/pack.py` is unpacked onto PYTHONPATH (with a `vllm` dist-info, so
vLLM reads its version and picks `NvmlCudaPlatform` on the H200); the device's own torch and
Triton serve it.  Shims stand in for what only a compiled CUDA build provides; 1-3 are
installed only where the real thing is missing (so the same code runs beside a real vLLM), 5
always:

1. ``vllm._C_stable_libtorch``: ``vllm/platforms/cuda.py`` imports this CUDA extension at module
   level.  An empty module: nothing in the layers this harness runs calls into it.
2. ``torch.ops._C.cutlass_scaled_mm_supports_block_fp8``: called at import by
   ``quantization/utils/w8a8_utils.py`` (a CUTLASS capability query).  Answers False (no CUTLASS
   kernels here); every other ``torch.ops._C`` name stays absent, so vLLM's own capability checks
   (e.g. ``hasattr(torch.ops._C, "fused_gdn_decode_post_conv_mtp")``) choose its Triton paths.
3. ``vllm.vllm_flash_attn``: its ``__init__`` raises ImportError without ``_vllm_fa2_C`` /
   ``_vllm_fa3_C``, and ``v1/attention/backends/fa_utils.py`` (imported by the attention layer
   module) imports it on CUDA.  The stand-in is the package with the real
   ``flash_attn_interface`` (which reports FA2/FA3 unavailable) and without the raise.
4. ``torch.ops._C.weak_ref_tensor``: `CUDAGraphWrapper` keeps its graphs' outputs through this
   compiled op (a tensor over the same memory that does not keep it alive, so the graph pool can
   hand the memory on).  The stand-in returns a view, which does keep it alive: the outputs'
   memory is held longer, nothing is computed differently.
5. ``model_executor/models/registry.py`` inspects a model class in a child Python (to keep CUDA
   uninitialised in the engine process); that child would import vLLM without shims 1-4.  The
   harness inspects in its own process instead (same function, same result), where CUDA is
   already initialised anyway.

`device_site` (CPU side, CI): a site folder holding only the device image's packages
(device_packages.txt) and the carried wheels (wheels.txt), so a CPU run proves the imports
resolve with what the device has.
"""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import re
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_VERSION = "0.32.0"
SHIMS = ("vllm._C_stable_libtorch", "torch.ops._C.cutlass_scaled_mm_supports_block_fp8", "vllm.vllm_flash_attn",
         "torch.ops._C.weak_ref_tensor", "vllm.model_executor.models.registry._run_in_subprocess")

__all__ = ["device_site", "install_shims", "package_list"]


def package_list(name: str) -> list[str]:
    """Distribution names of `device_packages.txt` / `wheels.txt` ('name==version' or 'name')."""
    out = []
    for line in (HERE / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line.split("==", 1)[0].strip())
    return out


def _vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vllm is not importable: unpack the archive onto PYTHONPATH (tests/gpu/pack.py)")
    return Path(next(iter(spec.submodule_search_locations)))


def _has_extension(pkg: Path, stem: str) -> bool:
    return any(pkg.glob(f"{stem}*.so"))


def install_shims() -> list[str]:
    """Install the shims this vLLM copy needs (idempotent); returns the names installed."""
    import torch

    installed: list[str] = []
    vdir = _vllm_dir()
    if not _has_extension(vdir, "_C_stable_libtorch") and "vllm._C_stable_libtorch" not in sys.modules:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
        installed.append(SHIMS[0])
    if not hasattr(torch.ops._C, "cutlass_scaled_mm_supports_block_fp8"):
        lib = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901 - a query op, no kernel
        lib.define("cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool")
        lib.impl("cutlass_scaled_mm_supports_block_fp8", lambda cap: False, "CompositeExplicitAutograd")
        _KEEP.append(lib)  # the registration lives as long as the Library object
        installed.append(SHIMS[1])
    fa = vdir / "vllm_flash_attn"
    if not any(fa.glob("_vllm_fa[23]_C*.so")) and "vllm.vllm_flash_attn" not in sys.modules:
        pkg = types.ModuleType("vllm.vllm_flash_attn")
        pkg.__path__ = [str(fa)]
        pkg.__package__ = "vllm.vllm_flash_attn"
        pkg.__spec__ = importlib.machinery.ModuleSpec("vllm.vllm_flash_attn", None, is_package=True)
        pkg.__spec__.submodule_search_locations = pkg.__path__
        sys.modules["vllm.vllm_flash_attn"] = pkg
        from vllm.vllm_flash_attn import flash_attn_interface as fai

        for name in ("FA2_AVAILABLE", "FA3_AVAILABLE", "compile_flash_attn_varlen_func_from_specs",
                     "fa_version_unsupported_reason", "flash_attn_varlen_func", "get_scheduler_metadata",
                     "is_fa_version_supported"):
            setattr(pkg, name, getattr(fai, name))
        installed.append(SHIMS[2])
    if not hasattr(torch.ops._C, "weak_ref_tensor"):
        lib = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901
        lib.define("weak_ref_tensor(Tensor(a) tensor) -> Tensor(a)")
        lib.impl("weak_ref_tensor", lambda t: t.view(t.shape), "CompositeExplicitAutograd")
        _KEEP.append(lib)
        installed.append(SHIMS[3])
    from vllm.model_executor.models import registry

    if registry._run_in_subprocess is not _in_process:
        registry._run_in_subprocess = _in_process
        installed.append(SHIMS[4])
    return installed


def _in_process(fn):
    return fn()


_KEEP: list[object] = []


def device_site(dest: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """Fill `dest` with links to this interpreter's installed packages that the H200 also has.

    For CPU runs that must see only what the device has: the distributions in
    device_packages.txt and wheels.txt (plus `extra`) that are installed here, each linked with
    its dist-info.  Run Python with ``-S`` and ``PYTHONPATH=<archive>:<dest>:<repo>`` so nothing
    else of site-packages is importable; ``importlib.util.find_spec`` then answers as on the
    device.  Returns the distributions linked.
    """
    device = {_norm(d) for d in package_list("device_packages.txt")}
    carried = {_norm(d) for d in package_list("wheels.txt") + list(extra)}
    # distributions() walks sys.path in order: keep the first of each name, the one Python imports
    # (a dict comprehension would keep the last, a shadowed older copy where two paths hold one).
    installed: dict[str, importlib.metadata.Distribution] = {}
    for d in importlib.metadata.distributions():
        installed.setdefault(_norm(d.metadata["Name"] or ""), d)
    # The device's packages come with their own dependencies: close that set over what the
    # versions installed here require (no extras), so a version skew does not look like a gap.
    # The carried wheels are not closed over: each one they need must be carried too.
    todo = [n for n in device if n in installed]
    closure: set[str] = {n for n in carried if n in installed}
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        for req in installed[name].requires or []:
            if "extra ==" in req:
                continue
            dep = _norm(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
            if dep in installed and dep not in closure:
                todo.append(dep)
    dest.mkdir(parents=True, exist_ok=True)
    linked = []
    for name in sorted(closure):
        dist = installed[name]
        for top in {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            src = _imported_from(top) or Path(str(dist.locate_file(top)))
            link = dest / top
            if src.exists() and not link.exists() and not top.endswith(".pth") and top != "__pycache__":
                link.symlink_to(src)
        linked.append(name)
    return sorted(linked)


def _imported_from(top: str) -> Path | None:
    """Where this interpreter imports the top-level module or package `top` (a name in a RECORD:
    ``pkg``, ``mod.py``, ``mod.cpython-311-x86_64-linux-gnu.so``) from, or None for what is not
    a module (dist-info, data) or is a namespace package. Linking that, not the RECORD's own
    location, makes the site hold exactly the code the tests here run with, whatever copies of
    a package other path entries hold."""
    name = top.split(".", 1)[0]
    if not name.isidentifier() or top.endswith((".dist-info", ".data", ".pth")):
        return None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.has_location:
        return None
    origin = Path(spec.origin)
    src = origin.parent if spec.submodule_search_locations is not None else origin
    return src if src.name == top else None


def _norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return name.lower().replace("_", "-").replace(".", "-")
