"""`hyperharness`: one typer app; each concern registers its own sub-commands from its own module."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from harness_adapters.cli import KeySource, make_app

from . import geometry
from .doctor import doctor
from .keys import ENV_VAR, default_key_file
from .models import REGISTRY, ModelPrepError, prepare_model
from .patchtool import app as patches_app
from .profiles import ProfileError, available_profiles, load_profile
from .tools import bench_app

app = typer.Typer(help="HyperHarness: a patched vLLM behind a token-exact proxy for agent harnesses.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
models_app = typer.Typer(help="Embedded models (prepared on first use).", no_args_is_help=True)
profiles_app = typer.Typer(help="Launch profiles in configs/.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(profiles_app, name="profiles")
app.add_typer(patches_app, name="patches")
app.add_typer(make_app(KeySource(ENV_VAR, default_key_file())), name="adapters")
app.add_typer(bench_app, name="bench")
app.command("doctor")(doctor)
err = Console(stderr=True)


def default_profile() -> str:
    return "gpu-long" if shutil.which("nvidia-smi") else "cpu-smol"


@app.command()
def serve(
    profile: str = typer.Option(None, "--profile", "-p",
                                help="configs/<name>.yaml (default: gpu-long with a GPU, else cpu-smol)"),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="print the engine argv, the proxy config and the pool geometry; start nothing"),
    host: str = typer.Option(None, help="proxy bind address (default 0.0.0.0 with a key, 127.0.0.1 without)"),
    port: int = typer.Option(None, help="proxy port (default from the profile)"),
    engine_port: int = typer.Option(None, help="engine port on 127.0.0.1 (default from the profile)"),
    no_key: bool = typer.Option(False, "--no-key", help="run without a bearer key (binds 127.0.0.1 only)"),
    key_file: Path = typer.Option(None, help="bearer key file (default ~/.config/hyperharness/api_key)"),
    run_dir: Path = typer.Option(Path(".run"),
                                 help="logs under RUN_DIR/logs; the proxy config and this run's key files in RUN_DIR"),
    redis_url: str = typer.Option(None, help="keep session transcripts in Redis (shared across proxies)"),
    engines: int = typer.Option(1, "--engines", min=1, help="start N engines of the profile behind the proxy "
                                "(one per GPU, or N on the CPU), on --engine-port, +1, …"),
    upstream: list[str] = typer.Option(None, "--upstream", help="a remote engine's URL instead of local ones "
                                       "(repeatable; geometry from the profile)"),
    upstream_key_file: Path = typer.Option(None, help="the remote engines' API key file (with --upstream)"),
    engine_only: bool = typer.Option(False, "--engine-only", help="start the engine(s) alone, no proxy "
                                     "(a compose engine service; proxies elsewhere take it as --upstream)"),
    engine_host: str = typer.Option("127.0.0.1",
                                    help="engine bind address (beyond loopback: needs --engine-key-file)"),
    engine_key_file: Path = typer.Option(None,
                                         help="the engines' API key file (default: a new key per engine and run)"),
    client_keys: list[Path] = typer.Option(None, "--client-keys", help="a file of more client keys, one a line "
                                           "(repeatable; each opens every route like the main key)"),
) -> None:
    """Start the engine(s) and the proxy in front of them; a crashed engine is restarted; Ctrl-C stops all.
    --dry-run prints the engine argv, the proxy's runtime config and the pool geometry."""
    from .serve import ServeError, plan, print_plan, run

    try:
        prof = load_profile(profile or default_profile())
        p = plan(prof, host=host, port=port, engine_port=engine_port, use_key=not no_key, key_file=key_file,
                 prepare=not dry_run, run_dir=run_dir.resolve(), redis_url=redis_url, engines=engines,
                 upstreams=upstream or (), upstream_key_file=upstream_key_file, engine_only=engine_only,
                 engine_host=engine_host, engine_key_file=engine_key_file, client_key_files=client_keys or ())
        if dry_run:
            print_plan(p)
            if not p.geometry.fits:
                err.print("[red]this profile would be refused at boot: the worst case does not fit[/]")
                raise typer.Exit(2)
            return
        code = asyncio.run(run(p))
    except (ProfileError, ModelPrepError, ServeError, geometry.PoolDoesNotFit) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def replay(
    traces: list[Path] = typer.Argument(None, help="JSONL agent traces (default: the three bundled ones)"),
    base_url: str = typer.Option(..., help="the proxy, e.g. http://127.0.0.1:8000"),
    direct_url: str = typer.Option(None, help="vLLM itself, replayed through its own chat endpoint in the same run"),
    model: str = typer.Option("default"),
    api_key: str = typer.Option(None, envvar="HYPERHARNESS_API_KEY"),
    metrics_url: str = typer.Option(None, help="where vLLM's /metrics is (default: --direct-url)"),
    gap: float = typer.Option(0.5, help="seconds between turns (the harness running its tools)"),
    warmup: bool = typer.Option(True, help="also replay with the proxy's next-turn warm-up"),
) -> None:
    """Replay multi-turn agent traces; print prompt, cached and re-prefilled tokens and TTFT per turn."""
    from .tools.replay import replay_command

    replay_command(traces or [], base_url, direct_url, model, api_key, metrics_url, gap, warmup)


