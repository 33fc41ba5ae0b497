"""User-facing tools, apart from the product code: replay of agent traces, the fan-out admission bench,
the proxy cost benches. They compose backend/ (launcher, profiles, runtime config) and proxy/, so they
live under the composition root; the CLI imports each one only when its command runs.

    replay.py          `hyperharness replay`: traces through the proxy and straight at vLLM, cache reuse
    bench_fanout.py    `hyperharness bench fanout`: subagents on a small pool (short and long-context), direct vs proxy
    bench_route.py     `hyperharness bench route`: a session trace over two engines, placement policies compared
    bench_costs.py     `python -m backend.tools.bench_costs`: the proxy's added latency and CPU
    bench_upstream.py  `python -m backend.tools.bench_upstream`: the upstream client's per-request cost
    bench_render.py    `python -m backend.tools.bench_render`: render / splice cost of a long session
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

bench_app = typer.Typer(help="Benchmarks.", no_args_is_help=True)


@bench_app.callback()
def _bench() -> None:
    """Benchmarks (a group, so `bench fanout` stays a sub-command when it is the only one)."""


@bench_app.command("fanout")
def fanout_command(
    profile: str = typer.Option(None, "--profile", "-p",
                                help="short-regime profile (default cpu-fanout; configs/<name>.yaml)"),
    mode: str = typer.Option("both", help="short | long | both: the regimes to run, each on its own engine"),
    long_profile: str = typer.Option(None, help="long-regime profile (default cpu-fanout-long)"),
    engine_url: str = typer.Option(None, help="use a running engine of that profile instead of starting one"),
    subagents: int = typer.Option(8, help="subagent requests fired at once"),
    sub_tokens: int = typer.Option(128, help="tokens each subagent generates in the short regime (ignore_eos)"),
    main_gap: float = typer.Option(1.0, help="seconds between main-agent requests during the burst"),
    log_dir: Path = typer.Option(Path(".run/logs"), help="engine and proxy logs"),
) -> None:
    """Subagents + a main agent on a small pool, directly at vLLM vs through the proxy; the long regime
    sizes subagents with a shared long parent context from the pool; prints issue 30's goals."""
    from .bench_fanout import fanout

    if mode not in ("short", "long", "both"):
        raise typer.BadParameter("--mode must be short, long or both")
    log_dir.mkdir(parents=True, exist_ok=True)
    kw = {"subagents": subagents, "sub_tokens": sub_tokens, "main_gap": main_gap}
    print(asyncio.run(fanout(profile, engine_url, log_dir.resolve(), kw, mode, long_profile)))



@bench_app.command("route")
def route_command(
    profile: str = typer.Option("cpu-smol", "--profile", "-p", help="engine profile (configs/<name>.yaml)"),
    sessions: int = typer.Option(4, help="K agent sessions run at once"),
    turns: int = typer.Option(4, help="M turns per session"),
    fanout: int = typer.Option(3, help="subagents per session (two turns each, parent header)"),
    reply_tokens: int = typer.Option(32, help="tokens per reply"),
    system_words: int = typer.Option(300, help="shared system prompt length in words"),
    policies: str = typer.Option("affinity,round_robin,session_hash,least_loaded", help="comma-separated"),
    kv_gib: int = typer.Option(None, help="CPU profiles: each engine's KV pool in GiB (default: the profile's)"),
    max_model_len: int = typer.Option(None, help="each engine's window (default: the profile's)"),
    log_dir: Path = typer.Option(Path(".run/logs"), help="engine and proxy logs"),
) -> None:
    """K sessions x M turns with subagent fan-out over two engines: our placement vs the baselines."""
    from .bench_route import bench_route

    log_dir.mkdir(parents=True, exist_ok=True)
    kw = {"sessions": sessions, "turns": turns, "fanout": fanout, "reply_tokens": reply_tokens,
          "system_words": system_words}
    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    print(bench_route(profile, log_dir.resolve(), kw, chosen, kv_gib=kv_gib, max_model_len=max_model_len))
