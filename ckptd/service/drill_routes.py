"""Conversion drills through the service: the routes, and the policy that drills every N commits.

::

    POST /v1/drill                               submit a drill job: 202 + the job (admin)
    GET  /v1/drills/{job_id}                     the job: queued, running, done (with the record) or failed (admin)
    GET  /v1/checkpoints/{run}/{name}/drill      the last drill recorded for the manifest committed there (read)

A drill (``ckptd.reshard.drill``) reads a committed checkpoint, assembles every target chunk of each
layout and compares every tensor's layout-independent digest with the source's; it writes only its
record (``runs/RUN/NAME/DRILL.json``). Jobs run in the service's worker pool (the reshard jobs'
processes, at low CPU and I/O priority), so saves keep priority. The submission plans every layout
first: a spec that does not parse, or a layout the checkpoint cannot take, is refused 400 and nothing
is queued or written.

The policy (:class:`DrillPolicy`, ``CKPTD_DRILL_EVERY`` = N > 0): every N-th commit of a trainer
checkpoint of a run (derived checkpoints do not count; counted by this replica since it started)
submits a drill of ``RUN/latest`` into ``CKPTD_DRILL_LAYOUTS`` to the same pool; a run whose previous
drill has not finished skips its turn. Every drill that ends here, job or policy, counts in
``ckptd_drills_total{result="ok"|"failed"}`` (failed: a problem found, or the drill could not run).

A drill job names the replica that queued it; one whose replica stopped (SIGKILL, a crash, a shutdown)
while it was queued or running is resumed by a live replica, this one restarted included
(:mod:`.job_watch`, ``ckptd.reshard.recovery``). A policy drill keeps no job record and is not resumed:
the next commits drill again.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from ckptd_schemas import NotFound

from ..reshard.drill import DrillJob, DrillRecord, DrillRequest
from ..reshard.drill_layouts import split_layouts
from ..storage import Storage
from ..store.events import CommitEvent
from .settings import Settings
from .workers import Workers

if TYPE_CHECKING:
    from .job_watch import JobWatch
    from .metrics import Metrics

__all__ = ["DrillPolicy", "count_drill", "drill_router"]

log = logging.getLogger("ckptd.service")


def count_drill(metrics: "Metrics", what: str) -> Callable[[Future], None]:
    """A done-callback for a drill's future: counts it ok or failed (an error that stopped it is failed)."""
    def done(fut: Future) -> None:
        try:
            rec = fut.result()
            ok = bool(rec.get("ok"))
            if not ok:
                first = next((p for x in rec.get("layouts", []) for p in x.get("problems", [])), {})
                log.warning("drill of %s failed: layout %s: tensor %s: %s", rec.get("ref"), first.get("layout"),
                            first.get("tensor"), first.get("message"))
        except Exception as e:  # noqa: BLE001 - the drill could not run: counted, logged
            ok = False
            log.warning("drill (%s) could not run: %s", what, getattr(e, "message", e))
        metrics.observe_drill(ok)
    return done


class DrillPolicy:
    """``CKPTD_DRILL_EVERY``: its ``after_commit`` observes the session store's commits (module docstring)."""

    def __init__(self, storage: Storage, settings: Settings, workers: Workers,
                 metrics: "Metrics") -> None:
        self.storage, self.every, self.workers, self.metrics = storage, settings.drill_every, workers, metrics
        self.layouts = split_layouts(settings.drill_layouts)
        self.counts: dict[str, int] = {}  # run -> trainer commits since its last drill
        self.running: set[str] = set()  # runs whose drill has not finished
        self.lock = threading.Lock()

    def after_commit(self, ev: CommitEvent) -> None:
        if self.every <= 0 or ev.derived_from is not None:
            return
        with self.lock:
            n = self.counts.get(ev.run, 0) + 1
            self.counts[ev.run] = n % self.every
            if n < self.every:
                return
            if ev.run in self.running:
                log.info("drill of %s/latest skipped: the previous one is still running", ev.run)
                return
            self.running.add(ev.run)
        from ..reshard.drill import run_drill_job

        try:
            fut = self.workers().submit(run_drill_job, self.storage.url, f"{ev.run}/latest", self.layouts)
        except BaseException:
            with self.lock:
                self.running.discard(ev.run)
            raise
        count = count_drill(self.metrics, f"{ev.run}/latest, policy")

        def done(f: Future) -> None:
            with self.lock:
                self.running.discard(ev.run)
            count(f)

        fut.add_done_callback(done)


def drill_router(storage: Storage, watch: "JobWatch", metrics: "Metrics") -> APIRouter:
    """The routes; jobs run in the service's worker pool through ``watch`` (which names this replica in
    each record and takes over the drills of replicas that stopped)."""
    router = APIRouter(tags=["drill"])

    @router.post("/v1/drill", status_code=202, response_model=DrillJob)
    async def create_drill(body: DrillRequest, response: Response) -> DrillJob:
        """Plan every layout (400 for a bad spec or a layout this checkpoint cannot take, nothing written),
        then run the drill in a worker process; follow it at ``GET /v1/drills/{id}``."""
        from ..reshard.drill import run_drill_job, submit_drill_job

        job = await run_in_threadpool(submit_drill_job, storage, body, watch.owner)
        fut = watch.submit("drill", job.id, run_drill_job, storage.url, job.source, job.layouts, job.jobs, job.id)
        fut.add_done_callback(count_drill(metrics, f"job {job.id}"))
        response.headers["Location"] = f"/v1/drills/{job.id}"
        return job

    @router.get("/v1/drills/{job_id}", response_model=DrillJob)
    async def drill_status(job_id: str) -> DrillJob:
        """The job; one whose replica stopped is resumed first (module docstring)."""
        from ..reshard.drill import get_drill_job

        def read() -> DrillJob:
            job = watch.check("drill", get_drill_job(storage, job_id))
            assert isinstance(job, DrillJob)
            return job

        return await run_in_threadpool(read)

    @router.get("/v1/checkpoints/{run}/{name}/drill", response_model=DrillRecord)
    async def get_drill(run: str, name: str) -> DrillRecord:
        """The last drill recorded for this checkpoint (404 when none is about the manifest committed here)."""
        from ..reshard.drill import read_record

        rec = await run_in_threadpool(read_record, storage, run, name)
        if rec is None:
            raise NotFound(f"checkpoint {run}/{name} has no drill recorded", ref=f"{run}/{name}")
        return rec

    return router
