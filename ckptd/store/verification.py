"""The service's own verification of committed checkpoints, and its record (docs/design.md §2 item 5).

Every commit reads and checks every byte with the one checker (:mod:`.checker`) and records
that check as the checkpoint's first verification (:func:`record_commit_check`), beside the marker
as ``VERIFIED.json``: a committed checkpoint shows as verified without a second read. ``ckptd
verify`` runs the same checker in its own process; the service runs it again after each commit
(``CKPTD_VERIFY_AFTER_COMMIT``: a re-read of what reached the disk) or on request (``POST
.../verify``), in one of its worker processes (the reshard pool: warm, at low priority), and
records the outcome in the same place. The record names the manifest digest it checked, so it can never be
mistaken for the verification of another checkpoint under the same ref, and the stamp
(:meth:`Storage.stamp`) of every data file as it was before and after the reading: while every
stamp still holds, the record vouches for exactly the bytes now stored (:func:`record_holds`),
and retention may rely on it instead of reading everything again. The checkpoint itself
(marker, manifest, data) is not touched.

A record that failed (``ok`` false) for the manifest committed now makes the checkpoint **known to
be bad** (:func:`known_bad`): ``RUN/latest`` skips it (:meth:`.visibility.Visibility.latest`) and
retention does not count it among the newest it keeps. A checkpoint never verified, or whose record
is about another manifest under the same name, is not known to be bad.

Call order: the commit calls :func:`record_commit_check`; :func:`verify_committed` checks and records in the calling process (``ckptd gc``
offline); the service submits :func:`verify_and_record` to a worker; readers call
:func:`read_record`, retention :func:`record_holds`, and the visibility rule's ``latest``
:func:`known_bad`.
"""

from __future__ import annotations

import logging
import os
import stat as statmod
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptd_schemas import CkptdError, CorruptCheckpoint, StorageError

from ..storage import Storage, open_storage
from .layout import Paths
from .verify import VerifyReport, verify_manifest
from .visibility import Committed, Visibility

__all__ = ["CommitCheck", "VerifyRecord", "file_stamps", "known_bad", "read_record", "record_commit_check",
           "record_holds", "record_of", "record_vouches", "require_verified", "verify_and_record",
           "verify_committed", "verify_unrecorded"]

log = logging.getLogger("ckptd.store")

MAX_PROBLEMS = 100

#: A record of ``MAX_PROBLEMS`` problems is a few tens of KiB; a larger object there is not read by
#: :func:`known_bad` (it is not a record the service wrote).
MAX_RECORD_BYTES = 1 << 20

#: The most characters of a reason :func:`known_bad` gives.
MAX_REASON = 300


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


def file_stamps(storage: Storage, key_of: Callable[[str], str], files: list[str]) -> dict[str, str | None]:
    """Each file's storage stamp (:meth:`Storage.stamp`), by file name."""
    return {f: storage.stamp(key_of(f)) for f in files}


def _stamps(storage: Storage, c: Committed, files: list[str]) -> dict[str, str | None]:
    return file_stamps(storage, lambda f: Paths.file(c.run, c.name, c.session, f), files)


@dataclass(frozen=True)
class CommitCheck:
    """What the commit's full check (:func:`~.checker.check_commit`) read: the files' stamps
    before and after, the bytes, the time, the tensors and chunks."""

    before: dict[str, str | None]
    after: dict[str, str | None]
    bytes_read: int
    seconds: float
    tensors: int
    chunks: int


def record_commit_check(storage: Storage, run: str, name: str, digest: str, check: CommitCheck, files: int) -> None:
    """Record the commit's check as the checkpoint's first verification: it read and checked every
    byte with the one checker, so the checkpoint shows as verified (web view, gc, ``latest``) without
    a second read. The stamps vouch for the bytes only when none moved during the check. A failure
    to write the record is logged: the checkpoint is committed, and a later verification records."""
    stamps = check.before if check.before == check.after and all(check.before.values()) else {}
    rec = VerifyRecord(ref=f"{run}/{name}", manifest_xxh3=digest, ok=True, problems=[], files=files,
                       tensors=check.tensors, chunks=check.chunks, bytes_read=check.bytes_read, seconds=check.seconds,
                       verified_at=datetime.now(timezone.utc), stamps={k: v for k, v in stamps.items() if v})
    try:
        storage.put(Paths.verification(run, name), rec.model_dump_json().encode())
    except CkptdError as e:
        log.warning("the commit's check of %s/%s was not recorded: %s", run, name, e.message)


def verify_committed(storage: Storage, run: str, name: str) -> VerifyRecord:
    """Verify the visible checkpoint ``run/name`` (``latest`` allowed) here, store the record, return it."""
    rec, c = _verify_here(storage, run, name)
    storage.put(Paths.verification(c.run, c.name), rec.model_dump_json().encode())
    return rec


