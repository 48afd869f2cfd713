"""Background work yields to trainers: lower a worker process's CPU and I/O priority, once."""

from __future__ import annotations

import functools
import os

__all__ = ["lower_priority"]


@functools.cache
def lower_priority() -> None:
    """Once per worker process: ``os.nice`` adds to the niceness, so calling it for every job of a pooled
    worker would take it from 10 to the floor of 19 at the second job."""
    try:
        os.nice(10)
    except OSError:
        pass
    try:  # idle I/O class where the platform allows it (Linux: ionice -c3)
        import psutil  # type: ignore[import-not-found]

        psutil.Process().ionice(psutil.IOPRIO_CLASS_IDLE)
    except Exception:  # noqa: BLE001 - optional
        pass
