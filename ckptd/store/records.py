"""The verification record of a committed checkpoint (``VERIFIED.json``), and what it vouches for.

A commit that read and checked every byte with the one checker (:mod:`.checker`) records that check
as the checkpoint's first verification (:func:`record_commit_check`), beside the marker; one that
confirmed files checked as they arrived leaves it pending (their arrival records, :func:`record_arrival`,
vouch for those files meanwhile) until the re-read after the marker (:mod:`.verification`) records in
the same place. The record names the manifest digest it
checked, so it can never be mistaken for the verification of another checkpoint under the same
ref, and the stamp (:meth:`Storage.stamp`) of every data file as it was before and after the
reading: while every stamp still holds, the record vouches for exactly the bytes now stored
(:func:`record_holds`, :func:`record_vouches`), and retention and incremental links may rely on
it instead of reading everything again.

A record that failed (``ok`` false) for the manifest committed now makes the checkpoint **known to
be bad** (:func:`known_bad`): ``RUN/latest`` skips it (:meth:`.visibility.Visibility.latest`) and
retention does not count it among the newest it keeps. A checkpoint never verified, or whose record
is about another manifest under the same name, is not known to be bad. ``ckptd ls`` and ``show`` say
which of ``verified``, ``pending`` (no record of that manifest) or ``known bad`` the same record makes
a checkpoint (:func:`status_of`).

This module reads and writes records only: it knows nothing of how a checkpoint becomes visible,
so the visibility rule can ask it (:func:`known_bad`) without a loop.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptd_schemas import CkptdError

from ..storage import Storage
from .inflight import ordered_map, requests_in_flight
from .paths import Committed, Paths, read_small

__all__ = ["CommitCheck", "LINKED", "MAX_PROBLEMS", "Stray", "VerifyRecord", "arrival_of", "file_stamps", "known_bad",
           "record_arrival", "record_commit_check", "record_holds", "record_of", "record_vouches", "stamps_of",
           "status_of"]

log = logging.getLogger("ckptd.store")

MAX_PROBLEMS = 100

#: A record of ``MAX_PROBLEMS`` problems is a few tens of KiB; a larger object there is not read by
#: :func:`known_bad` (it is not a record the service wrote).
MAX_RECORD_BYTES = 1 << 20

#: The most characters of a reason :func:`known_bad` gives.
MAX_REASON = 300

#: A visible checkpoint's status (:func:`status_of`).
VERIFIED, PENDING, KNOWN_BAD = "verified", "pending", "known bad"


class Stray(BaseModel):
    """A file stored in a committed checkpoint's directory that is no part of it (:func:`.paths.strays`):
    the checkpoint's data is intact, so a stray does not fail a verification; it is named so it is seen."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(description="where it lies, relative to the storage root")
    size: int


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
    strays: list[Stray] = Field(default_factory=list,
                                description="files in the checkpoint's directory that are no part of it (the "
                                            "first MAX_PROBLEMS): not a problem of its data, so ok stays as it is")


def file_stamps(storage: Storage, key_of: Callable[[str], str], files: list[str]) -> dict[str, str | None]:
    """Each file's storage stamp (:meth:`Storage.stamp`), by file name: a commit stamps every file before
    and after its check. Files in one folder on a store whose listing holds stamps (S3), from that
    listing (:meth:`Storage.listed_stamps`); else a request each, several at a time on a remote store
    (:mod:`.inflight`)."""
    keys = [key_of(f) for f in files]
    folder = {k.rpartition("/")[0] for k in keys}
    listed = storage.listed_stamps(folder.pop()) if len(folder) == 1 else None
    if listed is not None:
        return {f: listed.get(k) for f, k in zip(files, keys)}
    n = requests_in_flight(storage, keys[0]) if len(keys) > 1 else 1
    return dict(zip(files, ordered_map(storage.stamp, keys, n)))


def stamps_of(storage: Storage, c: Committed, files: list[str]) -> dict[str, str | None]:
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
    rec = record_of(storage, c)
    return None if rec is None or rec.ok else _why_bad(rec)


