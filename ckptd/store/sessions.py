"""Write side of the store: upload sessions and the commit (docs/design.md §2).

Call order for one save attempt (each step idempotent, any replica may serve it):

1. :meth:`SessionStore.open` - every rank, same session id: open-or-join.
2. One ingest contract, three ways in, each ending as a write-once object of the session whose
   digest record is created once (:func:`record_file`): :meth:`SessionStore.begin_file` ->
   :class:`FileSink` (the bytes stream through here, hashed as they are written; a digest
   mismatch is refused and the partial file dropped); :meth:`SessionStore.presign_file` then
   :meth:`SessionStore.confirm_file` (a rank PUTs the file straight into an object store, through
   URLs that create the object once); :meth:`SessionStore.link_file` (incremental saves: a file of
   an earlier visible checkpoint of the run, linked). Whichever way a file came, the commit reads
   and checks every byte of it (:mod:`.checker`) after the last write anyone could make.
3. :meth:`SessionStore.put_index` - per rank, after its files: stores the
   rank's chunk index; the call that completes the set commits.
4. :meth:`SessionStore.commit` - merge + validate -> manifest (durable) ->
   ``COMMITTED`` created once, then the commit's check recorded as the checkpoint's first
   verification (:func:`~.records.record_commit_check`). Re-entrant: a crash anywhere before the marker
   leaves the session invisible, and the rank's retried ``put_index`` or the
   sweep (:meth:`SessionStore.sweep`) finishes the job. The callbacks in
   ``on_commit`` (the service's verify-after-commit, retention, metrics) run
   after every commit that created a marker, whichever path committed.

:meth:`SessionStore.status` only reads: a status poll or a metrics scrape never
commits. Whether a ref is committed, and by which session, is asked of
:class:`~.visibility.Visibility`, the one reader of markers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import weakref
from datetime import datetime, timezone
from typing import Callable, Sequence

from pydantic import ValidationError

from ckptd_schemas import (
    AlreadyCommitted, ChecksumMismatch, CkptdError, CommitFailed, Conflict, FileEntry,
    ConfirmUpload, InvalidIndex, InvalidRequest, LinkFile, Manifest, OpenSession, PresignedUpload, PresignUpload,
    RankIndex, SessionConflict, SessionInfo, SessionNotFound, SessionStatus, StorageError, UploadResult, check_file,
    check_name, check_new_name, check_run, check_session, linked_name, parse_ref,
)

from ..storage import Storage, Writer
from .gcpause import gc_paused
from ckptd_schemas.filedigest import BLOCK_SIZE, StreamDigest, xxh3_hex
from ckptd_schemas.loadtree import load_tree_root
from .activity import DEAD_SESSION_AFTER, KEEPALIVE_PER_WINDOW, Reclaim, SessionActivity, reclaim_at
from .events import CommitEvent, SessionEvents
from .index_cache import IndexCache
from .inflight import ordered_map, requests_in_flight
from .paths import Marker, Paths, SessionMeta
from .checker import check_commit
from .records import CommitCheck as _CommitCheck, file_stamps, record_commit_check, record_vouches
from .merge import ManifestFold
from .reuse import check_reuse
from .visibility import BadMarker, Visibility, manifest_file_name

__all__ = ["FileSink", "SessionStore"]

log = logging.getLogger("ckptd.store")


def _now() -> datetime:
    return datetime.now(timezone.utc)


class FileSink:
    """One data file being received: hashed while it is written to a temp object that only this
    process holds, created at its key once (never replacing anything), recorded only if the digest
    matches. A second upload of a file already stored answers as the first did when its bytes are the
    same, and is refused when they differ: a stored file of a session is never written again."""

    def __init__(self, storage: Storage, key: str, digest_key: str, file: str, block_size: int,
                 on_stored: Callable[[], None] = lambda: None) -> None:
        self._storage = storage
        self._on_stored = on_stored
        self._key, self._digest_key = key, digest_key
        self.file = file
        self._digest = StreamDigest(block_size)
        self._writer: Writer = storage.open_write(key, once=True)
        self._done = False

    @property
    def size(self) -> int:
        return self._digest.size

    @property
    def done(self) -> bool:
        """Finished (stored or refused) or aborted: no longer receiving."""
        return self._done

    def write(self, data: bytes | memoryview) -> None:
        self._digest.update(data)
        self._writer.write(data)

    def write_parts(self, parts: list[bytes]) -> None:
        """Several pieces in one call (one ``writev`` on local disks): no copy into a batch buffer."""
        for p in parts:
            self._digest.update(p)
        self._writer.write_parts(parts)

    def finish(self, declared_xxh3: str | None) -> UploadResult:
        digest, blocks = self._digest.finish()
        if declared_xxh3 is not None and declared_xxh3.lower() != digest:
            self.abort()
            raise ChecksumMismatch(
                f"file {self.file!r}: received {self._digest.size} bytes with XXH3 {digest}, "
                f"client declared {declared_xxh3}; the partial file was dropped",
                file=self.file, declared=declared_xxh3, actual=digest, size=self._digest.size)
        created = self._writer.commit()
        self._done = True
        entry = FileEntry(size=self._digest.size, xxh3=digest, block_size=self._digest.block_size, blocks=blocks)
        if not created and stored_digest(self._storage, self._key, entry.block_size) != (entry.size, digest, blocks):
            raise Conflict(f"file {self.file!r} is already stored in this session with other bytes; a stored "
                           f"file is never replaced (save again with a new session)", file=self.file)
        record_file(self._storage, self._digest_key, self.file, entry)
        self._on_stored()
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


class SessionStore:
    """Upload sessions and commits over one :class:`Storage`."""

    def __init__(self, storage: Storage, *, block_size: int = BLOCK_SIZE, visibility: Visibility | None = None,
                 on_commit: Sequence[Callable[[CommitEvent], None]] = (),
                 dead_after: float = DEAD_SESSION_AFTER, events: SessionEvents | None = None) -> None:
        self.storage = storage
        self.dead_after = dead_after  # seconds without a live writer before the sweep reclaims a session
        self.activity = SessionActivity(self.storage, every=dead_after / KEEPALIVE_PER_WINDOW / 2)
        self.block_size = block_size
        self.visibility = visibility or Visibility(self.storage)
        self.on_commit = list(on_commit)
        self.events = events or SessionEvents()  # the service's metrics observe the write side here
        self._orphans_seen: set[str] = set()
        self._temps_reclaimed: set[str] = set()  # committed sessions the sweep cleared of temp files
        self._settled: dict[str, str] = {}  # run/name -> the marker's session, nothing else left to sweep
        self._indexes = IndexCache()
        self._receiving: dict[str, weakref.WeakSet[FileSink]] = {}  # session -> files being received here

    # -- helpers ---------------------------------------------------------------
    def _tell(self, hook: str, *args: object) -> None:
        """Call an observer's hook (:mod:`.events`); what it raises is logged, never raised into the save."""
        try:
            getattr(self.events, hook)(*args)
        except Exception:  # noqa: BLE001 - observing must not change the outcome
            log.exception("session event %s: the observer failed", hook)

    def _taken(self, run: str, name: str) -> Marker | BadMarker | None:
        """The ref's marker as the write side sees it: any marker, parsed or not, takes the ref."""
        return self.visibility.marker(run, name)

    def _committed_by(self, run: str, name: str, sid: str, m: Marker | BadMarker | None = None) -> Marker | None:
        """The marker, when ``run/name`` is visible and was committed by session ``sid`` (``m``: the
        marker as already read)."""
        m = self._taken(run, name) if m is None else m
        if not isinstance(m, Marker) or m.session != sid:
            return None
        c = self.visibility.check_marker(run, name, m)
        return c.marker if c is not None else None

    @staticmethod
    def _taken_error(run: str, name: str, m: Marker | BadMarker) -> Conflict:
        if isinstance(m, BadMarker):
            return Conflict(f"{run}/{name} has a COMMITTED marker that does not parse ({m.reason}); the checkpoint "
                            f"is invisible and its name cannot be reused (save under a new name)", ref=f"{run}/{name}")
        return AlreadyCommitted(
            f"checkpoint {run}/{name} is already committed (session {m.session}); committed checkpoints "
            f"are immutable (save under a new name)", ref=f"{run}/{name}", session=m.session)

    def _meta(self, run: str, name: str, sid: str) -> SessionMeta:
        data = self.storage.read_json_or_none(Paths.session_meta(run, name, sid))
        if data is None:
            raise SessionNotFound(f"no upload session {sid!r} for {run}/{name} (aborted, reclaimed or never opened)",
                                  ref=f"{run}/{name}", session=sid)
        return SessionMeta.model_validate(data)

    def _check_writable(self, run: str, name: str, sid: str) -> SessionMeta:
        meta = self._meta(run, name, sid)
        m = self._taken(run, name)
        if m is not None:
            raise self._taken_error(run, name, m)
        failed = self.storage.read_json_or_none(Paths.failed(run, name, sid))
        if failed is not None:
            raise SessionConflict(
                f"session {sid} of {run}/{name} was refused at commit ({failed['error']['message']}); "
                f"save again with a new session", ref=f"{run}/{name}", session=sid)
        return meta

    def keep_alive(self, run: str, name: str, sid: str) -> None:
        """A rank that joined the session says it is alive (between its writes, while one long write
        streams, while it waits for the others): the sweep keeps the session while a rank is
        (:mod:`.activity`). Every writer request that succeeds counts too; a refused one writes
        nothing, not even this record."""
        check_run(run), check_name(name), check_session(sid)
        if self.activity.fresh(run, name, sid):
            return  # recorded moments ago by this process: a thousand ranks' keep-alives cost no request to the store
        self._check_writable(run, name, sid)
        self.activity.touch(run, name, sid)

    # -- 1. open ---------------------------------------------------------------
    def open(self, run: str, name: str, req: OpenSession) -> SessionInfo:
        check_run(run), check_new_name(name), check_session(req.session)
        m = self._taken(run, name)
        if m is not None:
            raise self._taken_error(run, name, m)
        if req.derived_from is not None:
            parse_ref(req.derived_from)
        key = Paths.session_meta(run, name, req.session)
        meta = self._meta_or_none(run, name, req.session)
        if meta is None:
            self._check_parent(run, req.parent)
            meta = SessionMeta(session=req.session, world_size=req.world_size, step=req.step, created_at=_now(),
                               derived_from=req.derived_from, parent=req.parent)
            if not self.storage.create_if_absent(key, meta.model_dump_json().encode()):
                meta = self._meta(run, name, req.session)
        if (meta.world_size, meta.step, meta.derived_from, meta.parent) != \
                (req.world_size, req.step, req.derived_from, req.parent):
            raise SessionConflict(
                f"session {req.session} of {run}/{name} was opened with world size {meta.world_size}, step "
                f"{meta.step} and parent {meta.parent}; this request says world size {req.world_size}, step "
                f"{req.step} and parent {req.parent}", ref=f"{run}/{name}", session=req.session)
        self._tell("opened", run, name, meta.session)
        return SessionInfo(run=run, name=name, session=meta.session, world_size=meta.world_size,
                           step=meta.step, created_at=meta.created_at,
                           keepalive_seconds=self.dead_after / KEEPALIVE_PER_WINDOW)

    def _check_parent(self, run: str, parent: str | None) -> None:
        """A parent names a checkpoint of another run, by name (not ``latest``: lineage records what was
        loaded, which ``LoadReport.ref`` gives), visible when the session opens."""
        if parent is None:
            return
        ref = parse_ref(parent)
        if ref.is_latest:
            raise InvalidRequest(f"parent {parent!r}: name the checkpoint the run started from (LoadReport.ref "
                                 f"gives the name a load of RUN/latest resolved to)", field="parent")
        if ref.run == run:
            raise InvalidRequest(f"parent {parent!r} is a checkpoint of run {run} itself: a parent is a checkpoint "
                                 f"of another run (the run's own history is its steps)", field="parent")
        if self.visibility.check(ref.run, ref.name) is None:
            raise InvalidRequest(f"parent {parent!r} is not a visible checkpoint", field="parent", ref=parent)

    # -- 2. data files ---------------------------------------------------------------
    def begin_file(self, run: str, name: str, sid: str, file: str) -> FileSink:
        check_run(run), check_name(name), check_session(sid), check_file(file)
        self._check_writable(run, name, sid)
        sink = FileSink(self.storage, Paths.file(run, name, sid, file), Paths.digest(run, name, sid, file),
                        file, self.block_size, on_stored=lambda: self.activity.touch(run, name, sid))
        key = Paths.session(run, name, sid)
        if len(self._receiving) > 256:  # sessions whose sinks are all gone (a sink lives as long as its request)
            for k in [k for k, v in self._receiving.items() if not len(v)]:
                del self._receiving[k]
        self._receiving.setdefault(key, weakref.WeakSet()).add(sink)
        return sink

    def receiving(self, run: str, name: str, sid: str) -> tuple[int, int]:
        """The files of session ``sid`` this process is receiving now, and their bytes so far (the web
        view: a writer streaming a large file is active although its last recorded activity is older)."""
        sinks = [x for x in self._receiving.get(Paths.session(run, name, sid), ()) if not x.done]
        return len(sinks), sum(x.size for x in sinks)

    def presign_file(self, run: str, name: str, sid: str, file: str, body: PresignUpload,
                     seconds: float) -> PresignedUpload:
        """Presigned URLs for the client to PUT ``file`` of the session straight into the object store,
        part by part (each of the length and SHA-256 ``body`` gives). A file is presigned once: the
        claim (``body``) is created at :meth:`Paths.presign_claim` first, and a second presign of the
        file is refused (``Conflict``), as is a presign of a file already stored. The URLs create the
        object only while it is absent (``If-None-Match: *``, :meth:`Storage.presign_put`), so nothing
        they allow can replace it once it exists. Refused (``InvalidRequest``, which the client answers
        by sending the bytes here) where the store takes no presigned uploads."""
        check_run(run), check_name(name), check_session(sid), check_file(file)
        self._check_writable(run, name, sid)
        if not self.storage.presigns:
            raise InvalidRequest(f"file {file!r}: this store ({self.storage.url}) takes no presigned uploads; "
                                 f"upload the file", file=file)
        key = Paths.file(run, name, sid, file)
        if self.storage.exists(key) or not self.storage.create_if_absent(
                Paths.presign_claim(run, name, sid, file), body.model_dump_json().encode()):
            raise Conflict(f"file {file!r} of session {sid} was already presigned or stored; a file is presigned "
                           f"once (send it through the service, or save again with a new session)", file=file)
        signed = self.storage.presign_put(key, body.size, body.part_size, body.sha256, seconds)
        if signed is None:
            raise InvalidRequest(f"file {file!r}: this store ({self.storage.url}) takes no presigned uploads; "
                                 f"upload the file", file=file)
        self.activity.touch(run, name, sid)
        return PresignedUpload(upload_id=signed.upload_id, urls=signed.urls, headers=signed.headers,
                               expires_in=seconds, block_size=self.block_size)

    def confirm_file(self, run: str, name: str, sid: str, file: str, body: ConfirmUpload) -> UploadResult:
        """Take the object a client PUT with presigned URLs as the upload of ``file`` (completing the
        multipart upload of its parts first, without replacing an object): the presign's claim must say
        the same size and SHA-256s, and the store's object must have that size (and the SHA-256 the
        store kept for a one-part upload, where it keeps one). ``body``'s digest record is recorded as
        the file's, once; it is a claim until the commit reads every byte of the file and checks it
        (:mod:`.checker`), so nothing unchecked is visible."""
        check_run(run), check_name(name), check_session(sid), check_file(file)
        self._check_writable(run, name, sid)
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
        entry = FileEntry(size=body.size, xxh3=body.xxh3, block_size=body.block_size, blocks=body.blocks)
        record_file(self.storage, Paths.digest(run, name, sid, file), file, entry)
        self.activity.touch(run, name, sid)
        return UploadResult(file=file, size=entry.size, xxh3=entry.xxh3)

    def link_file(self, run: str, name: str, sid: str, file: str, body: LinkFile) -> UploadResult:
        """Hold ``body.file`` of the visible checkpoint ``run/body.checkpoint`` as the upload session's ``file``
        (``linked_name`` of the two), without its bytes passing through here: the storage links it
        (a hard link, or a copy inside the store), creating the session's key once, and the source
        manifest's record of it (size, digests) becomes the session's, marked ``linked``. Refused
        (``InvalidRequest``, which the saver answers by sending the bytes) when the source is not a
        visible checkpoint of the run holding that file, or the store cannot link. The record is a
        claim like any other: the commit reads every byte of the file and checks it
        (:mod:`.checker`), since the source may have changed since its own commit. A source file
        whose storage stamp moved since its checkpoint's last recorded verification (an edit, or a file
        never verified here) is not linked at all: the saver sends the bytes, so a damaged earlier file
        costs one file's upload, never a refused save."""
        check_run(run), check_name(name), check_session(sid), check_file(file)
        check_name(body.checkpoint), check_file(body.file)
        if file != linked_name(body.checkpoint, body.file):
            raise InvalidRequest(f"file {file!r}: a link of {body.checkpoint}/{body.file} is named "
                                 f"{linked_name(body.checkpoint, body.file)!r}", file=file)
        if body.checkpoint == name:
            raise InvalidRequest(f"file {file!r}: a checkpoint cannot link its own files", file=file)
        self._check_writable(run, name, sid)
        source = self.visibility.check(run, body.checkpoint)
        entry = self.visibility.manifest(source).files.get(body.file) if source is not None else None
        if source is None or entry is None:
            raise InvalidRequest(f"file {file!r}: {run}/{body.checkpoint} is not a visible checkpoint holding "
                                 f"{body.file!r}; send the bytes", file=file, source=f"{run}/{body.checkpoint}")
        key, src_key = Paths.file(run, name, sid, file), Paths.file(run, body.checkpoint, source.session, body.file)
        if not record_vouches(self.storage, source, body.file, src_key):
            raise InvalidRequest(f"file {file!r}: {run}/{body.checkpoint}/{body.file} is not as its last verification "
                                 f"found it (changed since, or never verified here); send the bytes", file=file)
        if not self.storage.link(src_key, key):
            raise InvalidRequest(f"file {file!r}: this store ({self.storage.url}) cannot link "
                                 f"{run}/{body.checkpoint}/{body.file}; send the bytes", file=file)
        if self.storage.size(key) != entry.size:
            raise InvalidRequest(f"file {file!r}: the stored {run}/{body.checkpoint}/{body.file} is not the "
                                 f"{entry.size} bytes its manifest records; send the bytes", file=file)
        record = FileEntry(size=entry.size, xxh3=entry.xxh3, block_size=entry.block_size, blocks=entry.blocks,
                           linked=f"{body.checkpoint}/{body.file}")
        record_file(self.storage, Paths.digest(run, name, sid, file), file, record)
        self.activity.touch(run, name, sid)
        return UploadResult(file=file, size=entry.size, xxh3=entry.xxh3)

    def _file_entry(self, run: str, name: str, sid: str, file: str) -> FileEntry | None:
        data = self.storage.read_json_or_none(Paths.digest(run, name, sid, file))
        return FileEntry.model_validate(data) if data is not None else None

    # -- 3. rank index -----------------------------------------------------------------
    def put_index(self, run: str, name: str, sid: str, index: RankIndex) -> SessionStatus:
        check_run(run), check_name(name), check_session(sid)
        answer = self._committed_with(run, name, sid, index)
        if answer is not None:
            return answer
        try:
            meta = self._check_writable(run, name, sid)
        except AlreadyCommitted:
            # Committed since the check above, by another request of this session that brought the last
            # index (ranks retrying at a restarted server or another replica race like this).
            answer = self._committed_with(run, name, sid, index)
            if answer is None:
                raise
            return answer
        if index.world_size != meta.world_size or index.rank >= meta.world_size:
            raise InvalidIndex(
                f"rank {index.rank}: index says world size {index.world_size}, session {sid} has "
                f"{meta.world_size}", rank=index.rank)
        sizes: dict[str, int] = {}
        for f in index.files:
            check_file(f)
            entry = self._file_entry(run, name, sid, f)
            if entry is None:
                raise InvalidIndex(f"rank {index.rank}: file {f!r} was not uploaded (or its upload failed)",
                                   rank=index.rank, file=f)
            sizes[f] = entry.size
        try:
            index.check_chunks()
        except ValueError as e:
            raise InvalidIndex(f"rank {index.rank}: {e}", rank=index.rank) from e
        ct, names = index.chunk_table, index.tensor_table.name
        locs = [(f"tensor {names[p]!r}", f, o, n) for p, f, o, n in zip(ct.tensor or (), ct.file, ct.offset, ct.length)]
        locs += [(f"object {o.name!r}", o.location.file, o.location.offset, o.location.length)
                 for o in index.objects if o.location is not None]
        for what, file, offset, length in locs:
            if file not in sizes:
                raise InvalidIndex(f"rank {index.rank}: {what} points at file {file!r}, not among its files",
                                   rank=index.rank, file=file)
            if offset + length > sizes[file]:
                raise InvalidIndex(
                    f"rank {index.rank}: {what} bytes [{offset}, {offset + length}) exceed file "
                    f"{file!r} of {sizes[file]} bytes", rank=index.rank, file=file)
        key, raw = Paths.rank_index(run, name, sid, index.rank), index.model_dump_json().encode()
        self.storage.put(key, raw)
        self._indexes.put(key, raw, index)
        self.activity.touch(run, name, sid)  # a writer: ranks' indexes may arrive for minutes after the last file
        return self._commit_if_complete(run, name, sid, meta, index.rank)

    def _committed_with(self, run: str, name: str, sid: str, index: RankIndex) -> SessionStatus | None:
        """The committed status, when session ``sid`` is committed with exactly ``index`` for its rank.

        That is a retry of an index already part of the commit (its answer was lost, e.g. the server
        died right after creating the marker), or one that raced the commit: answer as before.
        """
        if self._committed_by(run, name, sid) is None:
            return None
        stored = self.storage.read_json_or_none(Paths.rank_index(run, name, sid, index.rank))
        if stored is None or RankIndex.model_validate(stored) != index:
            return None
        return self.status(run, name, sid)

    # -- status / commit ---------------------------------------------------------------
    def ranks_done(self, run: str, name: str, sid: str) -> list[int]:
        return sorted(int(n.split(".")[0]) for n in self.storage.list(Paths.ranks(run, name, sid))
                      if n.endswith(".json") and n.split(".")[0].isdigit())

    def status(self, run: str, name: str, sid: str, *, list_ranks: bool = True) -> SessionStatus:
        """Where the session stands. Only reads: a complete session that is not committed yet (its
        last index arrived at a process that died before the marker) is finished by the rank's
        retried index or by :meth:`sweep`, never by asking. Without ``list_ranks`` an open or failed
        session's ``ranks_done`` is left empty: a few reads whatever the world size (what a waiting
        rank needs), where listing the ranks is O(world size)."""
        check_run(run), check_name(name), check_session(sid)
        taken = self._taken(run, name)  # read once: a commit finishing meanwhile is seen on the next poll
        m = self._committed_by(run, name, sid, taken) if taken is not None else None
        if m is not None:
            meta = self._meta_or_none(run, name, sid)
            return SessionStatus(run=run, name=name, session=sid, state="committed",
                                 world_size=meta.world_size if meta else 0, ranks_done=[],
                                 manifest_xxh3=m.manifest_xxh3)
        meta = self._meta(run, name, sid)
        done = self.ranks_done(run, name, sid) if list_ranks else []
        base = dict(run=run, name=name, session=sid, world_size=meta.world_size, ranks_done=done)
        if taken is not None:
            return SessionStatus(state="failed", error=self._taken_error(run, name, taken).to_body()["error"], **base)
        failed = self.storage.read_json_or_none(Paths.failed(run, name, sid))
        if failed is not None:
            return SessionStatus(state="failed", error=failed["error"], **base)
        return SessionStatus(state="open", **base)

    def _commit_if_complete(self, run: str, name: str, sid: str, meta: SessionMeta, rank: int) -> SessionStatus:
        """After rank ``rank``'s index is stored: commit when every rank's index is there; a refusal raises.

        Listing every rank at every call costs O(ranks) each, O(ranks^2) over a session (and one
        LIST request per 1,000 keys on an object store). Instead the process remembers below which
        rank all indexes were found stored (:meth:`IndexCache.stored_below`) and probes upwards
        from there for the first missing one: each rank is found once per process, each call makes
        one failing probe. Only when the probes reach the world size does a listing decide, as
        before, so any replica's call that stores the last index, a retried index or the sweep
        commits, and a stale hint (a session aborted and opened again) costs a listing, never a
        commit. The answer's ``ranks_done`` is what this call found: the ranks below the first
        missing one and ``rank`` (:meth:`status` lists them all).
        """
        prefix = Paths.session(run, name, sid) + "/"
        below = self._indexes.stored_below(prefix)
        if below is not None:
            while below < meta.world_size and self.storage.exists(Paths.rank_index(run, name, sid, below)):
                below += 1
        if below is None or below == meta.world_size:
            done = self.ranks_done(run, name, sid)
            below = next((i for i, r in enumerate(done) if i != r), len(done))
        else:
            done = [*range(below), *([rank] if rank > below else [])]
        self._indexes.note_stored_below(prefix, below)
        base = dict(run=run, name=name, session=sid, world_size=meta.world_size, ranks_done=done)
        if len(done) < meta.world_size:
            return SessionStatus(state="open", **base)
        failed = self.storage.read_json_or_none(Paths.failed(run, name, sid))
        if failed is not None:
            raise CommitFailed(failed["error"]["message"], **failed["error"].get("details", {}))
        digest = self.commit(run, name, sid, meta)  # StorageError: not a verdict, the caller retries (503)
        return SessionStatus(state="committed", manifest_xxh3=digest, **base)

    def _meta_or_none(self, run: str, name: str, sid: str) -> SessionMeta | None:
        try:
            return self._meta(run, name, sid)
        except SessionNotFound:
            return None

    def commit(self, run: str, name: str, sid: str, meta: SessionMeta | None = None) -> str:
        """Merge, validate, write the manifest, create the marker; return the manifest digest. When this
        call created the marker, run the ``on_commit`` callbacks (a failing callback is logged: the
        checkpoint is committed whatever they do)."""
        meta = meta or self._meta(run, name, sid)
        t0 = time.perf_counter()
        try:
            digest, event = self._commit(run, name, sid, meta)
        finally:
            self._indexes.drop_under(Paths.session(run, name, sid) + "/")
            self.activity.forget(run, name, sid)  # a keep-alive from now on is answered from the store: 409
        if event is not None:
            self._tell("committed", event, time.perf_counter() - t0)
            for callback in self.on_commit:
                try:
                    callback(event)
                except Exception:  # noqa: BLE001 - after the marker nothing may undo the commit
                    log.exception("after-commit action %r for %s/%s failed", callback, run, name)
        return digest

    def _read_index(self, key: str) -> RankIndex:
        """The stored index, parsed (or as ``put_index`` parsed it, taken out of the cache)."""
        raw = self.storage.read(key)
        return self._indexes.take(key, raw) or RankIndex.model_validate_json(raw)

    def _merged(self, run: str, name: str, sid: str, meta: SessionMeta) -> tuple[Manifest, dict[str, FileEntry]]:
        """The merged manifest and the digest records of its files. Indexes are read, folded
        (:class:`~.merge.ManifestFold`) and dropped rank by rank: the commit holds the manifest
        being built and a few indexes, not every index. On a remote store the next ranks' indexes
        and digest records are read while one is folded (:mod:`.inflight`)."""
        fold = ManifestFold(run=run, name=name, session=sid, step=meta.step, created_at=meta.created_at,
                            world_size=meta.world_size, derived_from=meta.derived_from, parent=meta.parent)

        def read_rank(r: int) -> tuple[RankIndex, list[tuple[str, FileEntry | None]]]:
            ix = self._read_index(Paths.rank_index(run, name, sid, r))
            return ix, [(f, self._file_entry(run, name, sid, f)) for f in ix.files]

        files: dict[str, FileEntry] = {}
        n = requests_in_flight(self.storage, Paths.rank_index(run, name, sid, 0))
        # Closed on the way out, refusal included: the reads ahead stop and their threads end with it.
        with contextlib.closing(ordered_map(read_rank, range(meta.world_size), n)) as ranks:
            for ix, entries in ranks:
                for f, entry in entries:
                    if entry is None:
                        raise InvalidIndex(f"rank {ix.rank}: file {f!r} has no verified upload", file=f)
                    files[f] = entry
                fold.add(ix)
                del ix, entries
        return fold.manifest(files), files

    def _commit(self, run: str, name: str, sid: str, meta: SessionMeta) -> tuple[str, CommitEvent | None]:
        with gc_paused():  # 512,000 chunks allocate enough for the collector to run dozens of full passes
            try:
                manifest, files = self._merged(run, name, sid, meta)
                check_reuse(manifest)  # a linked file must be at least half used: references pay for themselves
                key_of = lambda f: Paths.file(run, name, sid, f)  # noqa: E731
                before = file_stamps(self.storage, key_of, sorted(files))
                t0 = time.perf_counter()
                nread = check_commit(manifest, self.storage, key_of)  # every byte, whichever way it entered
                check = _CommitCheck(before, file_stamps(self.storage, key_of, sorted(files)), nread,
                                     time.perf_counter() - t0, len(manifest.tensors),
                                     sum(len(t.table) for t in manifest.tensors))
            except StorageError:
                raise  # transient (or the store is down): the session stays open for a retry, not failed
            except (CkptdError, ValidationError) as e:
                err = e if isinstance(e, CkptdError) else InvalidIndex(f"{run}/{name}: {e}")
                log.warning("commit of %s/%s session %s refused: %s", run, name, sid, err.message)
                self.storage.put(Paths.failed(run, name, sid), json.dumps(err.to_body()).encode())
                self._tell("refused", run, name, sid, err)
                raise err
            raw = manifest.__pydantic_serializer__.to_json(manifest)  # model_dump_json's bytes, without a str copy
            derived_from, nfiles, nbytes = manifest.derived_from, len(manifest.files), manifest.total_bytes
            says = (manifest.run, manifest.name, manifest.session, manifest.step, manifest.derived_from,
                    manifest.parent, manifest.created_at)
            tree = load_tree_root(manifest)  # what each loading rank checks its pieces against
            # Freed here by reference counting, so the collector, back on, does not walk them first.
            del manifest, files
        digest = xxh3_hex(raw)
        mkey = Paths.manifest(run, name, sid, digest)
        if self.storage.size(mkey) != len(raw):
            self.storage.put(mkey, raw)
            # what these bytes say, known without reading them back: the first status of a commit of
            # 10,000 ranks does not parse its manifest again
            self.visibility.note_written(mkey, digest, says)
        marker = Marker(ref=f"{run}/{name}", session=sid, manifest=manifest_file_name(digest), manifest_xxh3=digest,
                        step=meta.step, derived_from=derived_from, committed_at=_now(), parent=meta.parent,
                        load_tree=tree)
        if not self.storage.create_if_absent(Paths.marker(run, name), marker.model_dump_json().encode()):
            existing = self._committed_by(run, name, sid)
            if existing is None:
                raise Conflict(f"{run}/{name} was committed by another session", ref=f"{run}/{name}")
            return existing.manifest_xxh3, None
        record_commit_check(self.storage, run, name, digest, check, nfiles)
        log.info("committed %s/%s session %s (%d files, %d bytes)", run, name, sid, nfiles, nbytes)
        return digest, CommitEvent(run=run, name=name, session=sid, manifest_xxh3=digest, derived_from=derived_from,
                                   files=nfiles, bytes=nbytes)

    # -- abort / sweep -----------------------------------------------------------------
    def abort(self, run: str, name: str, sid: str) -> None:
        check_run(run), check_name(name), check_session(sid)
        m = self._taken(run, name)
        if isinstance(m, BadMarker):
            raise Conflict(f"{run}/{name} has a COMMITTED marker that does not parse; its sessions are kept as "
                           f"they are", ref=f"{run}/{name}")
        if m is not None and m.session == sid:
            raise AlreadyCommitted(f"{run}/{name} is committed; delete it with gc, not abort", ref=f"{run}/{name}")
        self.storage.delete_tree(Paths.session(run, name, sid))
        self.activity.forget(run, name, sid)

    def reclaim_stale(self, ttl_seconds: float, *, now: float | None = None) -> list[str]:
        """The sweep: commit sessions whose every index is stored but that have no marker (the process
        that took the last index died before the marker), then delete session directories that no
        marker names and whose time is up (:func:`.activity.reclaim_at`: no live writer for
        ``dead_after`` seconds, or opened longer ago than ``ttl_seconds``). Return the reclaimed
        ``run/name/session``s.

        Under a marker that fails the visibility rule (it does not parse, or names another ref, a
        missing session or manifest), nothing is touched (the checkpoint is invisible, and its data is
        kept for whoever looks into it). One run or checkpoint that cannot be read is logged
        and skipped; the sweep goes on with the others. A checkpoint committed longer ago than the TTL
        whose only session is its own is settled: later sweeps read its marker, not its sessions.
        """
        now = time.time() if now is None else now
        removed: list[str] = []
        for run in self.visibility.runs():
            try:
                names = self.visibility.names(run)
            except CkptdError as e:
                log.warning("sweep: run %s skipped: %s", run, e.message)
                continue
            for name in names:
                try:
                    removed += self._sweep_checkpoint(run, name, ttl_seconds, now)
                except CkptdError as e:
                    log.warning("sweep: %s/%s skipped: %s", run, name, e.message)
        if removed:
            log.info("reclaimed %d stale sessions", len(removed))
            self._tell("reclaimed", removed)
        return removed

    def reclaim_of(self, run: str, name: str, sid: str, meta: SessionMeta, ttl_seconds: float) -> Reclaim:
        """When the sweep reclaims this uncommitted session, and why (the web view shows it)."""
        return reclaim_at(meta.created_at, self.activity.last(run, name, sid), ttl=ttl_seconds, idle=self.dead_after)

    def _sweep_checkpoint(self, run: str, name: str, ttl_seconds: float, now: float) -> list[str]:
        m = self._taken(run, name)
        if isinstance(m, Marker) and self._settled.get(f"{run}/{name}") == m.session:
            return []
        if isinstance(m, BadMarker) or (m is not None and self.visibility.check_marker(run, name, m) is None):
            return []  # a marker that fails the visibility rule: its checkpoint's data is kept as it is
        removed, others = [], False
        for sid in self.storage.list(Paths.sessions(run, name)):
            if m is not None and m.session == sid:
                self._reclaim_temps_once(run, name, m, ttl_seconds, now)
                continue
            others = True
            try:
                check_session(sid)
            except CkptdError:
                continue  # not a session this store made: not ours to delete
            meta = self._meta_or_none(run, name, sid)
            if m is None and meta is not None and self._recover(run, name, sid, meta):
                m = self._taken(run, name)
                continue
            if meta is not None and self.reclaim_of(run, name, sid, meta, ttl_seconds).at.timestamp() > now:
                continue
            key = f"{run}/{name}/{sid}"
            if meta is None and key not in self._orphans_seen:
                self._orphans_seen.add(key)  # maybe being opened right now: decide next sweep
                continue
            self._orphans_seen.discard(key)
            self.storage.delete_tree(Paths.session(run, name, sid))
            removed.append(key)
        if m is not None and not others and f"{run}/{name}/{m.session}" in self._temps_reclaimed:
            self._settled[f"{run}/{name}"] = m.session
        return removed

    def _reclaim_temps_once(self, run: str, name: str, m: Marker, ttl_seconds: float, now: float) -> None:
        """In a committed session, delete what writers killed mid-write left (temp files), once per
        process: a TTL after the commit every such file is older than the TTL, and none comes after
        (the session takes no more writes), so later sweeps do not walk the session again."""
        key = f"{run}/{name}/{m.session}"
        if key in self._temps_reclaimed or now - m.committed_at.timestamp() < ttl_seconds:
            return
        n = self.storage.reclaim_temps(Paths.session(run, name, m.session), now - ttl_seconds)
        self._temps_reclaimed.add(key)
        if n:
            log.info("sweep: %d unfinished writes removed from committed %s/%s", n, run, name)

    def _recover(self, run: str, name: str, sid: str, meta: SessionMeta) -> bool:
        """Commit a session whose indexes are all stored and that was not refused; True if it committed."""
        if len(self.ranks_done(run, name, sid)) < meta.world_size:
            return False
        if self.storage.read_json_or_none(Paths.failed(run, name, sid)) is not None:
            return False
        try:
            self.commit(run, name, sid, meta)
        except StorageError:
            raise
        except CkptdError as e:  # refused (recorded as FAILED), or committed by another session
            log.info("sweep: session %s of %s/%s not committed: %s", sid, run, name, e.message)
            return False
        log.info("sweep: committed %s/%s session %s, complete but left without its marker", run, name, sid)
        return True
