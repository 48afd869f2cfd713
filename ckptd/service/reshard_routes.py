"""Reshard job routes: ``POST /v1/reshard`` (202 + job id), ``GET /v1/jobs/{id}``, preview.

All three need the ``admin`` scope (``auth.ROUTE_RULES``).

Jobs run in a small pool of worker processes beside the upload handlers;
each worker lowers its CPU and I/O priority and caps its bandwidth
(``CKPTD_RESHARD_MAX_MBPS``), so saves keep priority.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Callable

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from ..reshard.models import JobStatus, ReshardRequest
from ..storage import Storage
from .settings import Settings

if TYPE_CHECKING:
    from .metrics import Metrics

__all__ = ["reshard_router"]


def _exit_with_parent(parent: int) -> None:
    """Worker initializer: a worker whose service died (even by SIGKILL) exits too."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="ckptd-parent-watch", daemon=True).start()


def reshard_router(storage: Storage, settings: Settings, metrics: "Metrics | None" = None
                   ) -> tuple[APIRouter, Callable[[], None], Callable[[], ProcessPoolExecutor]]:
    """The routes, a ``close`` for the service's shutdown (stops the worker processes), and the
    worker pool (started on first use), which the service's verifications share."""
    router = APIRouter(tags=["reshard"])
    pool: list[ProcessPoolExecutor] = []

    def executor() -> ProcessPoolExecutor:
        if not pool:
            pool.append(ProcessPoolExecutor(settings.reshard_workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_exit_with_parent, initargs=(os.getpid(),)))
        return pool[0]

    def close() -> None:
        if pool:
            pool.pop().shutdown(wait=False, cancel_futures=True)

    @router.post("/v1/reshard", status_code=202, response_model=JobStatus)
    async def create_job(body: ReshardRequest, response: Response) -> JobStatus:
        from ..reshard.jobs import run_service_job, submit_job  # torch loads on first use, not at start-up

        st, plan = await run_in_threadpool(submit_job, storage, body)
        executor().submit(run_service_job, storage.url, st.id, plan.model_dump_json(), body.model_dump_json(),
                          settings.reshard_max_mbps * (1 << 20))
        if metrics is not None:
            metrics.track_job(storage, st.id)
        response.headers["Location"] = f"/v1/jobs/{st.id}"
        return st

    @router.post("/v1/reshard/preview")
    async def preview_job(body: ReshardRequest) -> dict:
        from ckptd_schemas import parse_ref

        from ..reshard.planner import plan_reshard
        from ..reshard.preview import preview
        from ..reshard.spec import parse_spec
        from ..store import CheckpointReader

        def run() -> dict:
            src = parse_ref(body.source)
            manifest = CheckpointReader(storage).manifest(src.run, src.name)
            return asdict(preview(plan_reshard(manifest, parse_spec(body.to), dtype=body.dtype)))

        return await run_in_threadpool(run)

    @router.get("/v1/jobs/{job_id}", response_model=JobStatus)
    async def job_status(job_id: str) -> JobStatus:
        from ..reshard.models import get_job

        return await run_in_threadpool(get_job, storage, job_id)

    return router, close, executor