def require_verified(storage: Storage, run: str, name: str) -> VerifyRecord:
    """The one checker's verdict on the visible checkpoint ``run/name`` before a conversion (reshard,
    export) reads it as a source: its record while that still vouches for exactly the stored bytes
    (usually the commit's own: no second read), else a verification now, recorded. Raises
    :class:`~ckptd_schemas.CorruptCheckpoint` naming the problems when the stored bytes are not what
    the manifest says, so nothing is converted from a checkpoint that ``ckptd verify`` rejects, even
    where the conversion itself would not read the damaged bytes."""
    vis = Visibility(storage)
    c = vis.resolve(run, name)
    rec = record_of(storage, c)
    if record_holds(storage, c, rec, sorted(vis.manifest(c).files)):
        return rec  # type: ignore[return-value]
    rec = verify_committed(storage, c.run, c.name)
    if not rec.ok:
        manifest = vis.manifest(c)
        named = [f for f in manifest.files if any(f"'{f}'" in p for p in rec.problems)]
        held = sorted({t.name for t in manifest.tensors for ch in t.chunks if ch.location.file in named})
        where = f" (tensors stored there: {', '.join(repr(n) for n in held[:8])}{' ...' if len(held) > 8 else ''})" \
            if held else ""
        raise CorruptCheckpoint(f"{c.ref} does not verify, so it is not converted: "
                                f"{'; '.join(rec.problems[:3]) or 'verification failed'}{where} "
                                f"(ckptd verify names every problem)", ref=c.ref, tensors=held[:64], files=named[:64])
    return rec


def verify_unrecorded(storage: Storage, run: str, name: str) -> VerifyRecord:
    """:func:`verify_committed` that writes nothing: what a dry run (``ckptd gc --dry-run``) may do."""
    return _verify_here(storage, run, name)[0]


def _verify_here(storage: Storage, run: str, name: str) -> tuple[VerifyRecord, Committed]:
    vis = Visibility(storage)
    t0 = time.perf_counter()
    c = vis.resolve(run, name)  # not visible: CheckpointNotFound, nothing recorded
    report = VerifyReport(ref=c.ref)
    stamps: dict[str, str | None] = {}
    try:
        manifest = vis.manifest(c)
        before = _stamps(storage, c, sorted(manifest.files))
        report = verify_manifest(manifest, _StorageSource(storage, c.run, c.name, c.session,
                                                             {f: e.size for f, e in manifest.files.items()}),
                                 storage_errors_are_problems=False)
        if before == _stamps(storage, c, sorted(manifest.files)) and all(before.values()):
            stamps = before
    except StorageError:
        raise  # the store failed, not the checkpoint: nothing is recorded (a failed record makes `latest` skip it)
    except CkptdError as e:  # a manifest changed under us: recorded as a failure too
        report.problems.append(e.message)
    rec = VerifyRecord(ref=c.ref, manifest_xxh3=c.digest, ok=report.ok, problems=report.problems[:MAX_PROBLEMS],
                       files=report.files, tensors=report.tensors, chunks=report.chunks,
                       bytes_read=report.bytes_read, seconds=time.perf_counter() - t0,
                       verified_at=datetime.now(timezone.utc), stamps={k: v for k, v in stamps.items() if v})
    return rec, c


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
    return None if raw is None else _record_for(raw, c)


def known_bad(storage: Storage, c: Committed) -> str | None:
    """Why the visible checkpoint ``c`` is known to be bad, or None when it is not.

    Known bad: its stored record (``VERIFIED.json``) is about the manifest committed there now (the
    same digest) and found it bad (``ok`` false); the reason is ``verification failed at <time>:
    <first problem>``. None (not known to be bad): no record, a record about another manifest (an
    earlier checkpoint under the same name), one that found it good, one that does not parse, or,
    on a local root, anything there that is not a regular readable file of record size (never
    opened: a FIFO would block the reader). Called by :meth:`.visibility.Visibility.latest` on every
    resolve of ``RUN/latest``, newest first, and by retention; an object store's failure to read is
    the backend's (:class:`StorageError`, answered 503), as for markers."""
    key = Paths.verification(c.run, c.name)
    path = storage.local_path(key)
    if path is not None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not statmod.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD_BYTES:
            return None
    try:
        raw = storage.read_or_none(key)
    except StorageError:
        if path is None:
            raise
        return None
    if raw is None or len(raw) > MAX_RECORD_BYTES:
        return None
    rec = _record_for(raw, c)
    if rec is None or rec.ok:
        return None
    when = rec.verified_at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    first = rec.problems[0] if rec.problems else "no problem named"
    reason = f"verification failed at {when}: {first}"
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."


def _record_for(raw: bytes, c: Committed) -> VerifyRecord | None:
    """The record in ``raw`` if it parses and is about ``c``'s manifest (its digest), else None."""
    try:
        rec = VerifyRecord.model_validate_json(raw)
    except ValidationError:
        return None
    return rec if rec.manifest_xxh3 == c.digest else None


def record_vouches(storage: Storage, c: Committed, file: str, key: str) -> bool:
    """True when checkpoint ``c``'s recorded verification found it good and ``file`` (stored at ``key``)
    still has the stamp it had then (inode, size, mtime and ctime locally: no writer sets ctime back;
    ETag and size on S3): a file worth linking into a new save. The commit reads it again anyway."""
    rec = record_of(storage, c)
    if rec is None or not rec.ok:
        return False
    want = rec.stamps.get(file)
    return bool(want) and storage.stamp(key) == want


def record_holds(storage: Storage, c: Committed, rec: VerifyRecord | None, files: list[str]) -> bool:
    """True when ``rec`` found checkpoint ``c`` good and vouches for exactly the bytes stored now: the
    same manifest digest, and every data file's stamp unchanged since it was read."""
    if rec is None or not rec.ok or rec.manifest_xxh3 != c.digest or sorted(rec.stamps) != sorted(files):
        return False
    return _stamps(storage, c, files) == rec.stamps
