"""The end of upload sessions that will not commit: abort, and the sweep that reclaims or recovers.

Call order: :meth:`Sweeper.abort` when a writer gives its session up; :meth:`Sweeper.reclaim_stale`
on the service's timer (and ``ckptd gc --root``): for each checkpoint, a complete session left
without its marker (the process that took the last index died before the marker) is committed
(:meth:`~.commit.Committer.commit`), then a session no marker names whose time is up
(:func:`.activity.reclaim_at`, also asked by the web view through :meth:`Sweeper.reclaim_of`) is
deleted, and a committed session's unfinished writes are deleted (those from before its commit at
first sight, the others once its TTL passed). What the
sweep deleted is told to the observers (:class:`~.events.Observers`).
"""

from __future__ import annotations

import logging
import time

from ckptd_schemas import AlreadyCommitted, CkptdError, Conflict, StorageError, check_name, check_run, check_session

from ..storage import Storage
from .activity import Reclaim, SessionActivity, reclaim_at
from .commit import Committer
from .events import Observers
from .paths import Marker, Paths, SessionMeta
from .rank_indexes import ranks_done
from .session_reads import read_meta
from .visibility import BadMarker, Visibility

__all__ = ["Sweeper"]

log = logging.getLogger("ckptd.store")


class Sweeper:
    """Abort and the sweep over the sessions of one store (module docstring). It remembers, per
    process, what later sweeps need not look at again."""

    def __init__(self, storage: Storage, visibility: Visibility, activity: SessionActivity, committer: Committer,
                 observers: Observers, dead_after: float) -> None:
        self.storage, self.visibility, self.activity = storage, visibility, activity
        self.committer, self.observers, self.dead_after = committer, observers, dead_after
        self._orphans_seen: set[str] = set()
        self._temps_reclaimed: set[str] = set()  # committed sessions the sweep cleared of temp files
        self._commits_checked: set[str] = set()  # committed sessions cleared of what was left before the marker
        self._settled: dict[str, str] = {}  # run/name -> the marker's session, nothing else left to sweep

    def abort(self, run: str, name: str, sid: str) -> None:
        check_run(run), check_name(name), check_session(sid)
        m = self.visibility.marker(run, name)
        if isinstance(m, BadMarker):
            raise Conflict(f"{run}/{name} has a COMMITTED marker that does not parse; its sessions are kept as "
                           f"they are", ref=f"{run}/{name}")
        if m is not None and m.session == sid:
            raise AlreadyCommitted(f"{run}/{name} is committed; delete it with gc, not abort", ref=f"{run}/{name}")
        self.storage.delete_tree(Paths.session(run, name, sid))
        self.activity.forget(run, name, sid)

    def reclaim_stale(self, ttl_seconds: float, *, now: float | None = None) -> list[str]:
        """The sweep (module docstring; a session's time is up at :func:`.activity.reclaim_at`, with
        ``dead_after`` and ``ttl_seconds``). Return the reclaimed ``run/name/session``s.

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
            self.observers.tell("reclaimed", removed)
        return removed

    def reclaim_of(self, run: str, name: str, sid: str, meta: SessionMeta, ttl_seconds: float) -> Reclaim:
        """When the sweep reclaims this uncommitted session, and why (the web view shows it)."""
        return reclaim_at(meta.created_at, self.activity.last(run, name, sid), ttl=ttl_seconds, idle=self.dead_after)

    def _sweep_checkpoint(self, run: str, name: str, ttl_seconds: float, now: float) -> list[str]:
        m = self.visibility.marker(run, name)
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
            meta = read_meta(self.storage, run, name, sid)
            if m is None and meta is not None and self._recover(run, name, sid, meta):
                m = self.visibility.marker(run, name)
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
        """In a committed session, delete what writers killed mid-write left (temp files, unfinished
        uploads). At first sight in this process, those last written before the commit: the commit
        deletes them right after its marker, unless its process died first. Then once per process,
        a TTL after the commit, those older than the TTL: a write that began before the marker and
        was killed after it; none comes after (the session takes no more writes), so later sweeps
        do not walk the session again."""
        key, at = f"{run}/{name}/{m.session}", m.committed_at.timestamp()
        if key in self._temps_reclaimed:
            return
        if now - at < ttl_seconds:
            if key not in self._commits_checked:
                self._commits_checked.add(key)
                n = self.storage.reclaim_temps(Paths.session(run, name, m.session), at)
                if n:
                    log.info("sweep: %d unfinished writes from before the commit removed from %s/%s", n, run, name)
            return
        n = self.storage.reclaim_temps(Paths.session(run, name, m.session), now - ttl_seconds)  # covers the above
        self._temps_reclaimed.add(key)
        self._commits_checked.discard(key)
        if n:
            log.info("sweep: %d unfinished writes removed from committed %s/%s", n, run, name)

    def _recover(self, run: str, name: str, sid: str, meta: SessionMeta) -> bool:
        """Commit a session whose indexes are all stored and that was not refused; True if it committed."""
        if len(ranks_done(self.storage, run, name, sid, meta.created_at.isoformat())) < meta.world_size:
            return False
        if self.storage.read_json_or_none(Paths.failed(run, name, sid)) is not None:
            return False
        try:
            self.committer.commit(run, name, sid, meta)
        except StorageError:
            raise
        except CkptdError as e:  # refused (recorded as FAILED), or committed by another session
            log.info("sweep: session %s of %s/%s not committed: %s", sid, run, name, e.message)
            return False
        log.info("sweep: committed %s/%s session %s, complete but left without its marker", run, name, sid)
        return True
