"""`hyperharness serve`: the engine behind the proxy, started, watched and stopped as one unit.

Order: resolve the model, hold the profile's worst case against the pool (refuse to boot when it does
not fit), compute the proxy's runtime config (backend/runtime.py), check both ports, start the engine on
127.0.0.1, write the config and its key files (0600) under the run directory, start the proxy with it,
wait for both to be healthy, print how to call it; then wait. Ctrl-C / SIGTERM, or either child dying,
stops both (each child runs in its own process group, so nothing is orphaned).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from proxy.settings import Settings

from . import geometry
from .keys import default_key_file, load_or_create_key
from .launcher import ManagedProcess, engine_argv, engine_env, port_is_free, wait_healthy
from .models import model_dir, prepare_model
from .profiles import Profile
from .runtime import proxy_argv, proxy_settings

console = Console(stderr=True)


class ServeError(RuntimeError):
    pass


@dataclass(frozen=True)
class ServePlan:
    profile: Profile
    model_path: Path
    geometry: geometry.Geometry
    engine_argv: list[str]
    engine_env_overrides: dict[str, str]
    proxy: Settings  # the proxy's runtime config (key files by path; written by `run`)
    config_path: Path
    run_dir: Path
    key: str | None
    key_source: str | None
    engine_key: str  # this run's own engine key, known only to the proxy (VLLM_API_KEY for the engine)
    # Key files this run writes and removes: the engine's key, and the client key when it came from the
    # environment (the config names files, never secrets).
    written_keys: tuple[tuple[Path, str], ...] = ()

    @property
    def proxy_argv(self) -> list[str]:
        return proxy_argv(self.config_path)

    @property
    def proxy_host(self) -> str:
        return self.proxy.host

    @property
    def proxy_port(self) -> int:
        return self.proxy.port

    @property
    def engine_port(self) -> int:
        return int(self.proxy.upstream.url.rsplit(":", 1)[1])


def resolve_model(profile: Profile, *, prepare: bool) -> Path:
    m = profile.model
    if m.path is not None:
        return m.path
    if m.embedded is not None:
        return prepare_model(m.embedded) if prepare else model_dir(m.embedded)
    repo = m.hf_repo
    if repo is None:  # the profile's validator allows no fourth source
        raise ServeError(f"profile {profile.name}: model names no source")
    if not prepare:
        return Path(repo)  # vLLM accepts a repo id; `serve` downloads it first
    from huggingface_hub import snapshot_download

    console.print(f"downloading {repo} with huggingface_hub (resumable)…")
    return Path(snapshot_download(repo, revision=m.hf_revision))


def model_shape(profile: Profile, model_path: Path) -> geometry.ModelShape:
    if (model_path / "config.json").is_file():
        return geometry.ModelShape.from_model_dir(model_path)
    if profile.model.shape:
        return geometry.ModelShape.named(profile.model.shape)
    raise ServeError(f"{model_path}: no config.json and the profile names no `shape:` for the geometry")


def device_memory_bytes(profile: Profile) -> int | None:
    if profile.engine.device != "cuda":
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.mem_get_info()[1]
    except Exception:  # no CUDA torch here (a dry run on a laptop): fall back to the profile's figure
        pass
    return None


def plan(profile: Profile, *, host: str | None, port: int | None, engine_port: int | None,
         use_key: bool, key_file: Path | None, prepare: bool, run_dir: Path = Path(".run"),
         redis_url: str | None = None) -> ServePlan:
    model_path = resolve_model(profile, prepare=prepare)
    geom = geometry.compute(profile, model_shape(profile, model_path), device_memory_bytes(profile))
    key, source = load_or_create_key(key_file or default_key_file(), create=prepare) if use_key else (None, None)
    keys_dir = run_dir / "keys"
    engine_key_file = keys_dir / "engine_api_key"
    engine_key = secrets.token_urlsafe(24)
    written = [(engine_key_file, engine_key)]
    api_key_file: Path | None = None
    if use_key:
        from_file = source is not None and not source.startswith("$")
        api_key_file = (key_file or default_key_file()) if from_file else keys_dir / "api_key"
        if not from_file and key is not None:
            written.append((api_key_file, key))
    eport = engine_port or profile.proxy.engine_port
    bind = host or profile.proxy.host or ("0.0.0.0" if use_key else "127.0.0.1")
    settings = proxy_settings(
        profile, geom, model_path=model_path, host=bind,
        port=port or profile.proxy.port, engine_url=f"http://127.0.0.1:{eport}", api_key_file=api_key_file,
        engine_key_file=engine_key_file, redis_url=redis_url)
    return ServePlan(profile, model_path, geom, engine_argv(profile, model_path, eport), engine_env(profile, base={}),
                     settings, run_dir / "proxy.json", run_dir, key, source, engine_key, tuple(written))


def print_plan(p: ServePlan) -> None:
    out = Console()
    out.print(f"[bold]profile[/] {p.profile.name}: {p.profile.description.strip()}")
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p.engine_env_overrides.items()))
    out.print("[bold]engine argv[/]")
    out.print((env + " " if env else "") + shlex.join(p.engine_argv), soft_wrap=True, markup=False)
    out.print("[bold]proxy argv[/]")
    out.print(shlex.join(p.proxy_argv), soft_wrap=True, markup=False)
    out.print(f"[bold]proxy runtime config[/] ({p.config_path})")
    out.print(p.proxy.model_dump_json(indent=2), soft_wrap=True, markup=False)
    table = Table(title="pool geometry", show_header=False)
    for k, v in p.geometry.describe():
        table.add_row(k, v)
    out.print(table)


def write_runtime_files(p: ServePlan) -> None:
    """The key files (0600, in a 0700 folder) and the config that names them."""
    for path, secret in p.written_keys:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
    p.proxy.dump(p.config_path)


def remove_runtime_files(p: ServePlan) -> None:
    for path, _ in p.written_keys:
        path.unlink(missing_ok=True)


async def run(p: ServePlan, health_timeout: float = 900.0) -> int:
    geometry.check(p.geometry)
    for name, port, host in (("proxy", p.proxy_port, p.proxy_host), ("engine", p.engine_port, "127.0.0.1")):
        if not port_is_free(port, "0.0.0.0" if host == "0.0.0.0" else "127.0.0.1"):
            raise ServeError(f"port {port} ({name}) is already in use; stop what holds it or pass "
                             f"--{'port' if name == 'proxy' else 'engine-port'} N")
    logs = p.run_dir / "logs"
    write_runtime_files(p)
    # The engine gets a key of its own for this run, known only to the proxy (through its config's key
    # file): with our plugin's middleware it then refuses every route but /health (0.32.0 alone leaves
    # /tokenize, /metrics, /invocations open), so another local user cannot drive it around the proxy.
    engine = ManagedProcess("engine", p.engine_argv, {**engine_env(p.profile), "VLLM_API_KEY": p.engine_key},
                            logs / "engine.log")
    proxy = ManagedProcess("proxy", p.proxy_argv, dict(os.environ), logs / "proxy.log")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    try:
        engine.start()
        proxy.start()
        with console.status("") as status:
            def tick(label):
                # A spinner on a terminal; a line every 10 s in a log or CI, where a spinner is invisible.
                last = [-10.0]

                def update(s: float) -> None:
                    msg = f"{label} starting… {s:4.0f}s (logs: {logs})"
                    if console.is_terminal:
                        status.update(msg)
                    elif s - last[0] >= 10:
                        last[0] = s
                        console.print(msg, markup=False)
                return update
            await _until(stop, wait_healthy(f"http://127.0.0.1:{p.engine_port}/health", engine, health_timeout,
                                            tick("engine")))
            await _until(stop, wait_healthy(f"http://127.0.0.1:{p.proxy_port}/health", proxy, 60, tick("proxy")))
        _print_ready(p, time.monotonic() - started, logs)
        while not stop.is_set():
            for child in (engine, proxy):
                if not child.alive:
                    console.print(f"[red]{child.name} exited (code {child.returncode}); stopping[/]\n"
                                  f"{child.log_tail()}")
                    return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return 0
    except _Stopped:
        return 130
    finally:
        console.print("stopping proxy and engine…")
        proxy.stop()
        engine.stop()
        remove_runtime_files(p)


class _Stopped(Exception):
    pass


async def _until(stop: asyncio.Event, coro) -> None:
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        task.cancel()
        raise _Stopped()
    stopper.cancel()
    task.result()


def _print_ready(p: ServePlan, seconds: float, logs: Path) -> None:
    out = Console(soft_wrap=True)  # never wrap a path or a URL mid-way
    shown = "127.0.0.1" if p.proxy_host in ("0.0.0.0", "::") else p.proxy_host
    base = f"http://{shown}:{p.proxy_port}/v1"
    out.print(f"[bold green]ready[/] in {seconds:.1f}s — model [bold]{p.profile.model.served_name}[/]")
    out.print(f"base URL: {base}")
    if p.key:
        source = p.key_source or ""
        out.print(f"API key:  {source}")
        auth = '-H "Authorization: Bearer $HYPERHARNESS_API_KEY" ' if source.startswith("$") else \
            f'-H "Authorization: Bearer $(cat {source.split(" ")[0]})" '
    else:
        out.print("API key:  none (listening on 127.0.0.1 only)")
        auth = ""
    question = '[{"role": "user", "content": "What is the capital of France?"}]'
    body = f'{{"model": "{p.profile.model.served_name}", "temperature": 0, "messages": {question}}}'
    out.print("try:", markup=False)
    out.print(f"  curl -s {base}/chat/completions {auth}-H 'Content-Type: application/json' -d '{body}'",
              markup=False, soft_wrap=True)
    out.print(f"logs: {logs}; Ctrl-C stops both.", markup=False)
