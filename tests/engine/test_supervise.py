"""`hyperharness serve` keeps its engine up: a SIGKILLed vLLM API server leaves no EngineCore behind, is
restarted, and the same proxy process serves the next chat turn; SIGTERM then leaves no process of the
proxy, the engine or serve itself."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from backend.launcher import free_port, session_members

ROOT = Path(__file__).resolve().parents[2]
BOOT_S = float(os.environ.get("HYPERHARNESS_ENGINE_TIMEOUT", "600"))


class Serve:
    """`serve` as a user runs it, its output collected by a thread (so a full pipe never blocks it)."""

    def __init__(self, tmp: Path, port: int, eport: int) -> None:
        env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "cfg")}
        env.pop("HYPERHARNESS_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "serve", "--profile", "cpu-smol", "--no-key", "--port", str(port),
             "--engine-port", str(eport), "--run-dir", str(tmp / "run")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[start:]:
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited ({self.proc.returncode}) before {pattern!r}:\n" + "".join(self.lines))
            time.sleep(0.2)
        pytest.fail(f"no {pattern!r} within {timeout:.0f}s:\n" + "".join(self.lines))


def _listener(port: int) -> psutil.Process:
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return psutil.Process(conn.pid)
    pytest.fail(f"nothing listens on {port}")


def _chat(base: str) -> str:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m", "temperature": 0, "max_tokens": 12,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.engine
def test_engine_sigkill_is_restarted_without_orphans_or_proxy_restart(tmp_path):
    port, eport = free_port(), free_port()
    serve = Serve(tmp_path, port, eport)
    base = f"http://127.0.0.1:{port}"
    try:
        serve.wait_for(r"^logs:", BOOT_S)
        server, proxy = _listener(eport), _listener(port)
        engine_sid = os.getsid(server.pid)
        cores = [c for c in server.children(recursive=True) if "EngineCore" in " ".join(c.cmdline()) + c.name()]
        assert cores, "vLLM's EngineCore child of the API server was not found"
        assert {c.pid for c in cores} <= set(session_members(engine_sid))
        assert "Paris" in _chat(base)

        mark = len(serve.lines)
        killed = time.monotonic()
        server.send_signal(signal.SIGKILL)
        # the orphaned EngineCore is killed with its session (before the restart, not at shutdown)
        serve.wait_for(r"engine-0: exited \(code -9\)", 30, mark)
        assert session_members(engine_sid) == [], "the killed engine left processes running"
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in cores)
        back = serve.wait_for(r"engine-0: healthy again ([0-9.]+)s after it died", BOOT_S, mark)
        assert "Paris" in _chat(base)  # the same proxy process, never restarted
        recovered = time.monotonic() - killed
        assert proxy.is_running() and _listener(port).pid == proxy.pid
        new_server = _listener(eport)
        assert new_server.pid != server.pid and os.getsid(new_server.pid) != engine_sid
        print(f"\nrecovery: engine healthy {float(back.group(1)):.1f}s after its death was seen; "
              f"first chat turn answered {recovered:.1f}s after the SIGKILL")
        sessions = {engine_sid, os.getsid(new_server.pid), os.getsid(proxy.pid), serve.proc.pid}
    finally:
        serve.proc.send_signal(signal.SIGTERM)
        serve.proc.wait(90)
    assert serve.proc.returncode == 0, "".join(serve.lines)
    left = {sid: session_members(sid) for sid in sessions}
    assert not any(left.values()), f"processes left after SIGTERM: {left}"
