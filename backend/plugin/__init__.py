"""The `vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts.

Each part is switched by an environment variable that the launcher sets from the profile, so the
engine, its workers and the API server agree without sharing state:

  HYPERHARNESS_PLUGIN=0          everything off (a plain vLLM)
  HYPERHARNESS_ENGINE_AUTH=0     vLLM's own key check guards only /v1, /v2, /inference, /cohere;
                                 default on: every route but /health needs the key (API process)
  HYPERHARNESS_VERIFY_ATTN=1     verify batches on the int8 per-token-head cache go to
                                 kernels.verify_attention (CUDA workers only)
  HYPERHARNESS_GDN_LAZY=1        lazy GDN state commit via kernels.gdn_verify (OOT GDN layer; on CPU
                                 through Triton's interpreter, for tests; a speculator with
                                 --mamba-cache-mode align needs patch 0003, else it refuses)

`register()` must be idempotent and cheap: vLLM calls it several times per process.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

__all__ = ["PluginSettings", "register"]

log = logging.getLogger("hyperharness.plugin")


def _flag(env: dict[str, str], name: str, default: bool) -> bool:
    value = env.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


@dataclass(frozen=True)
class PluginSettings:
    enabled: bool = True
    engine_auth: bool = True
    verify_attention: bool = False
    gdn_lazy: bool = False
    max_verify_tokens: int = 16

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> PluginSettings:
        env = dict(os.environ) if env is None else env
        return cls(
            enabled=_flag(env, "HYPERHARNESS_PLUGIN", True),
            engine_auth=_flag(env, "HYPERHARNESS_ENGINE_AUTH", True),
            verify_attention=_flag(env, "HYPERHARNESS_VERIFY_ATTN", False),
            gdn_lazy=_flag(env, "HYPERHARNESS_GDN_LAZY", False),
            max_verify_tokens=int(env.get("HYPERHARNESS_MAX_VERIFY_TOKENS", "16")),
        )


def register() -> None:
    settings = PluginSettings.from_env()
    if not settings.enabled:
        return
    from backend.plugin import labd_speculator  # HYPERHARNESS_LABD=1: lookup fused into DFlash (0004)

    labd_speculator.install()
    if settings.engine_auth:
        from backend.plugin import auth

        auth.install()
    if settings.verify_attention:
        import torch

        if torch.cuda.is_available():
            from backend.plugin import attention

            attention.install(settings.max_verify_tokens)
        else:
            log.info("hyperharness: verify attention requested but no CUDA device; upstream path")
    if settings.gdn_lazy:
        from backend.plugin import gdn

        gdn.install()
