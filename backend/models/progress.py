"""A small step-progress helper over rich, shared by the model builders."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

console = Console(stderr=True)


@contextlib.contextmanager
def steps(title: str, names: list[str]) -> Iterator[Stepper]:
    with Progress(
        SpinnerColumn(),
        TextColumn(f"[bold]{title}[/] {{task.description}}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task(names[0] if names else "", total=len(names))
        yield Stepper(progress, task, names)


class Stepper:
    def __init__(self, progress: Progress, task, names: list[str]) -> None:
        self._progress, self._task, self._names, self._done = progress, task, names, 0

    def next(self) -> None:
        self._done += 1
        label = self._names[self._done] if self._done < len(self._names) else "done"
        self._progress.update(self._task, completed=self._done, description=label)
