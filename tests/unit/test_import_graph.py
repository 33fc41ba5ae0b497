"""Packages point one way: backend/ composes proxy/ and harness_adapters/; proxy/ and harness_adapters/
import nothing of backend/; kernels/ imports neither; no kernel folder has an import circle.

Every import statement counts, at module level or inside a function (a lazy import is still an arrow).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "proxy": ("backend", "harness_adapters", "kernels", "tests"),
    "harness_adapters": ("backend", "proxy", "kernels", "tests"),
    "kernels": ("backend", "proxy", "harness_adapters", "tests"),
    "backend": ("tests",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            out += [(node.lineno, name) for name in names]
    return out


def sources(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_against_the_arrows(package: str) -> None:
    bad = []
    for path in sources(package):
        for line, name in imports(path):
            top = name.split(".")[0]
            if top in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The walker itself: a function-level import and a relative import are both found."""
    probe = ROOT / "proxy" / "scheduler" / "queue.py"
    names = {n for _, n in imports(probe)}
    assert "proxy.admission.Priority" in names
    lazy = ast.parse("def f():\n    from backend.cli import app\n")
    assert any(isinstance(n, ast.ImportFrom) and n.module == "backend.cli" for n in ast.walk(lazy))


def test_no_import_circle_in_kernel_folders() -> None:
    modules = {module_name(p): p for p in sources("kernels")}
    graph = {m: {n for _, n in imports(p) if n in modules and n != m} for m, p in modules.items()}
    # Importing `pkg.mod` imports `pkg` first: a package's own __init__ is not an edge back to it.
    for m in graph:
        graph[m] = {n for n in graph[m] if not m.startswith(n + ".")}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