def status_of(storage: Storage, c: Committed) -> tuple[str, str | None]:
    """What ``ckptd ls`` and ``ckptd show`` say of the visible checkpoint ``c``, from the same record
    :func:`known_bad` reads: ``known bad`` with its reason, ``verified`` (a record of the manifest
    committed now found it good), or ``pending`` (no verification of that manifest recorded yet)."""
    rec = record_of(storage, c)
    if rec is None:
        return PENDING, None
    return (VERIFIED, None) if rec.ok else (KNOWN_BAD, _why_bad(rec))


def record_of(storage: Storage, c: Committed) -> VerifyRecord | None:
    """The record about the manifest of ``c`` (a checkpoint the caller's visibility check found), read
    only where it can be one (:func:`known_bad` says which)."""
    raw, _ = read_small(storage, Paths.verification(c.run, c.name), MAX_RECORD_BYTES)
    try:
        rec = VerifyRecord.model_validate_json(raw) if raw is not None else None
    except ValidationError:  # not a record the service wrote
        return None
    return rec if rec is not None and rec.manifest_xxh3 == c.digest else None


def _why_bad(rec: VerifyRecord) -> str:
    when = rec.verified_at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    first = rec.problems[0] if rec.problems else "no problem named"
    reason = f"verification failed at {when}: {first}"
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."


#: The ``rows`` of an arrival record of a linked file: its bytes are a checked file's (``Storage.link``).
LINKED = "linked"


def record_arrival(storage: Storage, key: str, stamp: str | None, rows: str = "") -> bool:
    """Record at ``key`` (``Paths.arrival``) that a session's file of stored identity ``stamp`` was checked:
    as it arrived, against the rows of digest ``rows`` (``ckptd_schemas.arrival.rows_digest``), linked
    from a checked file (:data:`LINKED`), or (``rows`` empty) read back by a commit that re-reads the
    rest after its marker. ``{"rows", "stamp"}``,
    created once; without a stamp (a backend that has none) nothing: the commit reads the file. True
    when this call created the record."""
    return bool(stamp) and storage.create_if_absent(key, json.dumps({"rows": rows, "stamp": stamp}).encode())


def arrival_of(storage: Storage, run: str, name: str, sid: str, file: str) -> tuple[str, str] | None:
    """The arrival record of ``file`` (rows digest, stamp), or None where there is none (or not one)."""
    try:
        raw = storage.read_json_or_none(Paths.arrival(run, name, sid, file))
    except ValueError:
        return None
    if isinstance(raw, dict) and isinstance(raw.get("rows"), str) and isinstance(raw.get("stamp"), str):
        return raw["rows"], raw["stamp"]
    return None


def record_vouches(storage: Storage, c: Committed, file: str, key: str) -> str | None:
    """The stamp ``file`` of checkpoint ``c`` (stored at ``key``) had when it was last checked, when it
    still has it (inode, size, mtime and ctime locally: no writer sets ctime back; ETag and size on
    S3): its recorded verification's, when that found it good, or, before one (pending), its arrival
    record's (the commit of ``c`` succeeded, so those bytes hold what its manifest says); else None.
    A file worth linking into a new save, whose commit then rests on this check (``Storage.link``
    links that object or nothing)."""
    rec = record_of(storage, c)
    if rec is not None and not rec.ok:
        return None
    want = rec.stamps.get(file) if rec is not None else None
    if not want:
        arrived = arrival_of(storage, c.run, c.name, c.session, file)
        want = arrived[1] if arrived is not None else None
    return want if want and storage.stamp(key) == want else None


def record_holds(storage: Storage, c: Committed, rec: VerifyRecord | None, files: list[str]) -> bool:
    """True when ``rec`` found checkpoint ``c`` good and vouches for exactly the bytes stored now: the
    same manifest digest, and every data file's stamp unchanged since it was read."""
    if rec is None or not rec.ok or rec.manifest_xxh3 != c.digest or sorted(rec.stamps) != sorted(files):
        return False
    return stamps_of(storage, c, files) == rec.stamps
