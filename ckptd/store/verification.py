"""The service's own verification of committed checkpoints, and its record (docs/design.md §2 item 5).

``ckptd verify`` checks a checkpoint in its own process. The service can do the same check after
each commit (``CKPTD_VERIFY_AFTER_COMMIT``) or on request (``POST .../verify``), in one of its
worker processes (the reshard pool: warm, at low priority), and records the outcome beside the
marker as ``VERIFIED.json``. The record names the manifest digest it checked, so it can never be
mistaken for the verification of another checkpoint under the same ref, and the stamp
(:meth:`Storage.stamp`) of every data file as it was before and after the reading: while every
stamp still holds, the record vouches for exactly the bytes now stored (:func:`record_holds`),
and retention may rely on it instead of reading everything again. The checkpoint itself
(marker, manifest, data) is not touched.

Call order: :func:`verify_committed` checks and records in the calling process (``ckptd gc``
offline); the service submits :func:`verify_and_record` to a worker; readers call
:func:`read_record`, and retention :func:`record_holds`.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptd_schemas import CkptdError

from ..storage import Storage, open_storage
from .layout import Paths
from .verify import VerifyReport, verify_manifest
from .visibility import Committed, Visibility

__all__ = ["VerifyRecord", "read_record", "record_holds", "record_of", "verify_and_record", "verify_committed"]

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
    stamps: dict[str, str] = Field(default_factory=dict,
                                   description="each data file's storage stamp, unchanged while it was read; "
                                               "empty when a file changed meanwhile or the store has no stamps")


class _StorageSource:
    """Reads as ``CheckpointReader.read_range`` does (``ckptd verify --root``): a file absent or of
    another size than the manifest says is :class:`CorruptCheckpoint`, so every verifier agrees."""

    def __init__(self, storage: Storage, run: str, name: str, session: str, sizes: dict[str, int]) -> None:
        self.storage, self.run, self.name, self.session, self.sizes = storage, run, name, session, sizes

    def read(self, file: str, start: int, end: int) -> bytes:
        key, size = Paths.file(self.run, self.name, self.session, file), self.sizes[file]
        self.storage.check_committed(key, size, file=file)
        return self.storage.read_committed(key, start, end, size, file=file)


def _stamps(storage: Storage, c: Committed, files: list[str]) -> dict[str, str | None]:
    return {f: storage.stamp(Paths.file(c.run, c.name, c.session, f)) for f in files}


def verify_committed(storage: Storage, run: str, name: str) -> VerifyRecord:
    """Verify the visible checkpoint ``run/name`` (``latest`` allowed) here, store the record, return it."""
    vis = Visibility(storage)
    t0 = time.perf_counter()
    c = vis.resolve(run, name)  # not visible: CheckpointNotFound, nothing recorded
    report = VerifyReport(ref=c.ref)
    stamps: dict[str, str | None] = {}
    try:
        manifest = vis.manifest(c)
        before = _stamps(storage, c, sorted(manifest.files))
        report = verify_manifest(manifest, _StorageSource(storage, c.run, c.name, c.session,
                                                             {f: e.size for f, e in manifest.files.items()}))
        if before == _stamps(storage, c, sorted(manifest.files)) and all(before.values()):
            stamps = before
    except CkptdError as e:  # a manifest changed under us: recorded as a failure too
        report.problems.append(e.message)
    rec = VerifyRecord(ref=c.ref, manifest_xxh3=c.digest, ok=report.ok, problems=report.problems[:MAX_PROBLEMS],
                       files=report.files, tensors=report.tensors, chunks=report.chunks,
                       bytes_read=report.bytes_read, seconds=time.perf_counter() - t0,
                       verified_at=datetime.now(timezone.utc), stamps={k: v for k, v in stamps.items() if v})
    storage.put(Paths.verification(c.run, c.name), rec.model_dump_json().encode())
    return rec


def verify_and_record(root: str, run: str, name: str) -> dict:
    """In a worker process: :func:`verify_committed` on the storage at ``root``; the record as a dict
    (it crosses the process boundary)."""
    from ..reshard.priority import lower_priority

    lower_priority()
    return verify_committed(open_storage(root), run, name).model_dump(mode="json")


def read_record(storage: Storage, run: str, name: str) -> VerifyRecord | None:
    """The stored record of ``run/name`` (a resolved name, not ``latest``), if any, and only if it is
    about the manifest committed there (a record that does not parse counts as none)."""
    c = Visibility(storage).check(run, name)
    return record_of(storage, c) if c is not None else None


def record_of(storage: Storage, c: Committed) -> VerifyRecord | None:
    """:func:`read_record` for a checkpoint the caller's visibility check already found."""
    raw = storage.read_or_none(Paths.verification(c.run, c.name))
    if raw is None:
        return None
    try:
        rec = VerifyRecord.model_validate_json(raw)
    except ValidationError:
        return None
    return rec if rec.manifest_xxh3 == c.digest else None


def record_holds(storage: Storage, c: Committed, rec: VerifyRecord | None, files: list[str]) -> bool:
    """True when ``rec`` found checkpoint ``c`` good and vouches for exactly the bytes stored now: the
    same manifest digest, and every data file's stamp unchanged since it was read."""
    if rec is None or not rec.ok or rec.manifest_xxh3 != c.digest or sorted(rec.stamps) != sorted(files):
        return False
    return _stamps(storage, c, files) == rec.stamps
