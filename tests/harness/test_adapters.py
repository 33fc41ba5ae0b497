"""Config writers (harness_adapters/): what each writes, that unrelated user settings survive, backups,
idempotence, `remove`, `--dry-run` diffs, and the model facts read from the proxy's /v1/models."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from harness_adapters import ADAPTERS, AdapterError, Target, fetch_target
from harness_adapters.base import BACKUP_SUFFIX, KEY_ENV, default_max_output, set_env_line
from harness_adapters.cli import KeySource, make_app

pytestmark = [pytest.mark.unit]

TARGET = Target(base_url="http://127.0.0.1:8000/v1", model="qwen-local", context_window=65536, max_output=4096,
                key="sk-secret", key_file=None)


def apply_all(changes: list) -> None:  # type: ignore[type-arg]
    for c in changes:
        c.apply()


def test_dsh_writes_route_a_patch_and_keeps_user_patches(tmp_path: Path) -> None:
    (tmp_path / "cordis.patch.yml").write_text(yaml.safe_dump([
        {"id": "llm-pi-ai", "config": {"providers": {"mine": {"api": "openai-completions", "baseURL": "http://x"}}}},
        {"id": "tools", "config": {"mode": "full"}}]))
    (tmp_path / ".env").write_text("OTHER=1\n")
    apply_all(ADAPTERS["dsh"].install(TARGET, tmp_path))
    patches = {p["id"]: p for p in yaml.safe_load((tmp_path / "cordis.patch.yml").read_text())}
    providers = patches["llm-pi-ai"]["config"]["providers"]
    ours = providers["hyperharness"]
    assert providers["mine"] == {"api": "openai-completions", "baseURL": "http://x"}
    assert patches["tools"] == {"id": "tools", "config": {"mode": "full"}}
    assert patches["agent-default-model"]["config"] == {"provider": "hyperharness", "model": "qwen-local"}
    assert ours["cacheRetention"] == "long" and ours["apiKeyEnv"] == KEY_ENV
    assert ours["compat"]["supportsDeveloperRole"] is False and ours["compat"]["maxTokensField"] == "max_tokens"
    assert ours["models"][0]["contextWindow"] == 65536 and ours["models"][0]["maxTokens"] == 4096
    assert ours["defaultContextWindow"] == 65536  # not DSH's 1M / 256K defaults
    assert "sk-secret" not in (tmp_path / "cordis.patch.yml").read_text()
    assert (tmp_path / ".env").read_text() == f"OTHER=1\n{KEY_ENV}=sk-secret\n"
    assert "DEEPSEEK_API_KEY" not in (tmp_path / ".env").read_text()  # web search must not get our key
    assert (tmp_path / ("cordis.patch.yml" + BACKUP_SUFFIX)).exists()
    assert ADAPTERS["dsh"].show(tmp_path)["provider"]["baseURL"] == TARGET.base_url
    apply_all(ADAPTERS["dsh"].remove(tmp_path))
    patches = {p["id"]: p for p in yaml.safe_load((tmp_path / "cordis.patch.yml").read_text())}
    assert set(patches) == {"llm-pi-ai", "tools"} and set(patches["llm-pi-ai"]["config"]["providers"]) == {"mine"}


def test_pi_writes_models_and_settings(tmp_path: Path) -> None:
    (tmp_path / "settings.json").write_text(json.dumps({"theme": "dark", "defaultThinkingLevel": "high"}))
    key_file = tmp_path / "key"
    key_file.write_text("sk-secret\n")
    target = Target(TARGET.base_url, TARGET.model, TARGET.context_window, TARGET.max_output, "sk-secret", key_file)
    apply_all(ADAPTERS["pi"].install(target, tmp_path))
    models = json.loads((tmp_path / "models.json").read_text())
    ours = models["providers"]["hyperharness"]
    assert ours["apiKey"] == f"!cat {key_file.resolve()}"  # the key stays in its file
    assert ours["compat"]["sendSessionAffinityHeaders"] is True
    assert ours["compat"]["supportsDeveloperRole"] is False and ours["compat"]["supportsStore"] is False
    assert ours["models"][0]["maxTokens"] == 4096
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings == {"theme": "dark", "defaultThinkingLevel": "high", "defaultProvider": "hyperharness",
                        "defaultModel": "qwen-local"}


def test_hermes_writes_named_provider(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"base_url": "http://old", "default": "x"},
                                                          "agent": {"max_turns": 5}}))
    apply_all(ADAPTERS["hermes"].install(TARGET, tmp_path))
    data = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert data["agent"] == {"max_turns": 5}
    assert data["model"] == {"default": "qwen-local", "provider": "custom:hyperharness", "context_length": 65536,
                             "max_tokens": 4096}
    ours = data["providers"]["hyperharness"]
    assert ours["max_output_tokens"] == 4096 and ours["key_env"] == KEY_ENV
    assert ours["extra_headers"] == {"x-harness": "hermes"}
    assert f"{KEY_ENV}=sk-secret" in (tmp_path / ".env").read_text()


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_install_is_idempotent_and_remove_restores(name: str, tmp_path: Path) -> None:
    adapter = ADAPTERS[name]
    apply_all(adapter.install(TARGET, tmp_path))
    assert not [c for c in adapter.install(TARGET, tmp_path) if c.changed]
    apply_all(adapter.remove(tmp_path))
    assert adapter.show(tmp_path) == {}
    for path in tmp_path.iterdir():
        if path.name.endswith(BACKUP_SUFFIX) or not path.is_file():
            continue
        assert "hyperharness" not in path.read_text(), path


def test_bad_existing_file_is_refused_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(AdapterError, match="not valid YAML"):
        ADAPTERS["hermes"].install(TARGET, tmp_path)
    assert (tmp_path / "config.yaml").read_text() == "model: [unclosed\n"


def test_env_lines() -> None:
    assert set_env_line("A=1\nexport HYPERHARNESS_API_KEY=old\n", KEY_ENV, "new") == "A=1\nHYPERHARNESS_API_KEY=new\n"
    assert set_env_line("A=1\n", KEY_ENV, None) == "A=1\n"
    assert set_env_line(None, KEY_ENV, None) is None
    assert default_max_output(65536) == 16384 and default_max_output(1_000_000) == 32768


# --- /v1/models and the CLI -------------------------------------------------------------------------

class _Models(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.headers.get("authorization") != "Bearer sk-secret":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"object": "list", "data": [
            {"id": "smollm2-135m", "max_model_len": 65536, "context_length": 65536}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def models_url() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_fetch_target(models_url: str) -> None:
    t = fetch_target(models_url, key="sk-secret")
    assert (t.base_url, t.model, t.context_window, t.max_output) == (models_url + "/v1", "smollm2-135m", 65536, 16384)
    with pytest.raises(AdapterError, match="401"):
        fetch_target(models_url, key="wrong")
    with pytest.raises(AdapterError, match="no model 'x'"):
        fetch_target(models_url, key="sk-secret", model="x")


def test_cli_dry_run_writes_nothing(models_url: str, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-secret")
    app = make_app(KeySource("HH_TEST_UNSET_KEY_VAR", tmp_path / "no-default-key"))
    home = tmp_path / "hermes"
    r = CliRunner().invoke(app, ["install", "hermes", "--base-url", models_url + "/v1", "--key-file", str(key),
                                 "--home", str(home), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "+  hyperharness:" in r.output and "context_length: 65536" in r.output
    assert not home.exists()
    r = CliRunner().invoke(app, ["install", "hermes", "--base-url", models_url, "--key-file", str(key),
                                 "--home", str(home), "--max-output", "128"])
    assert r.exit_code == 0, r.output
    assert ADAPTERS["hermes"].show(home)["provider"]["max_output_tokens"] == 128
    r = CliRunner().invoke(app, ["remove", "hermes", "--home", str(home)])
    assert r.exit_code == 0 and ADAPTERS["hermes"].show(home) == {}


def test_cli_key_from_the_serve_key_source(models_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No --key-file: the key comes from where the composition root says `serve` keeps it."""
    default = tmp_path / "api_key"
    default.write_text("sk-secret\n")
    app = make_app(KeySource("HH_TEST_KEY_VAR", default))
    home = tmp_path / "hermes"
    monkeypatch.delenv("HH_TEST_KEY_VAR", raising=False)
    r = CliRunner().invoke(app, ["install", "hermes", "--base-url", models_url, "--home", str(home), "--dry-run"])
    assert r.exit_code == 0, r.output
    monkeypatch.setenv("HH_TEST_KEY_VAR", "wrong")
    r = CliRunner().invoke(app, ["install", "hermes", "--base-url", models_url, "--home", str(home), "--dry-run"])
    assert r.exit_code == 2 and "401" in r.output
