"""`hyperharness serve`: the engines behind the proxy, started, watched and stopped as one unit.

Order: resolve the model, hold the profile's worst case against the pool of each engine (refuse to boot
when it does not fit), compute the proxy's runtime config (backend/runtime.py) listing every engine,
check the ports, start the engines on 127.0.0.1 (`--engines N`: one per GPU, or N on the CPU; or none,
with `--upstream URL`), write the config and its key files (0600) under the run directory, start the
proxy with it, wait for all to be healthy, print how to call it; then supervise. An engine that dies is
restarted with bounded retries and backoff (backend/supervisor.py) while the proxy keeps serving; the
proxy dying, every engine giving up, Ctrl-C or SIGTERM stops everything. Each child leads its own
session, and stopping one kills every process of that session (vLLM's EngineCore included).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from proxy.settings import Settings, read_key, read_keys

from . import geometry
from .keys import default_key_file, load_or_create_key
from .launcher import ManagedProcess, engine_argv, engine_env, port_is_free, wait_healthy
from .models import model_dir, prepare_model
from .profiles import Profile
from .runtime import engine_name, proxy_argv, proxy_settings
from .supervisor import EngineSupervisor, RestartPolicy

console = Console(stderr=True)


class ServeError(RuntimeError):
    pass


@dataclass(frozen=True)
class EnginePlan:
    """One local engine: its port, argv, the environment it gets beyond the profile's, its own key."""

    name: str
    port: int
    argv: list[str]
    env: dict[str, str]  # CUDA_VISIBLE_DEVICES / VLLM_CPU_OMP_THREADS_BIND when several run side by side
    key: str  # VLLM_API_KEY: known to this engine and the proxy only
    key_file: Path
    log_name: str
    host: str = "127.0.0.1"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"


@dataclass(frozen=True)
class ServePlan:
    profile: Profile
    model_path: Path
    geometry: geometry.Geometry
    engines: tuple[EnginePlan, ...]  # local engines; empty when every upstream is remote (--upstream)
    engine_env_overrides: dict[str, str]
    proxy: Settings  # the proxy's runtime config (key files by path; written by `run`)
    config_path: Path
    run_dir: Path
    key: str | None
    key_source: str | None
    # Key files this run writes and removes: each engine's key, and the client key when it came from the
    # environment (the config names files, never secrets).
    written_keys: tuple[tuple[Path, str], ...] = ()
    engine_only: bool = False  # `--engine-only`: the engines of a container set (compose), no proxy

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
    def engine_argv(self) -> list[str]:
        """The first local engine's argv (the only one without --engines)."""
        return self.engines[0].argv

    @property
    def engine_port(self) -> int:
        return self.engines[0].port


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


