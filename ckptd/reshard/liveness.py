"""Where service jobs' liveness lives in storage: each replica's heartbeat, and the index of jobs not yet final.

::

    jobs/replicas/OWNER.json       a replica's heartbeat: {"owner", "host", "pid", "at": Unix time}
    jobs/active/KIND.ID.json       a reshard job or drill (KIND) whose record is not final yet

Call order: the service calls :func:`beat` while its pool holds jobs and :func:`forget` at shutdown;
``jobs.enqueue`` calls :func:`mark_active` before the first record; the worker
calls :func:`finish` after the final one; :mod:`.recovery` reads :func:`active` and :func:`last_beat`.
Pure storage: no job model is imported here, so the job modules can import it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Literal

from ckptd_schemas import CkptdError

from ..storage import Storage

__all__ = ["ACTIVE", "REPLICAS", "Kind", "active", "beat", "finish", "forget", "last_beat", "listed_at", "mark_active"]

Kind = Literal["reshard", "drill"]

ACTIVE = "jobs/active"
REPLICAS = "jobs/replicas"


# -- heartbeats -----------------------------------------------------------------------------------------

def beat(storage: Storage, owner: str) -> None:
    """Renew replica ``owner``'s heartbeat (now, wall-clock)."""
    storage.put(f"{REPLICAS}/{owner}.json", json.dumps(
        {"owner": owner, "host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}).encode())


def forget(storage: Storage, owner: str) -> None:
    """Delete ``owner``'s heartbeat (a clean shutdown: its jobs are taken over without waiting)."""
    storage.delete(f"{REPLICAS}/{owner}.json")


def last_beat(storage: Storage, owner: str) -> float | None:
    """When ``owner`` last renewed its heartbeat (Unix time); None when it has none (or one that does
    not parse)."""
    try:
        data = storage.read_json_or_none(f"{REPLICAS}/{owner}.json")
        return float(data["at"]) if isinstance(data, dict) else None
    except (CkptdError, KeyError, TypeError, ValueError):
        return None


# -- the index of jobs not yet final -------------------------------------------------------------------

def _active_key(kind: Kind, job_id: str) -> str:
    return f"{ACTIVE}/{kind}.{job_id}.json"


def mark_active(storage: Storage, kind: Kind, job_id: str) -> None:
    """List the job as not final (before its first record is written)."""
    storage.put(_active_key(kind, job_id), json.dumps({"at": time.time()}).encode())


def listed_at(storage: Storage, kind: Kind, job_id: str) -> float | None:
    """When the job was listed (Unix time); None when it is not, or the entry does not parse."""
    try:
        data = storage.read_json_or_none(_active_key(kind, job_id))
        return float(data["at"]) if isinstance(data, dict) else None
    except (CkptdError, KeyError, TypeError, ValueError):
        return None


def finish(storage: Storage, kind: Kind, job_id: str) -> None:
    """The job's record is final: drop it from the index."""
    storage.delete(_active_key(kind, job_id))


def active(storage: Storage) -> list[tuple[Kind, str]]:
    """(kind, id) of every job listed as not final."""
    out: list[tuple[Kind, str]] = []
    for entry in storage.list(ACTIVE):
        parts = entry.split(".")
        if len(parts) == 3 and parts[0] in ("reshard", "drill") and parts[1].isalnum() and parts[2] == "json":
            out.append((parts[0], parts[1]))  # type: ignore[arg-type]
    return out
