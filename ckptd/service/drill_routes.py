"""Conversion drills through the service: the routes, and the policy that drills every N commits.

::

    POST /v1/drill                               submit a drill job: 202 + the job (admin), followed at
                                                 GET /v1/jobs/{job_id}: queued, running, done (with the record) or failed
    GET  /v1/drills/{job_id}                     deprecated (removed in 0.2.0): the same, for a drill job only
    GET  /v1/checkpoints/{run}/{name}/drill      the last drill recorded for the manifest committed there (read)

A drill (what it checks and the one record it writes: ``ckptd.reshard.drill``) is a service job like a
reshard job (``ckptd.reshard.jobs``: one record, kind ``drill``, run in the service's worker pool at low
priority). Its submission plans every layout first: a bad spec or layout is refused 400, nothing queued.

The policy (:class:`DrillPolicy`, ``CKPTD_DRILL_EVERY`` = N > 0): every N-th commit of a trainer
checkpoint of a run (derived checkpoints do not count; counted by this replica since it started)
submits a drill job of the checkpoint just committed into ``CKPTD_DRILL_LAYOUTS`` (from a thread of
its own: the commit does not wait for the job's records); a run whose previous drill has not finished
skips its turn. Every drill that ends here, job or policy, counts in
``ckptd_drills_total{result="ok"|"failed"}`` (failed: a problem found, or the drill could not run).

A drill job names the replica that queued it; one whose replica stopped (SIGKILL, a crash, a shutdown)
while it was queued or running is resumed by a live replica, this one restarted included
(:mod:`.job_watch`, ``ckptd.reshard.recovery``); a policy's drill too.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable
from urllib.parse import quote

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from ckptd_schemas import NotFound

from ..reshard.drill import DrillRecord
from ..reshard.drill_layouts import split_layouts
from ..reshard.models import DrillRequest, JobStatus
from ..storage import Storage
from ..store.events import CommitEvent
from .settings import Settings

if TYPE_CHECKING:
    from .job_watch import JobWatch
    from .metrics import Metrics

__all__ = ["DrillPolicy", "count_drill", "drill_router"]

log = logging.getLogger("ckptd.service")


def count_drill(metrics: "Metrics", what: str) -> Callable[[Future], None]:
    """A done-callback for a drill job's future (its final record): counts it ok or failed (a problem
    found, the drill could not run, or its worker stopped)."""
    def done(fut: Future) -> None:
        try:
            job = fut.result()
            rec = job.get("result") or {}
            ok = job.get("state") == "done" and bool(rec.get("ok"))
            if job.get("state") == "failed":
                log.warning("drill (%s) could not run: %s", what, (job.get("error") or {}).get("message"))
            elif not ok:
                first = next((p for x in rec.get("layouts", []) for p in x.get("problems", [])), {})
                log.warning("drill of %s failed: layout %s: tensor %s: %s", rec.get("ref"), first.get("layout"),
                            first.get("tensor"), first.get("message"))
        except Exception as e:  # noqa: BLE001 - its worker stopped: counted, logged
            ok = False
            log.warning("drill (%s) could not run: %s", what, getattr(e, "message", e))
        metrics.observe_drill(ok)
    return done


class DrillPolicy:
    """``CKPTD_DRILL_EVERY``: its ``after_commit`` observes the session store's commits (module docstring)."""

    def __init__(self, storage: Storage, settings: Settings, watch: "JobWatch", metrics: "Metrics") -> None:
        self.storage, self.every, self.watch, self.metrics = storage, settings.drill_every, watch, metrics
        self.layouts = split_layouts(settings.drill_layouts)
        self.counts: dict[str, int] = {}  # run -> trainer commits since its last drill
        self.running: set[str] = set()  # runs whose drill has not finished
        self.lock = threading.Lock()
        self._submitter = ThreadPoolExecutor(1, thread_name_prefix="ckptd-drill-policy")
        self._closed = False

    def close(self) -> None:
        """At the service's shutdown: no drill is queued from now on, and one not yet recorded never is
        (its commit's run drills at its next turn, here or at another replica)."""
        with self.lock:
            self._closed = True
        self._submitter.shutdown(wait=False, cancel_futures=True)

    def after_commit(self, ev: CommitEvent) -> None:
        if self.every <= 0 or ev.derived_from is not None:
            return
        with self.lock:
            if self._closed:
                return
            n = self.counts.get(ev.run, 0) + 1
            self.counts[ev.run] = n % self.every
            if n < self.every:
                return
            if ev.run in self.running:
                log.info("drill of %s/%s skipped: the previous one is still running", ev.run, ev.name)
                return
            self.running.add(ev.run)
            self._submitter.submit(self._submit, ev)  # under the lock: never after close() shut it down

    def _submit(self, ev: CommitEvent) -> None:
        """Record the drill job and queue it; the run's turn ends when the job does."""
        from ..reshard.jobs import enqueue

        ref = f"{ev.run}/{ev.name}"
        try:
            job = enqueue(self.storage, uuid.uuid4().hex, "drill", ref, self.watch.owner,
                          request=DrillRequest(source=ref, to=self.layouts).model_dump(mode="json"),
                          layouts=self.layouts)
            fut = self.watch.submit(job)
        except Exception:  # noqa: BLE001 - the store or the pool refused: the next turn drills again
            log.exception("drill of %s could not be queued", ref)
            with self.lock:
                self.running.discard(ev.run)
            return
        count = count_drill(self.metrics, f"{ref}, policy")

        def done(f: Future) -> None:
            with self.lock:
                self.running.discard(ev.run)
            count(f)

        fut.add_done_callback(done)


def drill_router(storage: Storage, watch: "JobWatch", metrics: "Metrics") -> APIRouter:
    """The routes; jobs run in the service's worker pool through ``watch`` (which names this replica in
    each record and takes over the drills of replicas that stopped)."""
    router = APIRouter(tags=["drill"])

    @router.post("/v1/drill", status_code=202, response_model=JobStatus)
    async def create_drill(body: DrillRequest, response: Response) -> JobStatus:
        """Plan every layout (400 for a bad spec or a layout this checkpoint cannot take, nothing written),
        then run the drill in a worker process; follow it at ``GET /v1/jobs/{id}``."""
        from ..reshard.jobs import submit_drill

        job = await run_in_threadpool(submit_drill, storage, body, watch.owner)
        watch.submit(job).add_done_callback(count_drill(metrics, f"job {job.id}"))
        response.headers["Location"] = f"/v1/jobs/{job.id}"
        return job

    @router.get("/v1/drills/{job_id}", response_model=JobStatus, deprecated=True)
    async def drill_status(job_id: str, response: Response) -> JobStatus:
        """Deprecated, removed in 0.2.0: ``GET /v1/jobs/{id}`` answers a job of any kind. The drill job; one
        whose replica stopped is resumed first (module docstring)."""
        status = await run_in_threadpool(watch.read, job_id, "drill")  # an id that is not one: 4xx first
        response.headers["Deprecation"] = "true"
        response.headers["Link"] = f'</v1/jobs/{quote(job_id, safe="")}>; rel="successor-version"'
        return status

    @router.get("/v1/checkpoints/{run}/{name}/drill", response_model=DrillRecord)
    async def get_drill(run: str, name: str) -> DrillRecord:
        """The last drill recorded for this checkpoint (404 when none is about the manifest committed here)."""
        from ..reshard.drill import read_record

        rec = await run_in_threadpool(read_record, storage, run, name)
        if rec is None:
            raise NotFound(f"checkpoint {run}/{name} has no drill recorded", ref=f"{run}/{name}")
        return rec

    return router
