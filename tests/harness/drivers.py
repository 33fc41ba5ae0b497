"""How to run each real harness headless for two turns of one session, in a throw-away home.

Each driver gives the environment (its config home, a private $HOME, offline switches) and the argv of
turn 1 and of turn 2, which continues the session turn 1 created.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from harness_adapters import clients
from tests.preflight import need

TURN_1 = "Reply with one short sentence: what is 2 + 2?"
TURN_2 = "Thanks. Now reply with one short sentence: what is 3 + 3?"


@dataclass(frozen=True)
class Driver:
    name: str  # the test id
    home_var: str  # the env var naming the harness' config home
    adapter: str  # which `hyperharness adapters install` target configures it
    client: str  # which pinned CLI runs it (harness_adapters.clients)

    def after_install(self, config_home: Path, base_url: str, model: str) -> None:
        """Changes a test makes on top of what the adapter wrote (none by default)."""

    def env(self, root: Path) -> dict[str, str]:
        home = root / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HYPERHARNESS_", "OPENAI_", "ANTHROPIC_",
                                                                         "DEEPSEEK_", "VLLM_"))}
        env.update({"HOME": str(home), self.home_var: str(self.config_home(root)), "NO_COLOR": "1",
                    "TERM": "dumb", "CI": "1"})
        env.update(self.extra_env())
        return env

    def config_home(self, root: Path) -> Path:
        return root / "config"

    def extra_env(self) -> dict[str, str]:
        return {}

    def turn1(self, binary: Path) -> list[str]:
        raise NotImplementedError

    def turn2(self, binary: Path, turn1_stdout: str, root: Path) -> list[str]:
        raise NotImplementedError


class DshDriver(Driver):
    def extra_env(self) -> dict[str, str]:
        return {"DSH_TELEMETRY": "0", "OTEL_SDK_DISABLED": "true"}

    def turn1(self, binary: Path) -> list[str]:
        return [str(binary), "headless", "--json", TURN_1]

    def turn2(self, binary: Path, turn1_stdout: str, root: Path) -> list[str]:
        return [str(binary), "headless", "--json", "--session-id", dsh_session_id(turn1_stdout), TURN_2]


class DshNativeDriver(DshDriver):
    """DSH's native route (`llm-deepseek`): Anthropic Messages to `{baseURL}/messages`, the wire shape the
    issue recorded (`thinking` without a budget, `output_config`, `dsh_session_log`, `x-api-key`). The
    adapter writes route A; this switches the default model to the native route on the same proxy."""

    def after_install(self, config_home: Path, base_url: str, model: str) -> None:
        import yaml

        path = config_home / "cordis.patch.yml"
        patches = [p for p in yaml.safe_load(path.read_text()) if p.get("id") != "agent-default-model"]
        patches += [
            {"id": "llm-deepseek", "config": {"baseURL": base_url, "apiKeyEnv": "HYPERHARNESS_API_KEY",
                                              "maxTokens": 48, "defaultContextWindow": 65536,
                                              "models": [{"id": model, "contextWindow": 65536}]}},
            {"id": "agent-default-model", "config": {"provider": "deepseek-official", "model": model}},
        ]
        path.write_text(yaml.safe_dump(patches, sort_keys=False))


def dsh_session_id(stdout: str) -> str:
    """The session id from `dsh headless --json` run events (newline-delimited JSON)."""
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        for key in ("sessionId", "session_id"):
            if isinstance(event, dict) and isinstance(event.get(key), str):
                return str(event[key])
    found = re.search(r"session-[0-9A-Za-z_-]+", stdout)
    if not found:
        raise AssertionError(f"no session id in dsh output: {stdout[:2000]}")
    return found.group(0)


class PiDriver(Driver):
    def extra_env(self) -> dict[str, str]:
        return {"PI_OFFLINE": "1", "PI_TELEMETRY": "0"}

    def turn1(self, binary: Path) -> list[str]:
        return [str(binary), "-p", TURN_1]

    def turn2(self, binary: Path, turn1_stdout: str, root: Path) -> list[str]:
        return [str(binary), "-p", "--continue", TURN_2]


class HermesDriver(Driver):
    """`hermes -z` (oneshot) cannot resume a session (`--continue -z` starts a new one, seen in 0.19), so
    both turns use the CLI's single-query mode, which can."""

    def turn1(self, binary: Path) -> list[str]:
        return [str(binary), "chat", "-Q", "-q", TURN_1]

    def turn2(self, binary: Path, turn1_stdout: str, root: Path) -> list[str]:
        return [str(binary), "chat", "-Q", "--continue", "-q", TURN_2]


DRIVERS: dict[str, Driver] = {
    "dsh": DshDriver("dsh", "DSH_HOME", "dsh", "dsh"),
    "dsh-native": DshNativeDriver("dsh-native", "DSH_HOME", "dsh", "dsh"),
    "pi": PiDriver("pi", "PI_CODING_AGENT_DIR", "pi", "pi"),
    "hermes": HermesDriver("hermes", "HERMES_HOME", "hermes", "hermes"),
}


def binary(name: str) -> Path:
    if clients.CLIENTS[name].kind == "npm":  # Pi: installed by the venv's npm, run by its node (backend/binaries.py)
        need("node", "npm")
    return clients.ensure(name)
