"""Pi (`@mariozechner/pi-coding-agent` 0.73): `$PI_CODING_AGENT_DIR/models.json` (+ `settings.json`),
default `~/.pi/agent`.

`compat` (harnesses.md §2): the system prompt as `system`, not `developer` (rejected by non-OpenAI
endpoints: apmantza/pi-free#459 and others); `max_tokens`, not `max_completion_tokens`; no `store` or
`strict`; the Qwen thinking switch (`chat_template_kwargs.enable_thinking`); and the session affinity
headers (`session_id`, `x-session-affinity`), which carry Pi's session id, so the proxy keys transcripts
by the real session instead of a fingerprint. Pi reads no `.env`: the key is read from the key file by
command (`"!cat FILE"`, resolved per request) or named as an environment variable, never written out.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness_adapters.base import (
    KEY_ENV,
    PROVIDER_ID,
    FileChange,
    Target,
    dump_json,
    load_json,
    read_text,
)

MODELS = "models.json"
SETTINGS = "settings.json"
COMPAT = {
    "supportsDeveloperRole": False,
    "supportsStore": False,
    "supportsStrictMode": False,
    "maxTokensField": "max_tokens",
    "thinkingFormat": "qwen-chat-template",
    "sendSessionAffinityHeaders": True,
}
# settings.json keys we set; `remove` resets them only while they still point at our provider.
DEFAULT_KEYS = ("defaultProvider", "defaultModel")


def api_key_value(target: Target) -> str:
    if target.key is None:
        return "none"  # Pi hides models without a key; a keyless loopback proxy ignores it
    if target.key_file is not None:
        return "!cat " + shlex.quote(str(target.key_file.resolve()))
    return KEY_ENV  # a bare name is read from the environment


class PiAdapter:
    name = "pi"

    def home(self, env: Mapping[str, str]) -> Path:
        if env.get("PI_CODING_AGENT_DIR"):
            return Path(env["PI_CODING_AGENT_DIR"])
        return Path(env.get("HOME", "~")).expanduser() / ".pi" / "agent"

    def provider(self, target: Target) -> dict[str, Any]:
        return {
            "baseUrl": target.base_url,
            "api": "openai-completions",
            "apiKey": api_key_value(target),
            "headers": {"x-harness": "pi"},
            "compat": dict(COMPAT),
            "models": [{
                "id": target.model,
                "name": f"{target.model} (HyperHarness)",
                "reasoning": True,
                "input": ["text"],
                "contextWindow": target.context_window,
                "maxTokens": target.max_output,
            }],
        }

    def install(self, target: Target, home: Path) -> list[FileChange]:
        models_path, settings_path = home / MODELS, home / SETTINGS
        models_before, settings_before = read_text(models_path), read_text(settings_path)
        models = load_json(models_before, models_path)
        models.setdefault("providers", {})[PROVIDER_ID] = self.provider(target)
        settings = load_json(settings_before, settings_path)
        settings.update({"defaultProvider": PROVIDER_ID, "defaultModel": target.model})
        return [FileChange(models_path, models_before, dump_json(models)),
                FileChange(settings_path, settings_before, dump_json(settings))]

    def remove(self, home: Path) -> list[FileChange]:
        models_path, settings_path = home / MODELS, home / SETTINGS
        models_before, settings_before = read_text(models_path), read_text(settings_path)
        models = load_json(models_before, models_path)
        (models.get("providers") or {}).pop(PROVIDER_ID, None)
        settings = load_json(settings_before, settings_path)
        if settings.get("defaultProvider") == PROVIDER_ID:
            for k in DEFAULT_KEYS:
                settings.pop(k, None)
        return [FileChange(models_path, models_before, dump_json(models) if models_before is not None else None),
                FileChange(settings_path, settings_before,
                           dump_json(settings) if settings_before is not None else None)]

    def show(self, home: Path) -> dict[str, Any]:
        models = load_json(read_text(home / MODELS), home / MODELS)
        entry = (models.get("providers") or {}).get(PROVIDER_ID)
        settings = load_json(read_text(home / SETTINGS), home / SETTINGS)
        return {"provider": entry, "default": {k: settings.get(k) for k in DEFAULT_KEYS}} if entry else {}

    def run_hint(self, home: Path) -> str:
        return f'PI_CODING_AGENT_DIR={home} pi -p "your task"'
