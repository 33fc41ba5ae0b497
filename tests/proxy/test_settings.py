"""Settings: the launcher's flags, the key sources, and the refusal to expose a keyless proxy."""

from __future__ import annotations

import pytest

from proxy.settings import Settings

pytestmark = pytest.mark.unit


def test_refuses_public_bind_without_key() -> None:
    with pytest.raises(ValueError, match="without an API key"):
        Settings(host="0.0.0.0", upstream="http://127.0.0.1:1").check_exposure()
    Settings(host="0.0.0.0", upstream="http://127.0.0.1:1", api_key="k").check_exposure()


def test_settings_from_argv(tmp_path) -> None:  # type: ignore[no-untyped-def]
    keyfile = tmp_path / "key"
    keyfile.write_text("sk-file\n")
    argv = [
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--upstream",
        "http://127.0.0.1:8001/",
        "--model-dir",
        str(tmp_path),
        "--model-name",
        "m",
        "--api-key-file",
        str(keyfile),
        "--redis-url",
        "redis://x:1/0",
    ]
    s = Settings.from_argv(argv, env={})
    assert (s.port, s.upstream, s.api_key, s.redis_url, s.model_name) == (
        9000,
        "http://127.0.0.1:8001",
        "sk-file",
        "redis://x:1/0",
        "m",
    )
    assert Settings.from_argv(["--upstream", "http://h:1"], env={"HYPERHARNESS_API_KEY": "sk-env"}).api_key == "sk-env"


def test_engine_key_sources(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert Settings.from_argv(["--upstream", "http://h:1"], env={"VLLM_API_KEY": "e"}).upstream_api_key == "e"
    f = tmp_path / "ek"
    f.write_text("file-key")
    s = Settings.from_argv(
        ["--upstream", "http://h:1", "--upstream-api-key-file", str(f)], env={"HYPERHARNESS_ENGINE_API_KEY": "x"}
    )
    assert s.upstream_api_key == "file-key" and s.api_key is None