@app.command()
def top(
    url: str = typer.Option("http://127.0.0.1:8000", help="the proxy's base URL"),
    key: str = typer.Option(None, envvar=ENV_VAR, help="the proxy's key (default: $HYPERHARNESS_API_KEY, else the"
                                                        " key file)"),
    once: bool = typer.Option(False, "--once", help="print one frame and exit"),
    interval: float = typer.Option(1.0, help="seconds between refreshes"),
) -> None:
    """The dashboard's live view in the terminal: engines, pool, queue, sessions and cache reuse."""
    from .top import top_command

    if key is None and default_key_file().is_file():
        key = default_key_file().read_text().strip() or None
    try:
        raise typer.Exit(top_command(url, key, once, interval))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@models_app.command("prepare")
def models_prepare(names: list[str] = typer.Argument(None, help="default: all"),
                   verify: bool = typer.Option(False, help="re-hash every file of a finished build"),
                   profile: list[str] = typer.Option(None, "--profile", "-p", help="prepare this profile's "
                                                     "checkpoint (int8 heads; repeatable; resumable)")) -> None:
    """Build embedded models into the cache, or with --profile a GPU profile's prepared checkpoint."""
    if profile:
        from .models.report import prepare_profiles

        try:
            prepare_profiles([load_profile(p) for p in profile], Console())
        except (ProfileError, ModelPrepError) as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        return
    for name in names or list(REGISTRY):
        try:
            print(prepare_model(name, deep_check=verify))
        except ModelPrepError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None


@models_app.command("draft-vocab")
def models_draft_vocab(profile: str = typer.Option(..., "--profile", "-p",
                                                   help="a profile with model.prepare.draft_vocab"),
                       base_url: str = typer.Option(..., help="a running server of this model (engine or proxy)"),
                       model: str = typer.Option(None, help="served model name (default: the profile's)"),
                       api_key: str = typer.Option(None, envvar="HYPERHARNESS_API_KEY"),
                       concurrency: int = typer.Option(8, min=1)) -> None:
    """Count the model's own outputs on the shipped prompts into the MTP drafter's vocabulary."""
    from .models.report import draft_vocab_command

    try:
        draft_vocab_command(load_profile(profile), base_url, model, api_key, concurrency, Console())
    except (ProfileError, ModelPrepError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None


@models_app.command("list")
def models_list() -> None:
    from .models import model_dir
    from .models.cache import verify_manifest

    t = Table("name", "prepared", "description")
    for m in REGISTRY.values():
        t.add_row(m.name, "yes" if verify_manifest(model_dir(m.name)) else "no", m.description)
    Console().print(t)


@profiles_app.command("list")
def profiles_list() -> None:
    t = Table("profile", "device", "model", "context", "seats", "kv cache")
    for name in available_profiles():
        p = load_profile(name)
        t.add_row(name, p.engine.device, p.model.served_name, f"{p.engine.max_model_len:,}",
                  str(p.engine.max_num_seqs), p.engine.kv_cache_dtype)
    Console().print(t)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
