"""The replica's part in job recovery: its heartbeat while its pool holds jobs, and the sweep that takes
over reshard jobs and drills whose replica stopped (``ckptd.reshard.recovery``: a drill is resumed, a
reshard job failed).

Call order: ``create_app`` builds one :class:`JobWatch`; the reshard and drill routes, and the drill
policy, call :meth:`JobWatch.owner` before they record a job (the heartbeat is written before a record
names this replica), then :meth:`JobWatch.submit` (the one runner, ``reshard.jobs.run_job``, in the
pool); a status read passes the record through :meth:`JobWatch.check`;
the lifespan calls :meth:`JobWatch.start` (a thread: heartbeat when jobs are held, then a sweep, every
``CKPTD_JOB_HEARTBEAT_SECONDS``) and, at shutdown, :meth:`JobWatch.stop` (the heartbeat deleted, so
another replica, or this one restarted, takes the jobs over without waiting for it to age).

A job whose worker process died while the service lives (its future raised before the worker wrote a
final record, e.g. the pool broke) is failed here at once, and so is a job the pool refused.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Future
from typing import Callable

from ckptd_schemas import CkptdError, NotFound, Unavailable

from ..reshard.liveness import Kind, active, beat, finish, forget, listed_at
from ..reshard.models import FINAL, JobStatus, get_job, now_utc, put_status
from ..reshard.recovery import orphaned, take_over
from ..storage import Storage
from .settings import Settings
from .workers import Workers

__all__ = ["JobWatch"]

log = logging.getLogger("ckptd.service")


class JobWatch:
    """This replica's heartbeat, its jobs in flight, and the sweep (module docstring)."""

    def __init__(self, storage: Storage, workers: Workers, settings: Settings,
                 on_drill: Callable[[str], Callable[[Future], None]] | None = None) -> None:
        self.storage, self.workers = storage, workers
        self.replica = uuid.uuid4().hex[:16]  # a new owner per start: a restarted service takes its old jobs over
        self.every, self.after = settings.job_heartbeat_seconds, settings.job_takeover_seconds
        self.rate = settings.reshard_max_mbps * (1 << 20)  # bytes/s a job's reads and writes may take
        self.on_drill = on_drill  # a done-callback for a drill's future, per job id (counts it)
        self._mine: set[str] = set()  # jobs queued in this replica's pool whose future has not ended
        self._beaten = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the routes ----------------------------------------------------------------------------------
    def owner(self) -> str:
        """This replica's id, its heartbeat renewed now: call it before a record names it."""
        beat(self.storage, self.replica)
        self._beaten = True
        return self.replica

    def submit(self, job: JobStatus) -> Future:
        """Queue the runner of ``job`` (``run_job``) in the pool and follow it; its future gives the final
        record as a dict. A pool that refuses it fails the job at once (and raises)."""
        from ..reshard.jobs import run_job  # torch loads on first use, not at start-up

        try:
            fut = self.workers().submit(run_job, self.storage.url, job.id, self.rate)
        except Exception as e:
            self._fail_if_pending(job.id, f"the service could not queue it ({type(e).__name__}: {e})")
            raise
        with self._lock:
            self._mine.add(job.id)
        fut.add_done_callback(lambda f: self._ended(job.id, f))
        return fut

    def read(self, job_id: str, kind: Kind | None = None) -> JobStatus:
        """A status read (of ``kind``, when given): the record as read, or after a takeover when its
        replica has stopped."""
        job = get_job(self.storage, job_id, kind)
        if job.state in FINAL or job.owner == self.replica or orphaned(self.storage, job, after=self.after) is None:
            return job
        return self._take_over(job) or get_job(self.storage, job_id)

    # -- the thread ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ckptd-job-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and delete the heartbeat (best effort: a root that cannot be written keeps it,
        and it ages out)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._beaten:
            try:
                forget(self.storage, self.replica)
            except CkptdError as e:
                log.warning("job heartbeat of replica %s not deleted: %s", self.replica, e.message)

    def _run(self) -> None:
        while True:
            try:
                with self._lock:
                    holding = bool(self._mine)
                if holding:
                    self.owner()
                self.sweep()
            except CkptdError as e:  # the store failed: the next round tries again
                log.warning("job sweep skipped: %s", e.message)
            except Exception:  # noqa: BLE001 - a failed round must not stop the watch
                log.exception("job sweep failed")
            if self._stop.wait(self.every):
                return

    def sweep(self) -> list[JobStatus]:
        """Take over every listed job whose replica stopped; the new records."""
        out = []
        for kind, job_id in active(self.storage):
            if self._stop.is_set():
                break
            try:
                job = get_job(self.storage, job_id, kind)
            except NotFound:  # listed, never recorded: a submission that stopped between the two writes
                at = listed_at(self.storage, kind, job_id)
                if at is None or now_utc().timestamp() - at > self.after:
                    finish(self.storage, kind, job_id)
                continue
            if job.state in FINAL:
                finish(self.storage, kind, job_id)  # its worker stopped between the record and the index
            elif job.owner != self.replica and orphaned(self.storage, job, after=self.after) is not None:
                if (new := self._take_over(job)) is not None:
                    out.append(new)
        return out

    # -- takeover ------------------------------------------------------------------------------------
    def _take_over(self, job: JobStatus) -> JobStatus | None:
        self.owner()  # fresh before the new record names this replica
        new = take_over(self.storage, job.kind, job.id, self.replica, after=self.after)
        if new is not None and new.state == "queued":  # a drill resumed: run it here
            fut = self.submit(new)
            if self.on_drill is not None:
                fut.add_done_callback(self.on_drill(job.id))
        return new

    def _ended(self, job_id: str, fut: Future) -> None:
        with self._lock:
            self._mine.discard(job_id)
        if fut.cancelled():  # the pool shut down with it queued: taken over like any job of a stopped replica
            return
        e = fut.exception()
        if e is not None:
            try:
                self._fail_if_pending(job_id, f"its worker process stopped ({type(e).__name__}: {e})")
            except Exception:  # noqa: BLE001 - a callback of the pool: logged, never raised
                log.exception("job %s: could not record its failure", job_id)

    def _fail_if_pending(self, job_id: str, why: str) -> None:
        """Fail job ``job_id`` when its record is still this replica's and not final."""
        job = get_job(self.storage, job_id)
        if job.state in FINAL or job.owner != self.replica:
            return
        err = Unavailable(f"{why}; submit it again", job=job_id)
        put_status(self.storage, job.model_copy(update={"state": "failed", "updated_at": now_utc(),
                                                        "error": err.to_body()["error"]}))
        finish(self.storage, job.kind, job_id)
        log.warning("%s job %s failed: %s", job.kind, job_id, why)
