"""DeepSeek Harness (`dsh`, 0.2.x): `$DSH_HOME/settings.yaml` + `$DSH_HOME/.env`.

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

from harness_adapters.base import (
    KEY_ENV, PROVIDER_ID, FileChange, Target, dump_yaml, key_change, key_removal, load_yaml, read_text,
)

SETTINGS = "settings.yaml"
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
        data = load_yaml(before, path)
        route = data.setdefault("llm-pi-ai", {}) or {}
        data["llm-pi-ai"] = route
        providers = route.setdefault("providers", {}) or {}
        route["providers"] = providers
        providers[PROVIDER_ID] = self.provider(target)
        data["agent-default-model"] = {"provider": PROVIDER_ID, "model": target.model}
        return [FileChange(path, before, dump_yaml(data)), key_change(home, target)]

    def remove(self, home: Path) -> list[FileChange]:
        path = home / SETTINGS
        before = read_text(path)
        data = load_yaml(before, path)
        providers = (data.get("llm-pi-ai") or {}).get("providers") or {}
        providers.pop(PROVIDER_ID, None)
        if not providers and isinstance(data.get("llm-pi-ai"), dict):
            data["llm-pi-ai"].pop("providers", None)
            if not data["llm-pi-ai"]:
                del data["llm-pi-ai"]
        if (data.get("agent-default-model") or {}).get("provider") == PROVIDER_ID:
            del data["agent-default-model"]
        after = dump_yaml(data) if data else None
        return [FileChange(path, before, after if before is not None else None), key_removal(home)]

    def show(self, home: Path) -> dict[str, Any]:
        data = load_yaml(read_text(home / SETTINGS), home / SETTINGS)
        entry = ((data.get("llm-pi-ai") or {}).get("providers") or {}).get(PROVIDER_ID)
        return {"provider": entry, "default": data.get("agent-default-model")} if entry else {}

    def run_hint(self, home: Path) -> str:
        return f'DSH_HOME={home} dsh headless "your task"'
