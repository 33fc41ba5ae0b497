"""What `hyperharness models prepare --profile P` prints: the prepared directory, the error of every
int8 tensor against the bound, the bytes saved, and the run's peak memory (getrusage high-water mark,
which a streamed run keeps near the interpreter's own footprint, far below the checkpoint)."""
from __future__ import annotations

import resource

from rich.console import Console
from rich.table import Table

from .prepared import build_draft_vocab, prepare_profile


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


def draft_vocab_table(vocab: dict) -> Table:
    t = Table(title=f"draft vocabulary: {vocab['size']:,} ids ({len(vocab['specials'])} special)", show_header=False)
    t.add_row("prompts counted / held out", f"{vocab['prompts']['counted']} / {vocab['prompts']['held_out']}")
    t.add_row("output tokens counted / held out", f"{vocab['tokens']['counted']:,} / {vocab['tokens']['held_out']:,}")
    t.add_row("distinct ids in the counted outputs", f"{vocab['distinct_ids_counted']:,}")
    t.add_row("coverage of the held-out outputs", f"{vocab['coverage']['held_out']:.2%}")
    t.add_row("coverage of the counted outputs", f"{vocab['coverage']['counted']:.2%}")
    return t


def draft_vocab_command(profile, base_url: str, model: str | None, api_key: str | None, concurrency: int,
                        out: Console) -> None:
    from rich.progress import Progress

    from .draft_vocab import load_prompts
    from .progress import console

    total = len(load_prompts(profile.model.prepare.draft_vocab.prompt_set)) if profile.model.prepare and \
        profile.model.prepare.draft_vocab else 0
    with Progress(console=console) as prog:
        task = prog.add_task("generating", total=total)
        target, vocab = build_draft_vocab(profile, base_url, model=model, api_key=api_key, concurrency=concurrency,
                                          progress=lambda n: prog.advance(task, n))
    out.print(f"[bold]{profile.name}[/]: {target}")
    out.print(draft_vocab_table(vocab))
