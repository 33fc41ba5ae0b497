"""The runtime config: one file from `serve` to the proxy, key files read (never stored), the refusal to
expose a keyless proxy, and `python -m proxy --config` failing clearly on a bad file."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from proxy.settings import EngineGeometry, SchedulerConfig, Settings, UpstreamConfig

pytestmark = pytest.mark.unit


def test_refuses_public_bind_without_key() -> None:
    with pytest.raises(ValueError, match="without an API key"):
        Settings(host="0.0.0.0", upstream="http://127.0.0.1:1").check_exposure()
    Settings(host="0.0.0.0", upstream="http://127.0.0.1:1", api_key="k").check_exposure()


def test_round_trip_through_one_file_reads_the_key_files(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("sk-file\n")
    (tmp_path / "engine").write_text("engine-secret")
    engine = EngineGeometry(seats=2, block_size=864, gdn_groups=3, state_slots_per_seat=9, spec_tokens=7)
    settings = Settings(
        port=9000, model_dir=tmp_path, model_name="m", api_key_file=tmp_path / "key", redis_url="redis://x:1/0",
        upstreams=(UpstreamConfig(url="http://127.0.0.1:8001/", api_key_file=tmp_path / "engine", geometry=engine),),
        scheduler=SchedulerConfig(max_queue=3, max_wait_s=(5, 5, 5)),
    )
    path = tmp_path / "run" / "proxy.json"
    settings.dump(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    raw = path.read_text()
    assert "sk-file" not in raw and "engine-secret" not in raw  # key files by path only
    loaded = Settings.load(path)
    assert loaded.api_key == "sk-file" and loaded.upstream.api_key == "engine-secret"
    assert loaded.upstream.url == "http://127.0.0.1:8001"
    assert loaded.upstream.geometry == engine and loaded.upstream.geometry.state_blocks_per_seat == 27
    assert loaded.scheduler.max_queue == 3 and loaded.redis_url == "redis://x:1/0"
    assert json.loads(raw)["upstreams"][0]["geometry"]["spec_tokens"] == 7


def test_config_is_strict(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="upstream must be an http"):
        Settings(upstream="127.0.0.1:8001")
    with pytest.raises(ValidationError, match="must be unique"):  # several engines, each named once
        Settings(upstreams=(UpstreamConfig(url="http://a:1"), UpstreamConfig(url="http://b:1")))
    with pytest.raises(ValidationError, match="greater than 0"):
        UpstreamConfig(url="http://a:1", weight=0)
    with pytest.raises(ValidationError, match="extra"):
        Settings(upstream="http://a:1", sched_seats=4)  # a misspelt knob is an error, not a default
    (tmp_path / "empty").write_text("")
    cfg = tmp_path / "c.json"
    Settings(upstream="http://a:1", api_key_file=tmp_path / "empty").dump(cfg)
    with pytest.raises(ValueError, match="is empty"):
        Settings.load(cfg)


def test_proxy_command_refuses_a_bad_config(tmp_path: Path) -> None:
    cfg = tmp_path / "proxy.json"
    cfg.write_text('{"upstreams": [{"url": "http://127.0.0.1:1"}], "host": "0.0.0.0"}')
    r = subprocess.run([sys.executable, "-m", "proxy", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "without an API key" in r.stderr
    r = subprocess.run([sys.executable, "-m", "proxy", "--config", str(tmp_path / "missing.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot read the proxy config" in r.stderr
