"""What `hyperharness models prepare --profile P` prints: the prepared directory, the error of every
int8 tensor against the bound, the bytes saved, and the run's peak memory (getrusage high-water mark,
which a streamed run keeps near the interpreter's own footprint, far below the checkpoint)."""
from __future__ import annotations

import resource

from rich.console import Console
from rich.table import Table

from .prepared import prepare_profile


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def error_table(report: dict) -> Table:
    bound = report["recipe"]["max_rel_error"]
    t = Table(title=f"int8 group-{report['recipe']['group_size']} symmetric, scales in {report['scale_dtype']}")
    t.add_column("tensor", overflow="fold")
    t.add_column("part")
    t.add_column("shape")
    t.add_column("relative error", justify="right")
    t.add_column(f"< {bound:.0%}")
    t.add_column("bytes before → after", justify="right")
    for name, e in sorted(report["tensors"].items()):
        t.add_row(name, e["part"], "×".join(map(str, e["shape"])), f"{e['rel_error']:.4%}",
                  "yes" if e["rel_error"] < bound else "NO",
                  f"{e['source_bytes']:,} → {e['prepared_bytes']:,}")
    for name, why in sorted(report.get("kept", {}).items()):
        t.add_row(name, "kept", "", "", "", why)
    return t


def prepare_profiles(profiles: list, out: Console) -> None:
    for profile in profiles:
        target, rep = prepare_profile(profile)
        out.print(f"[bold]{profile.name}[/]: {target}")
        out.print(error_table(rep))
        gib = 1 << 30
        out.print(f"shards: {rep['source_bytes'] / gib:.2f} GiB → {rep['prepared_bytes'] / gib:.2f} GiB; "
                  f"peak RSS of this run {peak_rss_bytes() / (1 << 20):,.0f} MiB")
