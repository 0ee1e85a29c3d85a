"""The progress bar every long CLI command shows (rich): description, bar, done/total, elapsed time."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def progress_bar(console: Console, transient: bool = False) -> Progress:
    """`transient`: the bar disappears when done (for bars followed by a table of the same results)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=transient,
    )
