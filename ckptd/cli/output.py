"""Terminal output helpers: sizes, progress bars (rich, only on a terminal), a reshard's preview and engine."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Callable

__all__ = ["Bar", "human", "plural", "print_preview", "progress_bar"]


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


def print_preview(pv, as_json: bool) -> None:
    """``ckptd reshard --dry-run``'s table (the same through a service: ``HttpBackend`` rebuilds the
    preview from the service's answer)."""
    if as_json:
        print(json.dumps(asdict(pv)))
        return
    kinds = ["weights", "gradients", "optimizer", "other"]
    print(f"target {pv.spec}: {pv.world_size} ranks")
    print("rank   " + "  ".join(f"{k:>12}" for k in kinds) + f"  {'total':>12}")
    for r, row in enumerate(pv.per_rank):
        print(f"{r:<6} " + "  ".join(f"{human(row.get(k, 0)):>12}" for k in kinds)
              + f"  {human(sum(row.values())):>12}")
    print(f"imbalance {pv.imbalance:.1%}")
    note = " (gradients not saved: estimated as the weights' size)" if pv.grads_estimated else ""
    print(f"ZeRO estimates per rank: M_S2 ~ N*b_p + N*(b_g+b_o)/P = {human(pv.m_s2)};  "
          f"M_S3 ~ N*(b_p+b_g+b_o)/P = {human(pv.m_s3)}{note}")
    print("work units (unit, rank, file, bytes to read):")
    for u, r, f, n in pv.unit_reads:
        print(f"  {u:>5}  {r:>5}  {f}  {human(n)}")


class Bar:
    """A byte progress bar on stderr, started once its total is known (``start``), stopped by ``stop``;
    nothing when ``quiet`` or not on a terminal (:func:`progress_bar`)."""

    def __init__(self, label: str, quiet: bool) -> None:
        self.label, self.quiet = label, quiet
        self._stop: Callable[[], None] = lambda: None

    def start(self, total: int) -> Callable[[int], None] | None:
        self._stop()
        advance, self._stop = progress_bar(total, self.label, self.quiet)
        return advance

    def stop(self) -> None:
        self._stop()
        self._stop = lambda: None
