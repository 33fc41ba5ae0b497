"""DeepSeek Harness (`dsh`, 0.2.x): `$DSH_HOME/cordis.patch.yml` + `$DSH_HOME/.env`.

The home patch layer, not `settings.yaml`: in 0.2.1 `settings.yaml` is imported once by the settings
service (and renamed `settings.yaml.imported`), which headless and TUI profiles do not run, while
`cordis.patch.yml` (a YAML list of id-targeted patches) is applied on top of every profile; check the
result with `dsh --profile headless --dump-config`.

Route A (`llm-pi-ai`, OpenAI chat completions through pi-ai) rather than the native route B, because:
- route B's defaults are `maxTokens: 256000` and a 1,000,000-token window: vLLM answers the first with a
  400 that DSH misreads as an overflow and answers with compaction (harnesses.md §1.5);
- route A with `cacheRetention: long` sends `prompt_cache_key=<dsh session id>` on every request, the
  session identity the proxy keys transcripts by;
- `compat` turns off the `developer` role, `store`, `strict` and `max_completion_tokens`, which gateways
  reject (deepseek-ai/deepseek-harness#2646, #1976), and selects the Qwen thinking switch
  (`chat_template_kwargs.enable_thinking`).
The key is the env reference `HYPERHARNESS_API_KEY`, never `DEEPSEEK_API_KEY`: DSH's web search sends
`DEEPSEEK_API_KEY` to api.deepseek.com, and our key must not leave for an outside host.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from harness_adapters.base import (
    KEY_ENV,
    PROVIDER_ID,
    AdapterError,
    FileChange,
    Target,
    key_change,
    key_removal,
    read_text,
)

SETTINGS = "cordis.patch.yml"
# Patch entries we own in the list, by target id.
OWNED_IDS = ("llm-pi-ai", "agent-default-model")
COMPAT = {
    "supportsDeveloperRole": False,
    "supportsStore": False,
    "supportsStrictMode": False,
    "maxTokensField": "max_tokens",
    "thinkingFormat": "qwen-chat-template",
}


class DshAdapter:
    name = "dsh"

    def home(self, env: Mapping[str, str]) -> Path:
        return Path(env["DSH_HOME"]) if env.get("DSH_HOME") else Path(env.get("HOME", "~")).expanduser() / ".dsh"

    def provider(self, target: Target) -> dict[str, Any]:
        return {
            "displayName": "HyperHarness",
            "api": "openai-completions",
            "baseURL": target.base_url,
            "apiKeyEnv": KEY_ENV,
            "cacheRetention": "long",
            "headers": {"x-harness": "dsh"},
            "compat": dict(COMPAT),
            "defaultContextWindow": target.context_window,
            "defaultMaxTokens": target.max_output,
            "models": [{
                "id": target.model,
                "contextWindow": target.context_window,
                "maxTokens": target.max_output,
                # key = level DSH offers, value = what goes on the wire; `off` sends nothing.
                "reasoningEfforts": {"off": None, "high": "high"},
            }],
        }

    def install(self, target: Target, home: Path) -> list[FileChange]:
        path = home / SETTINGS
        before = read_text(path)
        patches = load_patches(before, path)
        route = entry(patches, "llm-pi-ai")
        config = route.setdefault("config", {}) or {}
        route["config"] = config
        existing = config.get("providers")
        providers: dict[str, Any] = existing if isinstance(existing, dict) else {}
        providers[PROVIDER_ID] = self.provider(target)
        config["providers"] = providers
        entry(patches, "agent-default-model")["config"] = {"provider": PROVIDER_ID, "model": target.model}
        return [FileChange(path, before, dump_patches(patches)), key_change(home, target)]

    def remove(self, home: Path) -> list[FileChange]:
        path = home / SETTINGS
        before = read_text(path)
        patches = load_patches(before, path)
        kept = []
        for patch in patches:
            if patch.get("id") == "agent-default-model" and (patch.get("config") or {}).get("provider") == PROVIDER_ID:
                continue
            if patch.get("id") == "llm-pi-ai":
                providers = (patch.get("config") or {}).get("providers") or {}
                providers.pop(PROVIDER_ID, None)
                if not providers and set(patch) <= {"id", "config"} and set(patch.get("config") or {}) <= {"providers"}:
                    continue
            kept.append(patch)
        after = dump_patches(kept) if before is not None else None
        return [FileChange(path, before, after), key_removal(home)]

    def show(self, home: Path) -> dict[str, Any]:
        patches = load_patches(read_text(home / SETTINGS), home / SETTINGS)
        by_id = {p.get("id"): p for p in patches}
        ours = (((by_id.get("llm-pi-ai") or {}).get("config") or {}).get("providers") or {}).get(PROVIDER_ID)
        return {"provider": ours, "default": (by_id.get("agent-default-model") or {}).get("config")} if ours else {}

    def run_hint(self, home: Path) -> str:
        return f'DSH_HOME={home} dsh headless "your task"'


HEADER = "# dsh home patch layer (a YAML list of id-targeted patches); hyperharness adapters edit the\n" \
         "# `llm-pi-ai` provider `hyperharness` and `agent-default-model` entries and keep the rest.\n"


def load_patches(text: str | None, path: Path) -> list[dict[str, Any]]:
    if not text or not text.strip():
        return []
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AdapterError(f"{path} is not valid YAML; fix or move it first: {exc}") from exc
    if data is None:
        return []
    if not isinstance(data, list) or not all(isinstance(p, dict) for p in data):
        raise AdapterError(f"{path} must hold a YAML list of patch entries")
    return data


def entry(patches: list[dict[str, Any]], target_id: str) -> dict[str, Any]:
    """The patch targeting `target_id` (created at the end of the list if missing)."""
    for patch in patches:
        if patch.get("id") == target_id and "insert" not in patch:
            return patch
    patch = {"id": target_id}
    patches.append(patch)
    return patch


def dump_patches(patches: list[dict[str, Any]]) -> str:
    if not patches:
        return "[]\n"
    return HEADER + str(yaml.safe_dump(patches, sort_keys=False, default_flow_style=False, allow_unicode=True))
