"""The service's last retention decisions, kept in memory for the web view (``/ui``, live page).

A gc plan (``ckptd.store.retention.RetentionPlan.as_json``) says what it kept and why, what it
deleted, and which checkpoint it established as the newest verified one. Storage keeps no trace of
a decision once it is carried out, so the service remembers the last few, per run, from both
paths that decide: ``POST /v1/runs/{run}/gc`` and the retention policy after a commit.

Call order: ``create_app`` builds one :class:`GcLog` and hands :meth:`GcLog.record` to
``retention_routes`` (which calls it after every decision); ``ui_routes`` reads
:meth:`GcLog.recent`. Memory only, per replica: a restart forgets, by design (nothing here is a
record anyone relies on; the deletions themselves are in the service's log).
"""

from __future__ import annotations

import threading
from collections import deque
from datetime import datetime, timezone
from typing import Any

__all__ = ["GcLog"]

PER_RUN = 20  # decisions kept per run
MAX_RUNS = 1000  # runs remembered (the least recently collected are forgotten first)


class GcLog:
    """The last :data:`PER_RUN` retention decisions of each run, newest first on read."""

    def __init__(self, per_run: int = PER_RUN, max_runs: int = MAX_RUNS) -> None:
        self.per_run, self.max_runs = per_run, max_runs
        self._runs: dict[str, deque[dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def record(self, run: str, plan: dict[str, Any], source: str, dry_run: bool = False) -> None:
        """Remember one decision: ``plan`` as ``RetentionPlan.as_json`` gives it; ``source`` says who asked."""
        entry = {"at": datetime.now(timezone.utc).isoformat(), "source": source, "dry_run": dry_run, **plan}
        with self._lock:
            q = self._runs.pop(run, None) or deque(maxlen=self.per_run)
            q.append(entry)
            self._runs[run] = q  # re-inserted: the dict's order is the order of last decision
            while len(self._runs) > self.max_runs:
                self._runs.pop(next(iter(self._runs)))

    def recent(self, run: str, limit: int = PER_RUN) -> list[dict[str, Any]]:
        with self._lock:
            q = list(self._runs.get(run, ()))
        return q[::-1][:limit]
