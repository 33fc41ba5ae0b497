"""Config writers that point DeepSeek Harness, Pi and Hermes at the HyperHarness proxy."""

from __future__ import annotations

from harness_adapters.base import Adapter, AdapterError, FileChange, Target, fetch_target
from harness_adapters.dsh import DshAdapter
from harness_adapters.hermes import HermesAdapter
from harness_adapters.pi import PiAdapter

ADAPTERS: dict[str, Adapter] = {a.name: a for a in (DshAdapter(), PiAdapter(), HermesAdapter())}

__all__ = ["ADAPTERS", "Adapter", "AdapterError", "FileChange", "Target", "fetch_target"]