def gpu_ids() -> list[str] | None:
    """The cards this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi's list); None: unknown."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
            return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
    return None


def placement_env(profile: Profile, count: int) -> list[dict[str, str]]:
    """Per engine, where it runs when several run side by side: its own cards (pipeline_parallel_size
    each) on a GPU, its own core on a CPU (vllm-cpu pins every engine's worker to the first core by
    default). One engine gets nothing: it sees what the user's environment gives it, as before."""
    if count == 1:
        return [{}]
    if profile.engine.device == "cuda":
        per = profile.engine.pipeline_parallel_size
        ids = gpu_ids()
        if ids is not None and len(ids) < per * count:
            raise ServeError(f"--engines {count} of profile {profile.name} needs {per * count} GPU(s) "
                             f"({per} each); {len(ids)} visible")
        ids = ids if ids is not None else [str(i) for i in range(per * count)]  # a dry run without cards
        return [{"CUDA_VISIBLE_DEVICES": ",".join(ids[i * per:(i + 1) * per])} for i in range(count)]
    if "VLLM_CPU_OMP_THREADS_BIND" in profile.engine.env:
        return [{} for _ in range(count)]
    cores = os.cpu_count() or 1
    return [{"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)} for i in range(count)]


def plan(profile: Profile, *, host: str | None, port: int | None, engine_port: int | None,
         use_key: bool, key_file: Path | None, prepare: bool, run_dir: Path = Path(".run"),
         redis_url: str | None = None, engines: int = 1, upstreams: Sequence[str] = (),
         upstream_key_file: Path | None = None, engine_only: bool = False, engine_host: str = "127.0.0.1",
         engine_key_file: Path | None = None, client_key_files: Sequence[Path] = ()) -> ServePlan:
    """`client_key_files`: more client keys (one a line), each opening every route like the main key.
    `engine_only`, `engine_host`, `engine_key_file`: run the engines alone, on `engine_host`, all with
    the key in that file (the proxies of a compose set read the same file); else each engine gets a key
    of its own for this run, known to the proxy only, and binds 127.0.0.1."""
    if engines < 1:
        raise ServeError("--engines must be at least 1")
    if engine_only and upstreams:
        raise ServeError("--engine-only starts local engines; --upstream names remote ones")
    if engine_host not in ("127.0.0.1", "localhost") and engine_key_file is None:
        raise ServeError("an engine bound beyond loopback needs --engine-key-file (its key, shared with the proxies)")
    if upstreams and engines != 1:
        raise ServeError("give --engines N (local engines) or --upstream URL (remote ones), not both")
    if client_key_files and not use_key:
        raise ServeError("--client-keys adds keys to the proxy's key; it cannot go with --no-key")
    for f in client_key_files:
        try:
            read_keys(f)  # refused here, with its reason, rather than by the proxy after the engines boot
        except ValueError as exc:
            raise ServeError(str(exc)) from None
    model_path = resolve_model(profile, prepare=prepare)
    geom = geometry.compute(profile, model_shape(profile, model_path), device_memory_bytes(profile))
    key, source = load_or_create_key(key_file or default_key_file(), create=prepare) if use_key else (None, None)
    keys_dir = run_dir / "keys"
    written: list[tuple[Path, str]] = []
    api_key_file: Path | None = None
    if use_key:
        from_file = source is not None and not source.startswith("$")
        api_key_file = (key_file or default_key_file()) if from_file else keys_dir / "api_key"
        if not from_file and key is not None:
            written.append((api_key_file, key))
    local: list[EnginePlan] = []
    if not upstreams:
        base = engine_port or profile.proxy.engine_port
        for i, env in enumerate(placement_env(profile, engines)):
            name, eport = engine_name(i), base + i
            if engine_key_file is not None:
                ekey, ekey_file = _shared_key(engine_key_file), engine_key_file
            else:
                ekey = secrets.token_urlsafe(24)
                ekey_file = keys_dir / ("engine_api_key" if i == 0 else f"{name}_api_key")
                written.append((ekey_file, ekey))
            argv = engine_argv(profile, model_path, eport, index=i, host=engine_host)
            local.append(EnginePlan(name, eport, argv, env, ekey, ekey_file,
                                    "engine.log" if engines == 1 else f"{name}.log", engine_host))
    urls: list[tuple[str, Path | None]] = [(f"http://127.0.0.1:{e.port}", e.key_file) for e in local] or \
        [(u, upstream_key_file) for u in upstreams]
    bind = host or profile.proxy.host or ("0.0.0.0" if use_key else "127.0.0.1")
    settings = proxy_settings(
        profile, geom, model_path=model_path, host=bind, port=port or profile.proxy.port, engines=urls,
        api_key_file=api_key_file, redis_url=redis_url, client_key_files=[f.resolve() for f in client_key_files])
    return ServePlan(profile, model_path, geom, tuple(local), engine_env(profile, base={}), settings,
                     run_dir / "proxy.json", run_dir, key, source, tuple(written), engine_only)


def _shared_key(path: Path) -> str:
    try:
        return read_key(path)
    except ValueError as exc:
        raise ServeError(str(exc)) from None


def print_plan(p: ServePlan) -> None:
    out = Console()
    out.print(f"[bold]profile[/] {p.profile.name}: {p.profile.description.strip()}")
    for e in p.engines:
        overrides = {**p.engine_env_overrides, **e.env}
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(overrides.items()))
        out.print(f"[bold]engine argv[/] ({e.name}, 127.0.0.1:{e.port})")
        out.print((env + " " if env else "") + shlex.join(e.argv), soft_wrap=True, markup=False)
    if not p.engines:
        out.print("[bold]remote engines[/] " + ", ".join(f"{u.name}={u.url}" for u in p.proxy.upstreams))
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


async def run(p: ServePlan, health_timeout: float = 900.0, policy: RestartPolicy | None = None) -> int:
    if p.engines:  # the pool check holds per engine: each runs the profile's geometry on its own pool
        geometry.check(p.geometry)
    checks = [] if p.engine_only else [("proxy", p.proxy_port, p.proxy_host, "--port N")]
    checks += [(e.name, e.port, e.host, "--engine-port N") for e in p.engines]
    for name, port, host, flag in checks:
        if not port_is_free(port, "0.0.0.0" if host == "0.0.0.0" else "127.0.0.1"):
            raise ServeError(f"port {port} ({name}) is already in use; stop what holds it or pass {flag}")
    logs = p.run_dir / "logs"
    write_runtime_files(p)
    # Each engine gets a key of its own for this run, known only to the proxy (through its config's key
    # files): with our plugin's middleware it then refuses every route but /health (0.32.0 alone leaves
    # /tokenize, /metrics, /invocations open), so another local user cannot drive it around the proxy.
    engines = [ManagedProcess(e.name, e.argv, {**engine_env(p.profile), **e.env, "VLLM_API_KEY": e.key},
                              logs / e.log_name) for e in p.engines]
    proxy = ManagedProcess("proxy", p.proxy_argv, dict(os.environ), logs / "proxy.log")
    policy = policy or RestartPolicy(health_timeout_s=health_timeout)
    supervisors = [EngineSupervisor(proc, e.health_url, policy, _say)
                   for proc, e in zip(engines, p.engines, strict=True)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    watchers: list[asyncio.Task] = []
    try:
        for proc in engines:
            proc.start()
        if not p.engine_only:
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
            await _until(stop, asyncio.gather(*(
                wait_healthy(e.health_url, proc, health_timeout, tick(e.name if len(engines) > 1 else "engine"))
                for proc, e in zip(engines, p.engines, strict=True))))
            if not p.engine_only:
                await _until(stop, wait_healthy(f"http://127.0.0.1:{p.proxy_port}/health", proxy, 60,
                                                tick("proxy")))
        if p.engine_only:
            _say(f"engines ready in {time.monotonic() - started:.1f}s: "
                 + ", ".join(f"{e.name} {e.host}:{e.port}" for e in p.engines))
        else:
            _print_ready(p, time.monotonic() - started, logs)
        watchers = [asyncio.ensure_future(s.watch(stop)) for s in supervisors]
        while not stop.is_set():
            if not p.engine_only and not proxy.alive:
                console.print(f"[red]proxy exited (code {proxy.returncode}); stopping[/]\n{proxy.log_tail()}")
                return 1
            if supervisors and all(s.failed for s in supervisors):
                console.print("[red]no engine is left (each gave up after its restarts); stopping[/]")
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return 0
    except _Stopped:
        return 130
    finally:
        stop.set()
        for w in watchers:
            with contextlib.suppress(Exception):
                await w
        console.print("stopping proxy and engines…" if len(engines) > 1 else "stopping proxy and engine…")
        for child in (proxy, *engines):
            left = child.stop()
            if left:
                console.print(f"[red]{child.name}: processes still running after SIGKILL: {left}[/]")
        remove_runtime_files(p)


def _say(line: str) -> None:
    console.print(line, markup=False)


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
    if len(p.proxy.upstreams) > 1:
        out.print("engines:  " + ", ".join(f"{u.name} {u.url}" for u in p.proxy.upstreams), markup=False)
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
