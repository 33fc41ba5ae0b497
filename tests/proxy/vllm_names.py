"""vLLM's own metric names, read from the installed vllm package's source (not a copy kept here): every
string literal starting with `vllm:` in its v1 metrics loggers and spec-decode metrics modules."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

MODULES = ("v1/metrics/loggers.py", "v1/spec_decode/metrics.py")


def vllm_metric_names() -> set[str]:
    spec = importlib.util.find_spec("vllm")  # the package's location only; vllm itself is not imported
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vllm is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    names: set[str] = set()
    for rel in MODULES:
        tree = ast.parse((root / rel).read_text())
        names |= {n.value for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("vllm:")
                  and " " not in n.value}
    return names
