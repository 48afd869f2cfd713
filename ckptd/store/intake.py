"""The ingest seam: how a data file of an upload session comes in, each way ending in one record.

A file comes in one of two ways, and either way it ends as a write-once object at its key in the
session with a digest record created once (:func:`record_file`):

* **received**: the bytes stream through this process (:meth:`Intake.receive` -> :class:`FileSink`),
  hashed as they are written; a digest mismatch is refused and the partial file dropped. With the
  writer's declaration of the file's chunks (:mod:`ckptd_schemas.arrival`), the one checker runs over
  the bytes as they pass (:func:`~.checker.arrival_check`): a problem is refused the same way, and the
  rows it covered are recorded with the file's stored identity (:func:`record_arrival`), for the
  commit to confirm instead of reading the file again.
* **placed** (:meth:`Intake.place`): the object is already in the store, and the declared record is
  taken for it: a rank PUT it straight into an object store through presigned URLs that create it
  once (:meth:`Intake.presign`, then its confirmation), or an incremental save links a file of an
  earlier visible checkpoint of the run.

Before a file's bytes are stored, whichever way, the root's space is asked (:class:`~.space.Space`:
the writer's quota, the root's reserve): received bytes batch by batch, a presigned file's declared
size at its presign, a linked file's size at its link.

A record is a claim whichever way the file came: the commit reads and checks every byte of it
(:mod:`.checker`) after the last write anyone could make, except a file checked as it arrived, or
linked as a checked file, whose stored identity (``Storage.stamp``: inode, size, mtime and ctime; an
object's ETag) is unchanged. Call order per file: each way first passes the one write gate
(:meth:`~.session_reads.Gate.writable`: the names, and that the session takes writes), and one that
succeeded marks the session active (:class:`~.activity.SessionActivity`).
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

from ckptd_schemas import (
    ChecksumMismatch, Conflict, ConfirmUpload, FileEntry, InvalidRequest, LinkFile, PresignedUpload, PresignUpload,
    StorageError, UploadResult, check_file, check_name, linked_name,
)
from ckptd_schemas.arrival import Declared, rows_digest
from ckptd_schemas.filedigest import StreamDigest

from ..storage import Storage, Writer
from .activity import SessionActivity
from .checker import FileCheck, arrival_check
from .index_cache import IndexCache, Records
from .paths import Paths
from .records import LINKED, record_arrival, record_vouches
from .session_reads import Gate
from .space import Holder, Space
from .visibility import Visibility

__all__ = ["FileSink", "Intake", "check_link", "record_file", "recorded_file", "stored_digest"]


class FileSink:
    """One data file being received: hashed while it is written to a temp object that only this
    process holds, created at its key once (never replacing anything), recorded only if the digest
    matches. A second upload of a file already stored answers as the first did when its bytes are the
    same, and is refused when they differ: a stored file of a session is never written again."""

    def __init__(self, storage: Storage, key: str, digest_key: str, file: str, block_size: int,
                 on_stored: Callable[[Records | None], None] = lambda made: None,
                 charge: Callable[[int], None] = lambda n: None,
                 declared: Sequence[Declared] | None = None, arrival_key: str = "") -> None:
        self._storage = storage
        self._on_stored = on_stored
        self._charge = charge  # asked before each batch is written: the writer's quota, the root's reserve
        self.key, self._digest_key = key, digest_key  # where it is stored
        self.file = file
        self._digest = StreamDigest(block_size)
        self._writer: Writer = storage.open_write(key, once=True)
        self._done = False
        # ``declared``: the writer's declaration of the file's chunks, each checked as it passes; what the
        # check covered (rows_digest of offset, length, xxh3, codec, raw length) recorded at ``arrival_key``
        self._check: FileCheck | None = arrival_check(file, declared) if declared is not None else None
        self._rows = rows_digest(d[:5] for d in declared) if declared is not None else ""
        self._arrival_key = arrival_key

    @property
    def size(self) -> int:
        return self._digest.size

    @property
    def done(self) -> bool:
        """Finished (stored or refused) or aborted: no longer receiving."""
        return self._done

    def write(self, data: bytes | memoryview) -> None:
        self.write_parts([data])

    def write_parts(self, parts: list[bytes | memoryview]) -> None:
        """Several pieces in one call (one ``writev`` on local disks): no copy into a batch buffer."""
        self._charge(sum(map(len, parts)))
        for p in parts:
            self._digest.update(p)
            if self._check is not None:
                self._check.feed(p)
        self._writer.write_parts(parts)

    def finish(self, declared_xxh3: str | None = None) -> UploadResult:
        digest, blocks = self._digest.finish()
        if declared_xxh3 is not None and declared_xxh3.lower() != digest:
            self.abort()
            raise ChecksumMismatch(
                f"file {self.file!r}: received {self._digest.size} bytes with XXH3 {digest}, "
                f"client declared {declared_xxh3}; the partial file was dropped",
                file=self.file, declared=declared_xxh3, actual=digest, size=self._digest.size)
        problems = self._check.finish() if self._check is not None else []
        if problems:
            self.abort()
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise problems[0].exception("refused on arrival: ", f"; the partial file was dropped{more}")
        created = self._writer.commit()
        self._done = True
        entry = FileEntry(size=self._digest.size, xxh3=digest, block_size=self._digest.block_size, blocks=blocks)
        if not created and stored_digest(self._storage, self.key, entry.block_size) != (entry.size, digest, blocks):
            raise Conflict(f"file {self.file!r} is already stored in this session with other bytes; a stored "
                           f"file is never replaced (save again with a new session)", file=self.file)
        record_file(self._storage, self._digest_key, self.file, entry)
        made: Records | None = (entry, None) if created else None  # the records as the store holds them
        if self._check is not None and created:  # its identity right after it was stored, what was checked
            # (only where these bytes made the file: a repeat's digests match the stored ones, which a
            # writer able to forge XXH3 collisions could make of other bytes: the commit reads those)
            stamp = self._storage.stamp(self.key)
            if record_arrival(self._storage, self._arrival_key, stamp, self._rows):
                made = (entry, (self._rows, str(stamp)))
            elif stamp:
                made = None  # a record was there before this one: what it says is the store's to tell
        self._on_stored(made)
        return UploadResult(file=self.file, size=entry.size, xxh3=digest)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._writer.abort()


def stored_digest(storage: Storage, key: str, block_size: int) -> tuple[int, str, list[str]]:
    """(size, XXH3, block digests) of the object stored at ``key``, read and hashed here."""
    digest = StreamDigest(block_size)
    size = storage.size(key) or 0
    for start in range(0, size, 16 << 20):
        digest.update(storage.read(key, start, min(size, start + (16 << 20))))
    whole, blocks = digest.finish()
    return digest.size, whole, blocks


def record_file(storage: Storage, key: str, file: str, entry: FileEntry) -> None:
    """Create the digest record of a session's file once; a repeat with the same record is idempotent,
    one with another is refused (``Conflict``): a file's record, like its bytes, is never replaced."""
    raw = entry.model_dump_json().encode()
    if storage.create_if_absent(key, raw):
        return
    stored = storage.read_json_or_none(key)
    if stored is None or FileEntry.model_validate(stored) != entry:
        raise Conflict(f"file {file!r} is already recorded in this session with other digests; a stored file is "
                       f"never replaced (save again with a new session)", file=file)


