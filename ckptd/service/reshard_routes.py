"""Reshard job routes: ``POST /v1/reshard`` (202 + job id), ``GET /v1/jobs/{id}`` (any job: a reshard
job or a drill), preview.

All three need the ``admin`` scope (``auth.ROUTE_RULES``).

Jobs run in the service's pool of worker processes (:mod:`.workers`, at low CPU
and I/O priority) beside the upload handlers, each capping its bandwidth
(``CKPTD_RESHARD_MAX_MBPS``), so saves keep priority. Each job record names the replica that
queued it; a job whose replica stopped while it was queued or running is failed by a live replica
("the service stopped while this job ran"), or marked done when its output had committed
(:mod:`.job_watch`, ``ckptd.reshard.recovery``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from ..reshard.models import JobStatus, ReshardRequest
from ..storage import Storage

if TYPE_CHECKING:
    from .job_watch import JobWatch
    from .metrics import Metrics

__all__ = ["reshard_router"]


def reshard_router(storage: Storage, watch: "JobWatch", metrics: "Metrics") -> APIRouter:
    """The routes; jobs run in the service's worker pool (:class:`~.workers.Workers`) through ``watch``."""
    router = APIRouter(tags=["reshard"])

    @router.post("/v1/reshard", status_code=202, response_model=JobStatus)
    async def create_job(body: ReshardRequest, response: Response) -> JobStatus:
        from ..reshard.jobs import submit_job  # torch loads on first use, not at start-up

        st = await run_in_threadpool(submit_job, storage, body, watch.owner)
        watch.submit(st)
        metrics.track_job(storage, st.id)
        response.headers["Location"] = f"/v1/jobs/{st.id}"
        return st

    @router.post("/v1/reshard/preview")
    def preview_job(body: ReshardRequest) -> dict:  # plans on FastAPI's thread pool
        from ckptd_schemas import parse_ref

        from ..reshard.planner import plan_reshard
        from ..reshard.preview import preview
        from ..reshard.spec import parse_spec
        from ..store import CheckpointReader

        src = parse_ref(body.source)
        manifest = CheckpointReader(storage).manifest(src.run, src.name)
        return asdict(preview(plan_reshard(manifest, parse_spec(body.to), dtype=body.dtype)))

    @router.get("/v1/jobs/{job_id}", response_model=JobStatus)
    def job_status(job_id: str) -> JobStatus:
        """The job, of either kind (a reshard job or a drill); one whose replica stopped is taken over
        first (module docstring). Read on FastAPI's thread pool."""
        return watch.read(job_id)

    return router
