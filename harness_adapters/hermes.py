"""Hermes Agent (0.19): `$HERMES_HOME/config.yaml` + `$HERMES_HOME/.env`, default `~/.hermes`.

A named provider (`providers.hyperharness`, selected as `custom:hyperharness`) rather than the bare
`model.base_url` form, because only named providers carry `extra_headers` and an output cap:
- `max_output_tokens` (and `model.max_tokens`, the one `hermes -z` reads): without it Hermes asks for
  `max_tokens` = the whole context (65,536 on a 64K
  model), which vLLM refuses and Hermes misreads as "prompt too long" (hermes-agent#49686, #102494);
  the proxy also caps it (proxy/quirks.py), this keeps the request honest;
- `model.context_length`: the window from the proxy's /v1/models; Hermes refuses a main or auxiliary
  (compression) model under 64K;
- `session_affinity_header: x-session-id`: newer Hermes sends its conversation id in it (0.19 ignores
  the key and the proxy falls back to its fingerprint of system prompt + tools + first user message,
  which Hermes keeps stable: its system prompt is built once per session);
- streaming stays on: the proxy parses tool calls server-side and releases arguments only as whole JSON,
  so the leak of Qwen XML tool calls into streamed text (hermes-agent#72901) does not happen here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness_adapters.base import (
    KEY_ENV,
    PROVIDER_ID,
    FileChange,
    Target,
    dump_yaml,
    key_change,
    key_removal,
    load_yaml,
    read_text,
)

CONFIG = "config.yaml"
SELECTOR = f"custom:{PROVIDER_ID}"


class HermesAdapter:
    name = "hermes"

    def home(self, env: Mapping[str, str]) -> Path:
        if env.get("HERMES_HOME"):
            return Path(env["HERMES_HOME"])
        return Path(env.get("HOME", "~")).expanduser() / ".hermes"

    def provider(self, target: Target) -> dict[str, Any]:
        return {
            "name": "HyperHarness",
            "base_url": target.base_url,
            "key_env": KEY_ENV,
            "api_mode": "chat_completions",
            "default_model": target.model,
            "max_output_tokens": target.max_output,
            "extra_headers": {"x-harness": "hermes"},
            "session_affinity_header": "x-session-id",
        }

    def install(self, target: Target, home: Path) -> list[FileChange]:
        path = home / CONFIG
        before = read_text(path)
        data = load_yaml(before, path)
        existing = data.get("providers")
        providers: dict[str, Any] = existing if isinstance(existing, dict) else {}
        providers[PROVIDER_ID] = self.provider(target)
        data["providers"] = providers
        current = data.get("model")
        model: dict[str, Any] = current if isinstance(current, dict) else {}
        # `max_tokens` here too: `hermes -z` (oneshot) reads the output cap from `model.max_tokens` only.
        model.update({"provider": SELECTOR, "default": target.model, "context_length": target.context_window,
                      "max_tokens": target.max_output})
        model.pop("base_url", None)  # the bare form would win over the named provider
        data["model"] = model
        return [FileChange(path, before, dump_yaml(data)), key_change(home, target)]

    def remove(self, home: Path) -> list[FileChange]:
        path = home / CONFIG
        before = read_text(path)
        data = load_yaml(before, path)
        if isinstance(data.get("providers"), dict):
            data["providers"].pop(PROVIDER_ID, None)
        model = data.get("model")
        if isinstance(model, dict) and model.get("provider") == SELECTOR:
            for k in ("provider", "default", "context_length", "max_tokens"):
                model.pop(k, None)
            if not model:
                del data["model"]
        return [FileChange(path, before, dump_yaml(data) if before is not None else None), key_removal(home)]

    def show(self, home: Path) -> dict[str, Any]:
        data = load_yaml(read_text(home / CONFIG), home / CONFIG)
        entry = (data.get("providers") or {}).get(PROVIDER_ID)
        return {"provider": entry, "model": data.get("model")} if entry else {}

    def run_hint(self, home: Path) -> str:
        return f'HERMES_HOME={home} hermes -z "your task"'