def recorded_file(storage: Storage, run: str, name: str, sid: str, file: str) -> FileEntry | None:
    """The digest record of ``file`` of session ``sid``, or None where it came in no way (yet)."""
    data = storage.read_json_or_none(Paths.digest(run, name, sid, file))
    return FileEntry.model_validate(data) if data is not None else None


def check_link(name: str, file: str, body: LinkFile) -> None:
    """What a link request says of itself: ``file`` is the ``linked_name`` of the source, and the
    source is another checkpoint."""
    check_name(body.checkpoint), check_file(body.file)
    if file != linked_name(body.checkpoint, body.file):
        raise InvalidRequest(f"file {file!r}: a link of {body.checkpoint}/{body.file} is named "
                             f"{linked_name(body.checkpoint, body.file)!r}", file=file)
    if body.checkpoint == name:
        raise InvalidRequest(f"file {file!r}: a checkpoint cannot link its own files", file=file)


class Intake:
    """The ways a data file comes into a session of one store (module docstring), each behind the
    one write gate."""

    def __init__(self, storage: Storage, visibility: Visibility, activity: SessionActivity,
                 block_size: int, kept: IndexCache, space: Space | None = None) -> None:
        self.storage, self.visibility, self.activity, self.block_size = storage, visibility, activity, block_size
        self.gate = Gate(storage, visibility)  # the store's one write gate
        self.space = space or Space(storage)
        self.kept = kept  # the records each received file made, for its rank's index (the session store's)
        self._receiving: weakref.WeakSet[FileSink] = weakref.WeakSet()  # files being received here

    # -- received: the bytes stream through here ----------------------------------------
    def receive(self, run: str, name: str, sid: str, file: str, holder: Holder | None = None,
                declared: Sequence[Declared] | None = None) -> FileSink:
        """A sink for ``file``'s bytes, each batch charged to ``holder`` on the root, checked as they
        pass against ``declared`` (the writer's declaration of its chunks) when given; stored, it is
        recorded (its records kept here for the rank's index) and the session marked active."""
        incarnation = self.gate.writable(run, name, sid, file).created_at.isoformat()
        digest_key = Paths.digest(run, name, sid, file)

        def stored(made: Records | None) -> None:
            if made is not None:
                self.kept.put_records(digest_key, incarnation, made)
            self.activity.touch(run, name, sid)

        sink = FileSink(self.storage, Paths.file(run, name, sid, file), digest_key, file, self.block_size,
                        on_stored=stored, charge=lambda n: self.space.charge(holder, run, file, n, on_root=True),
                        declared=declared, arrival_key=Paths.arrival(run, name, sid, file))
        self._receiving.add(sink)  # as long as its request holds it
        return sink

    def receiving(self, run: str, name: str, sid: str) -> tuple[int, int]:
        """The files of session ``sid`` this process is receiving now, and their bytes so far."""
        key = Paths.session(run, name, sid) + "/"
        sinks = [x for x in list(self._receiving) if not x.done and x.key.startswith(key)]
        return len(sinks), sum(x.size for x in sinks)

    # -- placed: the object is already stored ---------------------------------------------
    def place(self, run: str, name: str, sid: str, file: str, body: ConfirmUpload | LinkFile,
              holder: Holder | None = None) -> UploadResult:
        """Take the object already stored at ``file``'s key, or linked there, as the session's ``file``:
        ``body`` confirms a presigned upload (:meth:`_confirmed`) or links a file of an earlier checkpoint
        (:meth:`_linked`, charged to ``holder``); its digest record is created once, the session marked
        active."""
        self.gate.writable(run, name, sid, file)
        entry = (self._linked(run, name, sid, file, body, holder) if isinstance(body, LinkFile)
                 else self._confirmed(run, name, sid, file, body))
        record_file(self.storage, Paths.digest(run, name, sid, file), file, entry)
        self.activity.touch(run, name, sid)
        return UploadResult(file=file, size=entry.size, xxh3=entry.xxh3)

    def presign(self, run: str, name: str, sid: str, file: str, body: PresignUpload,
                seconds: float, holder: Holder | None = None) -> PresignedUpload:
        """Presigned URLs for the client to PUT ``file`` of the session straight into the object store,
        part by part (each of the length and SHA-256 ``body`` gives). A file is presigned once: the
        claim (``body``) is created at :meth:`Paths.presign_claim` first, and a second presign of the
        file is refused (``Conflict``), as is a presign of a file already stored. The URLs create the
        object only while it is absent (``If-None-Match: *``, :meth:`Storage.presign_put`), so nothing
        they allow can replace it once it exists. The declared size is charged to ``holder`` first
        (an object store: its quota, no reserve). Refused (``InvalidRequest``, which the client answers
        by sending the bytes here) where the store takes no presigned uploads."""
        self.gate.writable(run, name, sid, file)
        none = InvalidRequest(f"file {file!r}: this store ({self.storage.url}) takes no presigned uploads; "
                              f"upload the file", file=file)
        if not self.storage.presigns:
            raise none
        key = Paths.file(run, name, sid, file)
        self.space.charge(holder, run, file, body.size, on_root=False)
        if self.storage.exists(key) or not self.storage.create_if_absent(
                Paths.presign_claim(run, name, sid, file), body.model_dump_json().encode()):
            raise Conflict(f"file {file!r} of session {sid} was already presigned or stored; a file is presigned "
                           f"once (send it through the service, or save again with a new session)", file=file)
        signed = self.storage.presign_put(key, body.size, body.part_size, body.sha256, seconds)
        if signed is None:
            raise none
        self.activity.touch(run, name, sid)
        return PresignedUpload(upload_id=signed.upload_id, urls=signed.urls, headers=signed.headers,
                               expires_in=seconds, block_size=self.block_size)

    def _confirmed(self, run: str, name: str, sid: str, file: str, body: ConfirmUpload) -> FileEntry:
        """The record of the object a client PUT with presigned URLs as ``file`` (completing the multipart
        upload of its parts first, without replacing an object): the presign's claim must say the same
        size and SHA-256s, and the store's object must have that size (and the SHA-256 the store kept
        for a one-part upload, where it keeps one). ``body``'s digest record becomes the file's."""
        if body.block_size != self.block_size or len(body.blocks) != -(-body.size // body.block_size):
            raise InvalidRequest(f"file {file!r}: {len(body.blocks)} block digests of {body.block_size} bytes for "
                                 f"{body.size} bytes; this service's blocks are {self.block_size} bytes",
                                 file=file, field="blocks")
        claim = self.storage.read_json_or_none(Paths.presign_claim(run, name, sid, file))
        if claim is None or PresignUpload.model_validate(claim) != PresignUpload(
                size=body.size, part_size=body.part_size, sha256=body.sha256):
            raise InvalidRequest(f"file {file!r}: the confirmation does not match the file's presign (size, part "
                                 f"size and SHA-256s)", file=file)
        key = Paths.file(run, name, sid, file)
        if body.upload_id is not None:
            if len(body.etags) != len(body.sha256):
                raise InvalidRequest(f"file {file!r}: {len(body.etags)} ETags for {len(body.sha256)} parts",
                                     file=file, field="etags")
            try:
                self.storage.complete_presigned(key, body.upload_id, body.etags, body.sha256)
            except StorageError as e:
                raise InvalidRequest(f"file {file!r}: its parts could not be assembled: {e.message}",
                                     file=file) from e
        size = self.storage.size(key)
        if size is None:
            raise InvalidRequest(f"file {file!r}: nothing was uploaded at its presigned URL", file=file)
        kept = self.storage.stored_sha256(key) if body.upload_id is None else None
        if size != body.size or (kept is not None and kept != body.sha256[0]):
            what = f"{size} bytes" if size != body.size else f"SHA-256 {kept}"
            raise InvalidRequest(f"file {file!r}: the store holds {what}, the client declared {body.size} bytes "
                                 f"with SHA-256 {body.sha256[0]}", file=file)
        return FileEntry(size=body.size, xxh3=body.xxh3, block_size=body.block_size, blocks=body.blocks)

    def _linked(self, run: str, name: str, sid: str, file: str, body: LinkFile, holder: Holder | None) -> FileEntry:
        """The record of ``body.file`` of the visible checkpoint ``run/body.checkpoint`` linked as ``file``
        (:func:`check_link`; a hard link, or a copy inside the store, creating the key once): the source
        manifest's record, marked ``linked``. Only the object its checkpoint's record vouches for is
        linked (``Storage.link`` with its stamp), and the link's stamp recorded
        (:data:`~.records.LINKED`) for the commit to confirm. Refused (``InvalidRequest``: the saver sends
        the bytes, so a damaged earlier file costs one upload, never a refused save) when the source is
        not visible, holds no such file, moved since its last verification or cannot be linked. The
        file's size is charged to ``holder`` (its quota; no reserve: a local link takes no space)."""
        check_link(name, file, body)
        source = self.visibility.check(run, body.checkpoint)
        entry = self.visibility.manifest(source).files.get(body.file) if source is not None else None
        if source is None or entry is None:
            raise InvalidRequest(f"file {file!r}: {run}/{body.checkpoint} is not a visible checkpoint holding "
                                 f"{body.file!r}; send the bytes", file=file, source=f"{run}/{body.checkpoint}")
        key, src_key = Paths.file(run, name, sid, file), Paths.file(run, body.checkpoint, source.session, body.file)
        self.space.charge(holder, run, file, entry.size, on_root=False)
        checked = record_vouches(self.storage, source, body.file, src_key)
        if checked is None:
            raise InvalidRequest(f"file {file!r}: {run}/{body.checkpoint}/{body.file} is not as its last verification "
                                 f"found it (changed since, or never verified here); send the bytes", file=file)
        if not self.storage.link(src_key, key, checked):
            raise InvalidRequest(f"file {file!r}: this store ({self.storage.url}) cannot link "
                                 f"{run}/{body.checkpoint}/{body.file} as it was checked; send the bytes", file=file)
        if self.storage.size(key) != entry.size:
            raise InvalidRequest(f"file {file!r}: the stored {run}/{body.checkpoint}/{body.file} is not the "
                                 f"{entry.size} bytes its manifest records; send the bytes", file=file)
        # the commit confirms this identity and the manifest's rows against the source's, instead of reading
        record_arrival(self.storage, Paths.arrival(run, name, sid, file), self.storage.stamp(key), LINKED)
        return FileEntry(size=entry.size, xxh3=entry.xxh3, block_size=entry.block_size, blocks=entry.blocks,
                         linked=f"{body.checkpoint}/{body.file}")
