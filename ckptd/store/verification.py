"""The service's own verification of committed checkpoints, and its record (DESIGN §2 item 5).

``ckptd verify`` checks a checkpoint in its own process. The service can do the same check after
each commit (``CKPTD_VERIFY_AFTER_COMMIT``) or on request (``POST .../verify``), in one of its
worker processes (the reshard pool: warm, at low priority), and records the outcome beside the
marker as ``VERIFIED.json``. The record names the manifest digest it checked, so it can never be
mistaken for the verification of another checkpoint under the same ref; the checkpoint itself
(marker, manifest, data) is not touched.

Call order: the service submits :func:`verify_and_record` to a worker; readers call
:func:`read_record`.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from pydantic import BaseModel, ConfigDict

from ckptd_schemas import CkptdError

from ..storage import Storage, open_storage
from .layout import Paths
from .reader import CheckpointReader
from .verify import VerifyReport, verify_manifest

__all__ = ["VerifyRecord", "read_record", "verify_and_record"]

MAX_PROBLEMS = 100


class VerifyRecord(BaseModel):
    """What one verification of a committed checkpoint found."""

    model_config = ConfigDict(extra="forbid")

    ref: str
    manifest_xxh3: str
    ok: bool
    problems: list[str]
    files: int
    tensors: int
    chunks: int
    bytes_read: int
    seconds: float
    verified_at: datetime


class _StorageSource:
    def __init__(self, storage: Storage, run: str, name: str, session: str) -> None:
        self.storage, self.run, self.name, self.session = storage, run, name, session

    def read(self, file: str, start: int, end: int) -> bytes:
        return self.storage.read(Paths.file(self.run, self.name, self.session, file), start, end)


def verify_and_record(root: str, run: str, name: str) -> dict:
    """In a worker process: verify the committed checkpoint ``run/name`` of the storage at ``root``
    and store the record; return it (as a dict: it crosses the process boundary)."""
    from ..reshard.priority import lower_priority

    lower_priority()
    storage = open_storage(root)
    reader = CheckpointReader(storage)
    t0 = time.perf_counter()
    name, marker = reader.resolve(run, name)  # RUN/latest allowed; not committed: CheckpointNotFound
    report = VerifyReport(ref=f"{run}/{name}")
    try:
        report = verify_manifest(reader.manifest(run, name), _StorageSource(storage, run, name, marker.session))
    except CkptdError as e:  # a manifest that does not match its marker, or does not parse: recorded too
        report.problems.append(e.message)
    rec = VerifyRecord(ref=report.ref, manifest_xxh3=marker.manifest_xxh3, ok=report.ok,
                       problems=report.problems[:MAX_PROBLEMS], files=report.files, tensors=report.tensors,
                       chunks=report.chunks, bytes_read=report.bytes_read, seconds=time.perf_counter() - t0,
                       verified_at=datetime.now(timezone.utc))
    storage.put(Paths.verification(run, name), rec.model_dump_json().encode())
    return rec.model_dump(mode="json")


def read_record(storage: Storage, run: str, name: str) -> VerifyRecord | None:
    """The stored record of ``run/name`` (a resolved name, not ``latest``), if any, and only if it is
    about the manifest committed there."""
    marker = CheckpointReader(storage).marker(run, name)
    raw = storage.read_json_or_none(Paths.verification(run, name))
    if marker is None or raw is None:
        return None
    rec = VerifyRecord.model_validate(raw)
    return rec if rec.manifest_xxh3 == marker.manifest_xxh3 else None
