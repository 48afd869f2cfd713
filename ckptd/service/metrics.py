"""Prometheus metrics (``GET /metrics``), one registry per app.

Instrumented at the service's edges: the request middleware (bytes, requests, latency), the error
handler (storage errors, integrity refusals), the store core's events
(:class:`~ckptd.store.events.SessionEvents`: commits, refusals, open and reclaimed sessions) and the
reshard routes (job progress, read from the job records at scrape time).
No label carries a run or checkpoint name; route labels are handler names. The metrics and what each
means: docs/http-api.md, Metrics and logs (each one's help text below says it in short).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)

from ckptd_schemas import CkptdError, StorageError

from ..storage import Storage
from ..store.durable import Copied, DurableCopier
from ..store.events import SessionEvents
from ..store.events import CommitEvent
from ..store.sessions import SessionStore
from ..store.records import VerifyRecord
from ..store.visibility import Visibility

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

log = logging.getLogger("ckptd.service")
COMMIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
FINISHED_JOB_KEEP_SECONDS = 600.0  # a finished job's gauges stay this long, so a scrape sees its 100%
MAX_REFRESH = 1000  # sessions or jobs re-read per scrape at most


class Metrics(SessionEvents):
    """The service's metrics in their own :class:`CollectorRegistry` (apps in one process do not collide)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        self.bytes_in = counter("ckptd_bytes_in", "Request body bytes received.", "route")
        self.bytes_out = counter("ckptd_bytes_out", "Response body bytes sent.", "route")
        self.requests = counter("ckptd_http_requests", "Requests answered.", "route", "method", "status")
        self.request_seconds = Histogram("ckptd_http_request_seconds", "Time to answer a request.", ["route"],
                                         buckets=REQUEST_BUCKETS, registry=r)
        self.commit_seconds = Histogram("ckptd_commit_seconds",
                                        "Time of one commit: merge and validate the indexes, write the manifest "
                                        "and the COMMITTED marker.", buckets=COMMIT_BUCKETS, registry=r)
        self.commits = counter("ckptd_commits", "Checkpoints committed by this replica.")
        self.commit_checked = counter("ckptd_commit_checked_bytes", "Data bytes this replica's commits checked: read "
                                      "back before the marker, or checked on arrival (confirmed by their stored "
                                      "identity, re-read after the marker).", "how")
        self.reread_bytes = counter("ckptd_reread_bytes", "Data bytes this replica's workers re-read after markers.")
        self.reread_shares = counter("ckptd_reread_shares", "Shares of re-reads checked here.")
        self.local_uploads = counter("ckptd_local_uploads", "Data files handed over by co-located ranks, by the status "
                                     "answered.", "status")
        self.committed_bytes = counter("ckptd_committed_bytes", "Bytes of the data files of the checkpoints committed "
                                       "by this replica (with process_cpu_seconds_total: the service's CPU per "
                                       "committed GiB).")
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.sessions_reclaimed = counter("ckptd_sessions_reclaimed", "Uncommitted sessions the sweep here deleted (no "
                                          "rank heard from for CKPTD_DEAD_SESSION_AFTER, or past the TTL).")
        self.sessions_open = gauge("ckptd_upload_sessions_open", "Upload sessions opened through this replica and not "
                                   "yet committed, failed or aborted.")
        self.verify_failures = counter("ckptd_verify_failures", "Integrity refusals: uploads whose bytes differ from "
                                       "their digest, commits refused at validation, manifests that do not match their "
                                       "marker.", "code")
        self.invisible = counter("ckptd_invisible_checkpoints", "Checkpoints found failing the visibility rule (a "
                                 "marker or manifest that does not parse, match or agree), by reason; each ref and "
                                 "reason once.", "reason")
        self.storage_errors = counter("ckptd_storage_errors", "Storage backend failures, by operation.", "op")
        self.auth_refusals = counter("ckptd_auth_refusals", "Requests refused for authentication (401) or scope "
                                     "(403).", "status")
        self.client_disconnects = counter("ckptd_client_disconnects", "Requests whose client went away before its body "
                                          "was complete (answered 499, logged once).", "route")
        self.limit_refusals = counter("ckptd_limit_refusals", "Requests or connections refused by a limit (read_plan, "
                                      "uploads, requests, read_leases, damage_rechecks, body_idle, body_rate, "
                                      "header_bytes, header_timeout, send_idle, connections, list).", "limit")
        self.reshard_active = gauge("ckptd_reshard_jobs_active", "Reshard jobs submitted here, queued or running.")
        self.reshard_done = gauge("ckptd_reshard_job_bytes_done", "Bytes a reshard job has written so far.", "job")
        self.reshard_planned = gauge("ckptd_reshard_job_bytes_planned", "Bytes a reshard job will write.", "job")
        self.reshard_finished = counter("ckptd_reshard_jobs_finished", "Reshard jobs finished, by state.", "state")
        self.drills = counter("ckptd_drills", "Conversion drills finished here: ok (every tensor of every layout "
                              "matches the source), or failed (a problem found, or the drill could not run).", "result")
        for result in ("ok", "failed"):  # both series from the first scrape, at 0
            self.drills.labels(result)
        self.durable_seconds = Histogram("ckptd_durable_seconds", "From a commit to its durable marker, per "
                                         "checkpoint copied to the durable tier here.", buckets=REQUEST_BUCKETS,
                                         registry=r)
        self.durable_copies = counter("ckptd_durable_copies", "Checkpoints copied to the durable tier (copied), or "
                                      "refused there: their fast copy does not match the manifest "
                                      "(refused).", "outcome")
        self.durable_bytes = counter("ckptd_durable_bytes", "Bytes copied to the durable tier.")
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[str, str]] = {}  # sid -> (run, name)
        self._jobs: dict[str, float | None] = {}  # job id -> when seen finished (None: still active)
        self._job_storage: Storage | None = None
        self._session_store: SessionStore | None = None
        self.sessions_open.set_function(lambda: len(self._sessions))
        self.reshard_active.set_function(lambda: sum(1 for v in self._jobs.values() if v is None))

    # -- hooks -----------------------------------------------------------------------------------------
    def watch_durable(self, copier: DurableCopier) -> None:
        """The durable tier's gauges (read from ``copier`` at scrape time) and its copy counters."""
        pending = Gauge("ckptd_durable_pending", "Committed checkpoints not durable yet.", registry=self.registry)
        pending.set_function(lambda: len(copier.pending))
        lag = Gauge("ckptd_durable_lag_seconds", "Age of the oldest committed checkpoint not durable yet (0: none).",
                    registry=self.registry)
        lag.set_function(copier.lag_seconds)

        def copied(done: Copied) -> None:
            self.durable_copies.labels("copied").inc()
            self.durable_bytes.inc(done.bytes)
            self.durable_seconds.observe(done.lag_seconds)

        copier.on_copied = copied
        copier.on_refused = lambda ref, err: self.durable_copies.labels("refused").inc()

    def watch_visibility(self, visibility: Visibility) -> None:
        """The first looks at checkpoints built here (each built once for every concurrent request) and the
        memory of what they keep (read from ``visibility`` at scrape time)."""
        built = Counter("ckptd_first_looks", "First looks at a checkpoint built by this process: its manifest "
                        "read, hashed and parsed (manifest), its load tree and interval indexes built (load_tree), a run's "
                        "listing read for the summaries that share it (listing).",
                        ["what"], registry=self.registry)
        for what in ("manifest", "load_tree", "listing"):
            built.labels(what)
        visibility.on_build = lambda what: built.labels(what).inc()
        kept = Gauge("ckptd_manifest_cache_bytes", "Estimated memory of the parsed manifests kept, with their load "
                     "trees and interval indexes (at most CKPTD_MANIFEST_CACHE_BYTES, the one in use always kept).",
                     registry=self.registry)
        kept.set_function(lambda: visibility.cache_usage()[0])
        entries = Gauge("ckptd_manifest_cache_entries", "Parsed manifests kept.", registry=self.registry)
        entries.set_function(lambda: visibility.cache_usage()[1])

    def observe_request(self, route: str, method: str, status: int, seconds: float, bytes_in: int,
                        bytes_out: int) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.request_seconds.labels(route).observe(seconds)
        if bytes_in:
            self.bytes_in.labels(route).inc(bytes_in)
        if bytes_out:
            self.bytes_out.labels(route).inc(bytes_out)
        if status in (401, 403):
            self.auth_refusals.labels(str(status)).inc()

    def observe_error(self, exc: CkptdError, op: str) -> None:
        """From the error handler: storage errors by operation, integrity refusals by code."""
        from ckptd_schemas import IntegrityError

        if isinstance(exc, StorageError):
            self.storage_errors.labels(op).inc()
        elif isinstance(exc, IntegrityError) and not getattr(exc, "_ckptd_metered", False):
            self.verify_failures.labels(exc.code).inc()

    def observe_invisible(self, ref: str, reason: str, message: str) -> None:
        """From :class:`~ckptd.store.visibility.Visibility`: a checkpoint failed the rule."""
        self.invisible.labels(reason).inc()

    def observe_reread(self, share: VerifyRecord) -> None:
        """From :class:`~ckptd.store.rereads.Rereads`: a share re-read and checked here."""
        self.reread_bytes.inc(share.bytes_read)
        self.reread_shares.inc()

    # -- the write side's events (SessionEvents: SessionStore calls these) ------------------------------
    def watch_sessions(self, store: SessionStore) -> None:
        """Observe ``store``: its events come here, and a scrape asks it which sessions are still open."""
        store.observers.add(self)
        self._session_store = store

    def opened(self, run: str, name: str, sid: str) -> None:
        with self._lock:
            self._sessions[sid] = (run, name)

    def committed(self, event: CommitEvent, seconds: float) -> None:
        self.commit_seconds.observe(seconds)
        self.commits.inc()
        self.committed_bytes.inc(event.bytes)
        self.commit_checked.labels("read back").inc(event.bytes_read)
        self.commit_checked.labels("on arrival").inc(event.bytes_arrived)
        with self._lock:
            self._sessions.pop(event.session, None)

    def refused(self, run: str, name: str, sid: str, error: CkptdError) -> None:
        self.verify_failures.labels(error.code).inc()
        error._ckptd_metered = True  # type: ignore[attr-defined]  # counted once, here (observe_error skips it)
        with self._lock:
            self._sessions.pop(sid, None)

    def reclaimed(self, keys: list[str]) -> None:
        self.sessions_reclaimed.inc(len(keys))
        with self._lock:
            for key in keys:
                self._sessions.pop(key.rsplit("/", 1)[-1], None)

    def observe_local_upload(self, status: int, nbytes: int) -> None:
        """A co-located upload answered (``local_uploads``); its bytes count as received, under the
        route ``local_upload``."""
        self.local_uploads.labels(str(status)).inc()
        self.bytes_in.labels("local_upload").inc(nbytes)

    def observe_drill(self, ok: bool) -> None:
        """A drill finished (from the worker's future, in this process)."""
        self.drills.labels("ok" if ok else "failed").inc()

    def track_job(self, storage: Storage, job_id: str) -> None:
        with self._lock:
            self._job_storage = storage
            self._jobs[job_id] = None

    # -- scrape ----------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Bring the storage-backed values up to date (sessions finished elsewhere, job progress)."""
        with self._lock:
            sessions = list(self._sessions.items())[:MAX_REFRESH]
            jobs = list(self._jobs.items())[:MAX_REFRESH]
        store = self._session_store
        if store is not None:
            for sid, (run, name) in sessions:
                try:
                    still_open = store.status(run, name, sid).state == "open"
                except StorageError:
                    continue  # the store is unreachable: the next scrape asks again
                except CkptdError:
                    still_open = False  # aborted, reclaimed, or committed by another session
                if not still_open:
                    with self._lock:
                        self._sessions.pop(sid, None)
        if self._job_storage is not None:
            from ..reshard.models import get_job

            now = time.monotonic()
            for job_id, finished_at in jobs:
                if finished_at is not None:
                    if now - finished_at > FINISHED_JOB_KEEP_SECONDS:
                        with self._lock:
                            self._jobs.pop(job_id, None)
                        for g in (self.reshard_done, self.reshard_planned):
                            with contextlib.suppress(KeyError):
                                g.remove(job_id)
                    continue
                try:
                    st = get_job(self._job_storage, job_id)
                except CkptdError:
                    continue
                self.reshard_done.labels(job_id).set(st.bytes_done)
                self.reshard_planned.labels(job_id).set(st.bytes_total)
                if st.state in ("done", "failed"):
                    self.reshard_finished.labels(st.state).inc()
                    with self._lock:
                        self._jobs[job_id] = now

    def render(self) -> bytes:
        try:
            self.refresh()
        except Exception:  # noqa: BLE001 - a scrape answers with what it has
            log.exception("metrics refresh failed")
        return generate_latest(self.registry)
