"""Write side of the store: upload sessions (docs/design.md §2), over modules with one job each.

Call order for one save attempt (each step idempotent, any replica may serve it):

1. :meth:`SessionStore.open` - every rank, same session id: open-or-join (a new session asks the root's
   space first, :mod:`.space`; joining one does not).
2. Data files, through the one ingest seam, ``SessionStore.intake`` (:mod:`.intake`): received,
   presigned and confirmed, or linked; each way passes the one write gate
   (:meth:`~.session_reads.Gate.writable`) and asks the root's space before it stores.
3. :meth:`SessionStore.put_index` - per rank, after its files: stores the rank's chunk index; the
   call that completes the set commits (``SessionStore.committer``, :mod:`.commit`): merge, check
   every byte, manifest, ``COMMITTED`` created once. Re-entrant: a crash anywhere before the marker
   leaves the session invisible, and the rank's retried ``put_index`` or the sweep
   (``SessionStore.sweeper``, :mod:`.sweep`, which also aborts) finishes the job.

What happened is told through one channel, the store's observers (:mod:`.events`, added at
construction or later to ``SessionStore.observers``): sessions opened, every commit that created a
marker here whichever path committed, refusals and what a sweep reclaimed. A failing observer is
logged, never raised into the save, and never undoes a commit.

:meth:`SessionStore.status` only reads: a status poll or a metrics scrape never commits.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Sequence

from ckptd_schemas import (
    AlreadyCommitted, InvalidIndex, InvalidRequest, OpenSession, RankIndex, SessionConflict, SessionInfo,
    SessionStatus, check_file, check_name, check_new_name, check_run, check_session, parse_ref,
)
from ckptd_schemas.filedigest import BLOCK_SIZE

from ..storage import Storage
from .activity import DEAD_SESSION_AFTER, KEEPALIVE_PER_WINDOW, SessionActivity
from .commit import Committer
from .events import Observers, SessionEvents
from .index_cache import IndexCache, Records
from .intake import Intake, recorded_file
from .records import arrival_of
from .paths import Paths, SessionMeta
from .rank_indexes import BatchWriter, kept_key, ranks_done, stored_index
from .session_reads import committed_by, read_meta, session_meta, taken_error
from .space import OPEN_BYTES, Holder, Space, on_disk
from .sweep import Sweeper
from .visibility import Visibility

__all__ = ["SessionStore"]


class SessionStore:
    """Upload sessions and commits over one :class:`Storage`."""

    def __init__(self, storage: Storage, *, block_size: int = BLOCK_SIZE, visibility: Visibility | None = None,
                 observers: Sequence[SessionEvents] = (), dead_after: float = DEAD_SESSION_AFTER,
                 space: Space | None = None, read_back: bool = False) -> None:
        self.storage = storage
        self.dead_after = dead_after  # seconds without a live writer before the sweep reclaims a session
        self.activity = SessionActivity(self.storage, every=dead_after / KEEPALIVE_PER_WINDOW / 2)
        self.visibility = visibility or Visibility(self.storage)
        self.observers = Observers(observers)
        self._indexes = IndexCache()
        self._batches = BatchWriter(self.storage)
        self.intake = Intake(self.storage, self.visibility, self.activity, block_size, self._indexes, space)
        self.committer = Committer(self.storage, self.visibility, self._indexes, self.activity, self.observers,
                                   self._batches, read_back=read_back)
        self.sweeper = Sweeper(self.storage, self.visibility, self.activity, self.committer, self.observers,
                               dead_after)

    def keep_alive(self, run: str, name: str, sid: str) -> None:
        """A rank that joined the session says it is alive (between its writes, while one long write
        streams, while it waits for the others): the sweep keeps the session while a rank is
        (:mod:`.activity`). Every writer request that succeeds counts too; a refused one writes
        nothing, not even this record."""
        if self.activity.fresh(run, name, sid):
            return  # recorded moments ago by this process: a thousand ranks' keep-alives cost no request to the store
        self.intake.gate.writable(run, name, sid)
        self.activity.touch(run, name, sid)

    # -- 1. open ---------------------------------------------------------------
    def open(self, run: str, name: str, req: OpenSession, holder: Holder | None = None) -> SessionInfo:
        """Open session ``req.session`` of ``run/name``, or join it. A new session is charged to ``holder``
        and refused at the root's reserve first (:data:`.space.OPEN_BYTES`); joining one is not,
        so a save already open always commits."""
        check_run(run), check_new_name(name), check_session(req.session)
        m = self.visibility.marker(run, name)  # any marker, parsed or not, takes the ref
        if m is not None:
            raise taken_error(run, name, m)
        if req.derived_from is not None:
            parse_ref(req.derived_from)
        key = Paths.session_meta(run, name, req.session)
        meta = read_meta(self.storage, run, name, req.session)
        if meta is None:
            self._check_parent(run, req.parent)
            self.intake.space.charge(holder, run, f"{name}/sessions/{req.session}", OPEN_BYTES, on_root=True)
            meta = SessionMeta(session=req.session, world_size=req.world_size, step=req.step,
                               created_at=datetime.now(timezone.utc), derived_from=req.derived_from,
                               parent=req.parent)
            if not self.storage.create_if_absent(key, meta.model_dump_json().encode()):
                meta = session_meta(self.storage, run, name, req.session)
        if (meta.world_size, meta.step, meta.derived_from, meta.parent) != \
                (req.world_size, req.step, req.derived_from, req.parent):
            raise SessionConflict(
                f"session {req.session} of {run}/{name} was opened with world size {meta.world_size}, step "
                f"{meta.step} and parent {meta.parent}; this request says world size {req.world_size}, step "
                f"{req.step} and parent {req.parent}", ref=f"{run}/{name}", session=req.session)
        self.observers.tell("opened", run, name, meta.session)
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

    # -- 3. rank index -----------------------------------------------------------------
    def put_index(self, run: str, name: str, sid: str, index: RankIndex, holder: Holder | None = None) -> SessionStatus:
        """Store rank ``index.rank``'s index, checked against the session's files, charged to ``holder``'s
        quota (not to the root's reserve: the commit of a save in progress writes into it); commit when
        it completes the set."""
        try:
            meta = self.intake.gate.writable(run, name, sid)
        except AlreadyCommitted:  # answered as before when this index is part of the commit
            answer = self._committed_with(run, name, sid, index)
            if answer is None:
                raise
            return answer
        if index.world_size != meta.world_size or index.rank >= meta.world_size:
            raise InvalidIndex(
                f"rank {index.rank}: index says world size {index.world_size}, session {sid} has "
                f"{meta.world_size}", rank=index.rank)
        records: dict[str, Records] = {}
        incarnation = meta.created_at.isoformat()
        for f in index.files:
            check_file(f)
            kept = self._indexes.take_records(Paths.digest(run, name, sid, f), incarnation)  # received here
            entry = kept[0] if kept is not None else recorded_file(self.storage, run, name, sid, f)
            if entry is None:
                raise InvalidIndex(f"rank {index.rank}: file {f!r} was not uploaded (or its upload failed)",
                                   rank=index.rank, file=f)
            # for the commit, as checked here
            records[f] = entry, kept[1] if kept is not None else arrival_of(self.storage, run, name, sid, f)
        sizes = {f: e.size for f, (e, _) in records.items()}
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
        key = kept_key(run, name, sid, index.rank)
        stored = self._indexes.peek(key, incarnation) if self._indexes.state(key) == "stored" else None
        if stored is not None and stored[0] == index:  # sent again the same (its answer was lost): stored here
            return self.committer.if_complete(run, name, sid, meta, index.rank)
        raw = index.model_dump_json().encode()
        self.intake.space.charge(holder, run, f"ranks/{index.rank:07d}.json", on_disk(len(raw)),
                                 on_root=False)  # its blocks; the reserve takes a save's records, so it commits
        # kept first: a look at the session meanwhile finds this rank's write pending instead of probing the store
        self._indexes.put(key, incarnation, (index, records), len(raw))
        try:  # with the indexes arriving here meanwhile, in one object (:mod:`.rank_indexes`)
            self._batches.store(run, name, sid, incarnation, index.rank, raw, records)
        except BaseException:
            self._indexes.take(key, incarnation)
            raise
        self._indexes.note_stored(key)
        self.activity.touch(run, name, sid)  # a writer: ranks' indexes may arrive for minutes after the last file
        return self.committer.if_complete(run, name, sid, meta, index.rank)

    def _committed_with(self, run: str, name: str, sid: str, index: RankIndex) -> SessionStatus | None:
        """The committed status, when session ``sid`` is committed with exactly ``index`` for its rank: a
        retry of an index already part of the commit (its answer was lost, e.g. the server died right
        after creating the marker), or one that raced the commit (ranks retrying at a restarted server
        or another replica); else None."""
        if committed_by(self.visibility, run, name, sid) is None:
            return None
        meta = read_meta(self.storage, run, name, sid)
        stored = stored_index(self.storage, run, name, sid, meta.created_at.isoformat(), index.rank) if meta else None
        if stored is None or stored != index:
            return None
        return self.status(run, name, sid)

    # -- status ------------------------------------------------------------------------
    def status(self, run: str, name: str, sid: str, *, list_ranks: bool = True) -> SessionStatus:
        """Where the session stands. Only reads: a complete session that is not committed yet (its
        last index arrived at a process that died before the marker) is finished by the rank's
        retried index or by the sweep (``sweeper``), never by asking. Without ``list_ranks`` an open or
        failed session's ``ranks_done`` is left empty: a few reads whatever the world size (what a
        waiting rank needs), where listing the ranks is O(world size)."""
        check_run(run), check_name(name), check_session(sid)
        taken = self.visibility.marker(run, name)  # read once: a commit finishing meanwhile is seen on the next poll
        m = committed_by(self.visibility, run, name, sid, taken) if taken is not None else None
        if m is not None:
            meta = read_meta(self.storage, run, name, sid)
            return SessionStatus(run=run, name=name, session=sid, state="committed",
                                 world_size=meta.world_size if meta else 0, ranks_done=[],
                                 manifest_xxh3=m.manifest_xxh3)
        meta = session_meta(self.storage, run, name, sid)
        done = ranks_done(self.storage, run, name, sid, meta.created_at.isoformat()) if list_ranks else []
        base = dict(run=run, name=name, session=sid, world_size=meta.world_size, ranks_done=done)
        if taken is not None:
            return SessionStatus(state="failed", error=taken_error(run, name, taken).to_body()["error"], **base)
        failed = self.storage.read_json_or_none(Paths.failed(run, name, sid))
        if failed is not None:
            return SessionStatus(state="failed", error=failed["error"], **base)
        return SessionStatus(state="open", **base)
