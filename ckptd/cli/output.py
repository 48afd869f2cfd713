"""Terminal output helpers: sizes and progress bars (rich, only on a terminal)."""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["human", "plural", "progress_bar"]


def human(n: float) -> str:
    """A size in decimal units (kB = 1000 B), the units of the progress bars' columns too."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def plural(n: int, noun: str) -> str:
    """``1 chunk``, ``2 chunks``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def progress_bar(total: int, label: str, quiet: bool) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """(advance, stop) for a byte progress bar on stderr; no-ops when quiet or not a terminal."""
    if quiet or not sys.stderr.isatty():
        return None, lambda: None
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), transient=True)
    bar.start()
    task = bar.add_task(label, total=total)
    return (lambda n: bar.advance(task, n)), bar.stop
