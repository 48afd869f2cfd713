"""The service's one pool of worker processes: reshard jobs, verifications and conversion drills.

Call order: ``create_app`` builds one :class:`Workers` (``CKPTD_RESHARD_WORKERS`` processes); the
reshard, verification and drill paths call it for the pool, which starts on first use (a service
that never converts or verifies starts no process), and ``close`` at shutdown.

Every worker is set up once, when it starts (:func:`_start_worker`): it lowers its CPU and I/O
priority, so saves and loads keep theirs (``os.nice`` adds, so doing it per job would take a pooled
worker to the floor at its second job), and it exits when the service does, even a SIGKILLed one.
Workers are spawned, not forked: a fork of a threaded server would inherit its locks.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor

__all__ = ["Workers"]


class Workers:
    """The pool, started on first use; calling the object returns it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self) -> ProcessPoolExecutor:
        """The pool; a new one when a worker of the last one died abruptly (killed, out of memory): such a
        pool refuses every later submission, and the service must not need a restart to verify again."""
        with self._lock:
            if self._pool is not None and getattr(self._pool, "_broken", False):
                self._pool.shutdown(wait=False, cancel_futures=True)  # its jobs already failed with it
                self._pool = None
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.size, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_worker, initargs=(os.getpid(),))
            return self._pool

    def close(self) -> None:
        """Stop the workers (jobs in progress end with them; their sessions stay invisible)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _start_worker(parent: int) -> None:
    """Lower this worker's CPU and I/O priority, and exit when its service dies (even by SIGKILL)."""
    with contextlib.suppress(OSError):
        os.nice(10)
    try:  # the idle I/O class where the platform allows it (Linux: ionice -c3)
        import psutil  # type: ignore[import-not-found]

        psutil.Process().ionice(psutil.IOPRIO_CLASS_IDLE)
    except Exception:  # noqa: BLE001 - optional
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="ckptd-parent-watch", daemon=True).start()
