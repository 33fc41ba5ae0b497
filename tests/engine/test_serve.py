"""`hyperharness serve` end to end, as a user runs it: a real engine behind the real proxy, the printed
key and URL work with the official OpenAI SDK, SIGTERM leaves no process behind."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from backend.launcher import free_port
from backend.profiles import load_profile
from backend.serve import ServeError, plan, run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_busy_port_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        p = plan(load_profile("cpu-smol"), host=None, port=busy, engine_port=free_port(), use_key=False,
                 key_file=None, prepare=False, run_dir=tmp_path)
        with pytest.raises(ServeError, match=f"port {busy} \\(proxy\\) is already in use"):
            asyncio.run(run(p))


@pytest.mark.unit
def test_no_key_binds_loopback(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("HYPERHARNESS_API_KEY", raising=False)
    p = plan(load_profile("cpu-smol"), host=None, port=None, engine_port=None, use_key=False, key_file=None,
             prepare=False, run_dir=tmp_path)
    assert p.proxy_host == "127.0.0.1" and p.key is None and p.proxy.api_key_file is None
    assert "--host" in p.engine_argv and p.engine_argv[p.engine_argv.index("--host") + 1] == "127.0.0.1"


@pytest.mark.engine
def test_serve_prints_a_working_url_and_key_and_stops_cleanly(tmp_path):
    """One `serve` run: URL and key work with the OpenAI SDK, a wrong key is refused, the engine behind
    refuses everyone but the proxy, SIGTERM stops both."""
    port, eport = free_port(), free_port()
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    env.pop("HYPERHARNESS_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.cli", "serve", "--profile", "cpu-smol", "--port", str(port),
         "--engine-port", str(eport), "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                pytest.fail("serve exited early:\n" + "".join(lines))
            lines.append(line)
            if line.startswith("logs:"):
                break
        out = "".join(lines)
        base = re.search(r"base URL: (\S+)", out).group(1)
        key_file = Path(re.search(r"API key:\s+(\S+)", out).group(1))
        assert key_file.stat().st_mode & 0o777 == 0o600
        key = key_file.read_text().strip()
        assert f"curl -s {base}/chat/completions" in out

        client = openai.OpenAI(base_url=base, api_key=key)
        reply = client.chat.completions.create(
            model="smollm2-135m", temperature=0, max_tokens=12,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert "Paris" in reply.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong").models.list()
        # pass-through routes reach the engine with the engine's own key, not the client's
        r = httpx.post(f"{base}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                       json={"model": "smollm2-135m", "prompt": "Paris is", "max_tokens": 3})
        assert r.status_code == 200, r.text
        # the engine itself has a per-run key only the proxy holds (plugin middleware on every route)
        engine = f"http://127.0.0.1:{eport}"
        assert httpx.get(engine + "/health").status_code == 200
        for path in ("/tokenize", "/metrics", "/v1/models"):
            assert httpx.get(engine + path, headers={"Authorization": f"Bearer {key}"}).status_code == 401, path
        # one runtime config file hands everything to the proxy; it names key files, holds no secret
        config = tmp_path / "run" / "proxy.json"
        assert config.stat().st_mode & 0o777 == 0o600 and key not in config.read_text()
        assert json.loads(config.read_text())["upstreams"][0]["geometry"]["seats"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert not (tmp_path / "run" / "keys" / "engine_api_key").exists()  # this run's engine key is gone
    for p in (port, eport):  # nothing is left listening
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", p)) != 0

