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
from collections.abc import Sequence
from datetime import datetime, timezone

from pydantic import ValidationError

from ckptd_schemas import (
    CkptdError, CommitFailed, Conflict, FileEntry, InvalidIndex, Manifest, RankIndex, SessionStatus, StorageError,
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
from .index_cache import IndexCache, Records
from .inflight import ordered_map, requests_in_flight
from .intake import recorded_file
from .merge import ManifestFold
from .node_indexes import node_objects, read_node, stored_node
from .paths import Marker, Paths, SessionMeta
from .records import LINKED, CommitCheck, arrival_of, file_stamps, known_bad, record_arrival, record_commit_check
from .links import check_links
from .rereads import mark_due
from .session_reads import committed_by, ranks_done, session_meta
from .visibility import Visibility, manifest_file_name

__all__ = ["Committer"]

log = logging.getLogger("ckptd.store")

#: A file of a rank's index: its name, digest record (None: none) and arrival record (None: read it back).
Entry = tuple[str, "FileEntry | None", "tuple[str, str] | None"]


class Committer:
    """Commits the sessions of one store (module docstring)."""

    def __init__(self, storage: Storage, visibility: Visibility, indexes: IndexCache, activity: SessionActivity,
                 observers: Observers, *, read_back: bool = False, node_ranks: int = 0) -> None:
        self.storage, self.visibility, self.activity, self.observers = storage, visibility, activity, observers
        self.read_back = read_back  # read every byte before the marker, even those checked as they arrived
        self.node_ranks = node_ranks  # ranks per node object (:mod:`.node_indexes`); 0: none
        # One commit of a session at a time here: the ranks' last indexes arrive together, each finding
        # every index stored, and each would merge and check the whole checkpoint.
        self._one_commit = OneAtATime()
        self._indexes = indexes  # shared with the session store, which puts each index it stores here
        self._looks = Looks()  # what this process learnt of each session's stored indexes

    def if_complete(self, run: str, name: str, sid: str, meta: SessionMeta, rank: int) -> SessionStatus:
        """After rank ``rank``'s index is stored: commit when every rank's index is there; a refusal raises.

        Whether some rank's index is missing is learnt from this process's looks at the session
        (:class:`~.completeness.Looks`): mostly one probe, or none where a look begun after this index
        was stored found one missing; a listing decides that none is. The answer's ``ranks_done`` is
        ``rank`` alone, so no rank's answer grows with the world size (``SessionStore.status`` lists
        them all).
        """
        since = time.monotonic()
        missing = self._looks.missing_since(
            Paths.session(run, name, sid), since, meta.world_size,
            kept=lambda r: self._indexes.state(Paths.rank_index(run, name, sid, r)),
            probe=lambda r: self._probe(run, name, sid, r, meta.world_size),
            listing=lambda: ranks_done(self.storage, run, name, sid))
        base = dict(run=run, name=name, session=sid, world_size=meta.world_size, ranks_done=[rank])
        if missing:
            return SessionStatus(state="open", **base)
        digest = self.commit(run, name, sid, meta)  # StorageError: not a verdict, the caller retries (503)
        return SessionStatus(state="committed", manifest_xxh3=digest, **base)

    def _probe(self, run: str, name: str, sid: str, rank: int, world_size: int) -> Sequence[int]:
        """The ranks found stored by a look at rank ``rank``'s index: none (it is missing), it, or, with
        node objects, every rank of its node whose object is stored (:func:`.node_indexes.stored_node`)."""
        if not self.storage.exists(Paths.rank_index(run, name, sid, rank)):
            return ()
        return stored_node(self.storage, run, name, sid, rank, world_size, self.node_ranks) or (rank,)

    def commit(self, run: str, name: str, sid: str, meta: SessionMeta | None = None) -> str:
        """Merge, validate, write the manifest, create the marker (``meta``: the session's record, read
        here when not given); return the manifest digest, or raise the session's recorded refusal
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
                    run, name, sid, meta or session_meta(self.storage, run, name, sid))
        finally:
            self._indexes.drop_under(Paths.session(run, name, sid) + "/")
            self._looks.forget(Paths.session(run, name, sid))
            self.activity.forget(run, name, sid)  # a keep-alive from now on is answered from the store: 409
        if event is not None:
            self.observers.tell("committed", event, time.perf_counter() - t0)
        return digest

    def merged(self, run: str, name: str, sid: str, meta: SessionMeta
               ) -> tuple[Manifest, dict[str, FileEntry], dict[str, tuple[str, str]]]:
        """The merged manifest, the digest records of its files and their arrival records (unless
        :attr:`read_back`: the commit then reads every file). Each rank's index and its files' records
        as ``put_index`` checked them here (:class:`~.index_cache.IndexCache`), else read from the store
        (a node's ranks in one read where another replica stored their node object, :mod:`.node_indexes`);
        folded (:class:`~.merge.ManifestFold`) and dropped rank by rank: the commit holds the manifest
        being built and a few indexes, not every index. On a remote store the next ranks' indexes
        and digest records are read while one is folded (:mod:`.inflight`)."""
        fold = ManifestFold(run=run, name=name, session=sid, step=meta.step, created_at=meta.created_at,
                            world_size=meta.world_size, derived_from=meta.derived_from, parent=meta.parent)
        incarnation = meta.created_at.isoformat()
        keys = [Paths.rank_index(run, name, sid, r) for r in range(meta.world_size)]

        def kept(ix: RankIndex, records: dict[str, Records]) -> tuple[RankIndex, list[Entry]]:
            return ix, [(f, records[f][0], None if self.read_back else records[f][1]) for f in ix.files]

        def read_rank(r: int) -> tuple[RankIndex, list[Entry]]:
            checked = self._indexes.take(keys[r], incarnation)  # as put_index checked it here
            if checked is not None:
                return kept(*checked)
            ix = RankIndex.model_validate_json(self.storage.read(keys[r]))  # another replica's, or evicted
            return ix, [(f, recorded_file(self.storage, run, name, sid, f),
                         None if self.read_back else arrival_of(self.storage, run, name, sid, f)) for f in ix.files]

        def read_unit(unit: tuple[tuple[int, int] | None, range]) -> list[tuple[RankIndex, list[Entry]]]:
            span, ranks = unit
            node = read_node(self.storage, run, name, sid, incarnation, *span) if span is not None else {}
            return [kept(*node[r]) if r in node and self._indexes.state(keys[r]) is None else read_rank(r)
                    for r in ranks]

        files: dict[str, FileEntry] = {}
        arrivals: dict[str, tuple[str, str]] = {}
        n = requests_in_flight(self.storage, keys[0])
        units = self._units(run, name, sid, keys)
        # Closed on the way out, refusal included: the reads ahead stop and their threads end with it.
        with contextlib.closing(ordered_map(read_unit, units, n)) as read:
            for ix, entries in (one for unit in read for one in unit):
                for f, entry, arrived in entries:
                    if entry is None:
                        raise InvalidIndex(f"rank {ix.rank}: file {f!r} has no verified upload", file=f)
                    files[f] = entry
                    if arrived is not None:
                        arrivals[f] = arrived
                fold.add(ix)
                del ix, entries
        return fold.manifest(files), files, arrivals

    def _units(self, run: str, name: str, sid: str, keys: list[str]) -> list[tuple[tuple[int, int] | None, range]]:
        """The commit's reads in rank order: each rank alone, but for a run of ranks this process does not
        keep that a node object holds (:mod:`.node_indexes`; listed once, and only if some rank is not kept
        here): those with the object (its span), one read for them all."""
        away = {r for r, key in enumerate(keys) if self._indexes.state(key) is None}
        nodes = node_objects(self.storage, run, name, sid) if away else []
        units: list[tuple[tuple[int, int] | None, range]] = []
        r, i = 0, 0
        while r < len(keys):
            while i < len(nodes) and nodes[i][1] < r:
                i += 1
            if r in away and i < len(nodes) and nodes[i][0] <= r and nodes[i][1] < len(keys):
                units.append((nodes[i], range(r, nodes[i][1] + 1)))
                r = nodes[i][1] + 1
            else:
                units.append((None, range(r, r + 1)))
                r += 1
        return units

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

    def _commit(self, run: str, name: str, sid: str, meta: SessionMeta) -> tuple[str, CommitEvent | None]:
        with gc_paused():  # 512,000 chunks allocate enough for the collector to run dozens of full passes
            try:
                manifest, files, arrivals = self.merged(run, name, sid, meta)
                check_links(manifest)  # a linked file must be at least half used: references pay for themselves
                arrivals.update(self._linked(run, manifest, arrivals))
                key_of = lambda f: Paths.file(run, name, sid, f)  # noqa: E731
                before = file_stamps(self.storage, key_of, sorted(files))
                t0 = time.perf_counter()
                # every byte, whichever way it entered, except what was checked as it arrived and is still there
                verdict = check_commit(manifest, self.storage, key_of, arrivals, before)
                check = CommitCheck(before, file_stamps(self.storage, key_of, sorted(files)), verdict.bytes_read,
                                    time.perf_counter() - t0, len(manifest.tensors),
                                    sum(len(t.table) for t in manifest.tensors))
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
