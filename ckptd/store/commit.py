"""The commit of an upload session: merge, check, manifest, marker (docs/design.md §2 item 4).

Call order: the session store (:mod:`.sessions`) stores a rank's index and asks
:meth:`Committer.if_complete`, which commits when every rank's index is stored; the sweep
(:mod:`.sweep`) commits a complete session left without its marker. :meth:`Committer.commit` then
merges the indexes (:class:`~.merge.ManifestFold`), checks reuse and every stored byte
(:func:`~.checker.check_commit`), writes the manifest (durable), creates ``COMMITTED`` once, and
records the commit's check as the checkpoint's first verification
(:func:`~.records.record_commit_check`) or, where bytes checked as they arrived are left to the
re-read after the marker, stores that re-read due before the marker (:func:`~.rereads.mark_due`), then deletes what writers killed mid-upload left in the
session (:meth:`Committer._drop_unfinished`). A refusal is recorded (``FAILED``) and raised; a storage
error is raised and leaves the session open for a retry. Re-entrant: a crash anywhere before the
marker leaves the session invisible, and the rank's retried index or the sweep finishes the job.
Each commit that created a marker here is told to the observers (:class:`~.events.Observers`:
metrics, verify-after-commit, retention, drills, the durable copy), whichever path committed; a
failing observer is logged and never undoes the commit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from datetime import datetime, timezone

from pydantic import ValidationError

from ckptd_schemas import (
    CkptdError, CommitFailed, Conflict, FileEntry, InvalidIndex, Manifest, SessionStatus, StorageError,
)
from ckptd_schemas.arrival import rows_digest
from ckptd_schemas.filedigest import xxh3_hex
from ckptd_schemas.loadtree import LoadTree

from ..storage import Storage
from .activity import SessionActivity
from .checker import check_commit, file_rows
from .completeness import Looks
from .events import CommitEvent, Observers
from .flights import OneAtATime
from .gcpause import gc_paused
from .index_cache import Checked, IndexCache
from .inflight import ordered_map, requests_in_flight
from .merge import ManifestFold
from .paths import Marker, Paths, SessionMeta
from .records import LINKED, CommitCheck, file_stamps, known_bad, record_arrival, record_commit_check
from .links import check_links
from .rereads import mark_due
from .rank_indexes import BatchWriter, in_window, kept_key, read_batch, stored
from .session_reads import committed_by, session_meta
from .visibility import Visibility, manifest_file_name

__all__ = ["Committer"]

log = logging.getLogger("ckptd.store")


def _gone(run: str, name: str, sid: str, rank: int) -> StorageError:
    return StorageError(f"rank {rank}'s index is no longer stored in session {sid} of {run}/{name}",
                        key=f"{Paths.ranks(run, name, sid)}/{rank:07d}")


class Committer:
    """Commits the sessions of one store (module docstring)."""

    def __init__(self, storage: Storage, visibility: Visibility, indexes: IndexCache, activity: SessionActivity,
                 observers: Observers, batches: BatchWriter, *, read_back: bool = False) -> None:
        self.storage, self.visibility, self.activity, self.observers = storage, visibility, activity, observers
        self._batches = batches  # the session store's writer of rank indexes (:mod:`.rank_indexes`)
        self.read_back = read_back  # read every byte before the marker, even those checked as they arrived
        # One commit of a session at a time here: the ranks' last indexes arrive together, each finding
        # every index stored, and each would merge and check the whole checkpoint.
        self._one_commit = OneAtATime()
        self._indexes = indexes  # shared with the session store, which puts each index it stores here
        self._looks = Looks()  # what this process learnt of each session's stored indexes

    def if_complete(self, run: str, name: str, sid: str, meta: SessionMeta, rank: int) -> SessionStatus:
        """After rank ``rank``'s index is stored: commit when every rank's index is there; a refusal raises.

        Whether some rank's index is missing is learnt from this process's looks at the session
        (:class:`~.completeness.Looks`): mostly one probe, or none where a look begun after this index
        was stored found one missing; a listing decides that none is, and the commit reads the objects
        it found (no second listing). The answer's ``ranks_done`` is ``rank`` alone, so no rank's answer
        grows with the world size (``SessionStore.status`` lists them all).
        """
        since, incarnation = time.monotonic(), meta.created_at.isoformat()
        listed: dict[int, str] = {}

        def listing() -> list[int]:
            listed.clear()
            listed.update(stored(self.storage, run, name, sid, incarnation))
            return sorted(listed)

        missing = self._looks.missing_since(
            Paths.session(run, name, sid), since, meta.world_size,
            kept=lambda r: self._indexes.state(kept_key(run, name, sid, r)),
            probe=lambda r: in_window(self.storage, run, name, sid, incarnation, r).keys(), listing=listing)
        base = dict(run=run, name=name, session=sid, world_size=meta.world_size, ranks_done=[rank])
        if missing:
            return SessionStatus(state="open", **base)
        # complete, as this call's listing says; StorageError: not a verdict, the caller retries (503)
        digest = self.commit(run, name, sid, meta, listed)
        return SessionStatus(state="committed", manifest_xxh3=digest, **base)

    def commit(self, run: str, name: str, sid: str, meta: SessionMeta | None = None,
               where: dict[int, str] | None = None) -> str:
        """Merge, validate, write the manifest, create the marker (``meta``: the session's record, read
        here when not given; ``where``: the objects holding each rank's index, as a listing just found
        them, else listed here if needed); return the manifest digest, or raise the session's recorded refusal
        (``CommitFailed``). One call per session at a time here: one that
        waited finds the marker or the refusal the first made. When this call created the marker, tell
        the observers (a failing one is logged: the checkpoint is committed whatever they do)."""
        t0 = time.perf_counter()
        try:
            with self._one_commit((run, name, sid)):  # then committed or refused by the call it waited for?
                done = committed_by(self.visibility, run, name, sid)
                failed = self.storage.read_json_or_none(Paths.failed(run, name, sid)) if done is None else None
                if failed is not None:
                    raise CommitFailed(failed["error"]["message"], **failed["error"].get("details", {}))
                digest, event = (done.manifest_xxh3, None) if done is not None else self._commit(
                    run, name, sid, meta or session_meta(self.storage, run, name, sid), where)
        finally:
            self._indexes.drop_under(Paths.session(run, name, sid) + "/")
            self._looks.forget(Paths.session(run, name, sid))
            self._batches.forget(run, name, sid)
            self.activity.forget(run, name, sid)  # a keep-alive from now on is answered from the store: 409
        if event is not None:
            self.observers.tell("committed", event, time.perf_counter() - t0)
        return digest

    def merged(self, run: str, name: str, sid: str, meta: SessionMeta, where: dict[int, str] | None = None
               ) -> tuple[Manifest, dict[str, FileEntry], dict[str, tuple[str, str]]]:
        """The merged manifest, the digest records of its files and their arrival records (unless
        :attr:`read_back`: the commit then reads every file). Each rank's index and its files' records
        as ``put_index`` checked them here (:class:`~.index_cache.IndexCache`), else as the replica that
        checked them stored them, the ranks of one object in one read (:mod:`.rank_indexes`); folded
        (:class:`~.merge.ManifestFold`) rank by rank and dropped: the commit holds the manifest being built
        and the indexes read ahead of the fold, not every index. On a remote store the next objects are
        read while one is folded (:mod:`.inflight`)."""
        fold = ManifestFold(run=run, name=name, session=sid, step=meta.step, created_at=meta.created_at,
                            world_size=meta.world_size, derived_from=meta.derived_from, parent=meta.parent)
        incarnation = meta.created_at.isoformat()
        keys = [kept_key(run, name, sid, r) for r in range(meta.world_size)]
        away = {r for r, key in enumerate(keys) if self._indexes.state(key) is None}
        if away and where is None:  # one listing, if any rank is not kept here
            where = stored(self.storage, run, name, sid, incarnation)
        where = where or {}
        missing = sorted(away - where.keys())
        if missing:  # gone since a look found it: not a verdict, the session stays open for its retry
            raise _gone(run, name, sid, missing[0])
        objects = list(dict.fromkeys(where[r] for r in sorted(away)))  # in the order the fold needs them

        def read(key: str) -> dict[int, Checked]:
            return {r: c for r, c in read_batch(self.storage, key, incarnation).items()
                    if r in away and where[r] == key}

        files: dict[str, FileEntry] = {}
        arrivals: dict[str, tuple[str, str]] = {}
        ahead: dict[int, Checked] = {}  # read, not folded yet
        # Closed on the way out, refusal included: the reads ahead stop and their threads end with it.
        with contextlib.closing(ordered_map(read, objects, requests_in_flight(self.storage, keys[0]))) as reads:
            for r in range(meta.world_size):
                checked = None if r in away else self._indexes.take(keys[r], incarnation)
                while r in away and r not in ahead:
                    ahead.update(next(reads))
                if checked is None:  # another replica's, or let go here since
                    checked = ahead.pop(r) if r in away else self._stored(run, name, sid, incarnation, r)
                ix, records = checked
                for f in ix.files:
                    entry, arrived = records[f]
                    files[f] = entry
                    if arrived is not None and not self.read_back:
                        arrivals[f] = arrived
                fold.add(ix)
                del ix, records, checked
        return fold.manifest(files), files, arrivals

    def _stored(self, run: str, name: str, sid: str, incarnation: str, rank: int) -> Checked:
        """Rank ``rank``'s index and records as stored last: a rank kept here, let go by the cache meanwhile."""
        key = in_window(self.storage, run, name, sid, incarnation, rank).get(rank)
        if key is None:
            raise _gone(run, name, sid, rank)
        return read_batch(self.storage, key, incarnation)[rank]

    def _linked(self, run: str, manifest: Manifest, arrivals: dict[str, tuple[str, str]]
                ) -> dict[str, tuple[str, str]]:
        """The linked files confirmed, like files checked as they arrived, by their identity (the
        :data:`~.records.LINKED` arrival record ``Intake.link`` made): each whose rows in ``manifest``
        are rows of its source file in the source checkpoint's manifest, a checkpoint not known bad, so
        the source's check covers them. Any other row in a linked file has it read back."""
        mine = [f for f, (rows, _) in arrivals.items() if rows == LINKED and manifest.files[f].linked]
        by_source: dict[str, list[str]] = {}
        for f in mine:
            by_source.setdefault(manifest.files[f].linked.split("/", 1)[0], []).append(f)
        here, out = file_rows(manifest, mine) if mine else {}, {}
        for ckpt, fs in by_source.items():
            c = self.visibility.check(run, ckpt)
            if c is None or known_bad(self.storage, c) is not None:
                continue
            source = {f: manifest.files[f].linked.split("/", 1)[1] for f in fs}
            theirs = file_rows(self.visibility.manifest(c), set(source.values()))
            for f in fs:
                rows, held = here[f], theirs[source[f]]
                if rows is not None and held is not None and rows <= held:
                    out[f] = (rows_digest(rows), arrivals[f][1])
        return out

    def _drop_unfinished(self, run: str, name: str, sid: str) -> None:
        """Right after the marker: delete every unfinished write left in the committed session (temp
        files of writers killed mid-upload, unfinished multipart uploads). None of them can still be
        needed: every rank's index is in and every file they name is published, and the session
        refuses writes from now on, before they write. A write that began before the marker and is
        still going loses its temp and fails (a write into a committed session answers 409 on its
        retry); one killed after this walk is the sweep's (:meth:`.sweep.Sweeper.reclaim_stale`,
        a TTL after the commit). A failure here is logged: the checkpoint is committed."""
        try:
            n = self.storage.reclaim_temps(Paths.session(run, name, sid), math.inf)
        except StorageError as e:
            log.warning("commit of %s/%s: unfinished writes left in session %s: %s", run, name, sid, e.message)
            return
        if n:
            log.info("commit of %s/%s: %d unfinished writes removed from session %s", run, name, n, sid)

    def _commit(self, run: str, name: str, sid: str, meta: SessionMeta, where: dict[int, str] | None
                ) -> tuple[str, CommitEvent | None]:
        with gc_paused():  # 512,000 chunks allocate enough for the collector to run dozens of full passes
            try:
                manifest, files, arrivals = self.merged(run, name, sid, meta, where)
                check_links(manifest)  # a linked file must be at least half used: references pay for themselves
                arrivals.update(self._linked(run, manifest, arrivals))
                key_of = lambda f: Paths.file(run, name, sid, f)  # noqa: E731
                before = file_stamps(self.storage, key_of, sorted(files))
                t0 = time.perf_counter()
                # every byte, whichever way it entered, except what was checked as it arrived and is still there
                verdict = check_commit(manifest, self.storage, key_of, arrivals, before)
                # the stamps after the reading, where bytes were read (nothing read: what vouches is the
                # stamps before, against the arrival records; a LIST per 1,000 files less on S3)
                after = file_stamps(self.storage, key_of, sorted(files)) if verdict.bytes_read else before
                check = CommitCheck(before, after, verdict.bytes_read, time.perf_counter() - t0,
                                    len(manifest.tensors), sum(len(t.table) for t in manifest.tensors))
            except StorageError:
                raise  # transient (or the store is down): the session stays open for a retry, not failed
            except (CkptdError, ValidationError) as e:
                err = e if isinstance(e, CkptdError) else InvalidIndex(f"{run}/{name}: {e}")
                log.warning("commit of %s/%s session %s refused: %s", run, name, sid, err.message)
                self.storage.put(Paths.failed(run, name, sid), json.dumps(err.to_body()).encode())
                self.observers.tell("refused", run, name, sid, err)
                raise err
            raw = manifest.__pydantic_serializer__.to_json(manifest)  # model_dump_json's bytes, without a str copy
            derived_from, nfiles, nbytes = manifest.derived_from, len(manifest.files), manifest.total_bytes
            says = (manifest.run, manifest.name, manifest.session, manifest.step, manifest.derived_from,
                    manifest.parent, manifest.created_at)
            tree = LoadTree(manifest).root  # what each loading rank checks its pieces against
            # Freed here by reference counting, so the collector, back on, does not walk them first.
            del manifest, files
        digest = xxh3_hex(raw)
        mkey = Paths.manifest(run, name, sid, digest)
        if self.storage.size(mkey) != len(raw):
            try:
                self.storage.put(mkey, raw)
            except StorageError:  # another replica committed the session meanwhile, and its clean-up took
                existing = committed_by(self.visibility, run, name, sid)  # this write's temp file away
                if existing is None:
                    raise
                return existing.manifest_xxh3, None
            # what these bytes say, known without reading them back: the first status of a commit of
            # 10,000 ranks does not parse its manifest again
            self.visibility.note_written(mkey, digest, says)
        if verdict.bytes_arrived > 0:  # the re-read after the marker is due: the store holds that first
            mark_due(self.storage, run, name, sid)
        marker = Marker(ref=f"{run}/{name}", session=sid, manifest=manifest_file_name(digest), manifest_xxh3=digest,
                        step=meta.step, derived_from=derived_from, committed_at=datetime.now(timezone.utc),
                        parent=meta.parent, load_tree=tree)
        if not self.storage.create_if_absent(Paths.marker(run, name), marker.model_dump_json().encode()):
            existing = committed_by(self.visibility, run, name, sid)
            if existing is None:
                raise Conflict(f"{run}/{name} was committed by another session", ref=f"{run}/{name}")
            return existing.manifest_xxh3, None
        self.visibility.forget_listing(run)
        reread = verdict.bytes_arrived > 0
        if not reread:  # every byte read here: the commit's check is the first verification
            record_commit_check(self.storage, run, name, digest, check, nfiles)
        else:  # until the re-read: what the commit read vouches for itself (a later save links it)
            for f, stamp in check.before.items():
                if f not in verdict.files_arrived and stamp == check.after.get(f):
                    record_arrival(self.storage, Paths.arrival(run, name, sid, f), stamp)
        self._drop_unfinished(run, name, sid)
        log.info("committed %s/%s session %s (%d files, %d bytes; %d read back, %d checked as they arrived)", run,
                 name, sid, nfiles, nbytes, verdict.bytes_read, verdict.bytes_arrived)
        return digest, CommitEvent(run=run, name=name, session=sid, manifest_xxh3=digest, derived_from=derived_from,
                                   files=nfiles, bytes=nbytes, bytes_read=verdict.bytes_read,
                                   bytes_arrived=verdict.bytes_arrived)
