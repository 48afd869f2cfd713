"""Service job records (pydantic, no torch): the requests, the one job record, and its place in storage.

One record (:class:`JobStatus`) for every job the service runs in its worker pool: a reshard job
(``kind="reshard"``, ``POST /v1/reshard``) and a conversion drill (``kind="drill"``, ``POST /v1/drill``
or the service's drill policy). Both are stored at ``jobs/<id>.json``, submitted by
``jobs.enqueue``, run by the one runner ``jobs.run_job`` and recovered by ``recovery``; the kind
decides only what the job does (convert and commit, or assemble and hash) and what a stopped one
becomes (failed, or resumed).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ckptd_schemas import NotFound

from ..storage import Storage
from .liveness import Kind

__all__ = ["FINAL", "DrillRequest", "JobStatus", "MAX_LAYOUTS", "ReshardRequest", "get_job", "get_plan_summary", "now_utc", "put_plan_summary", "put_status"]


#: The states a job does not leave.
FINAL = ("done", "failed")
#: Layouts one drill may ask for.
MAX_LAYOUTS = 16


class ReshardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(description="RUN/NAME or RUN/latest")
    to: str = Field(description="target layout spec")
    out: str | None = Field(None, description="output ref (default RUN/NAME-<spec>)")
    dtype: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    jobs: int = Field(2, ge=1, le=64)


class DrillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(description="RUN/NAME or RUN/latest")
    to: list[str] = Field(min_length=1, max_length=MAX_LAYOUTS,
                          description="layouts: specs (full, fsdp2:dp=4, ...) or half / double (the source's "
                                      "data-parallel degree halved or doubled, as fsdp2)")
    jobs: int = Field(1, ge=1, le=64, description="tensors assembled at once")


class JobStatus(BaseModel):
    """A service job: a reshard job or a conversion drill (``kind``), queued, running, done or failed."""

    model_config = ConfigDict(extra="forbid")
    id: str
    kind: Kind = "reshard"
    state: Literal["queued", "running", "done", "failed"]
    source: str
    out: str | None = Field(None, description="reshard: the output checkpoint")
    spec: str | None = Field(None, description="reshard: the target layout")
    layouts: list[str] = Field([], description="drill: the layouts, as asked")
    request: dict[str, Any] = Field({}, description="the request as submitted (what the worker runs)")
    bytes_total: int = 0
    bytes_done: int = 0
    created_at: datetime
    updated_at: datetime
    result: dict[str, Any] | None = Field(None, description="once done: a reshard's output and figures, or the "
                                                            "drill's record (ok says whether the drill passed)")
    error: dict[str, Any] | None = Field(None, description="why the job could not run (state failed)")
    owner: str | None = Field(None, description="the service replica whose worker pool holds the job (its heartbeat: "
                                                "jobs/replicas/OWNER.json; ckptd.reshard.recovery)")
    attempts: int = Field(1, ge=1, description="starts: more than 1 when a drill was resumed after its service "
                                               "stopped")
    session: str | None = Field(None, description="reshard: the output's upload session, once the job runs")


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def _job_key(job_id: str) -> str:
    return f"jobs/{job_id}.json"


def put_status(storage: Storage, st: JobStatus) -> None:
    storage.put(_job_key(st.id), st.model_dump_json().encode())


def _plan_key(job_id: str) -> str:
    return f"jobs/{job_id}.plan.json"


def put_plan_summary(storage: Storage, job_id: str, summary: dict) -> None:
    """What a job's plan is (``preview.plan_summary``), recorded once when the job is planned: readers
    (the web view) read it, and never make the service plan the job again."""
    storage.put(_plan_key(job_id), json.dumps(summary, separators=(",", ":")).encode())


def get_plan_summary(storage: Storage, job_id: str) -> dict:
    get_job(storage, job_id, "reshard")  # the same refusals for an unknown or malformed id
    data = storage.read_json_or_none(_plan_key(job_id))
    if data is None:
        raise NotFound(f"reshard job {job_id!r} has no recorded plan (planned before plans were recorded)",
                       job=job_id)
    return data


def get_job(storage: Storage, job_id: str, kind: Kind | None = None) -> JobStatus:
    """Job ``job_id``'s record; :class:`NotFound` when there is none (of ``kind``, when given)."""
    what = f"{kind} job" if kind is not None else "job"
    if not job_id.isalnum() or len(job_id) > 64:
        raise NotFound(f"no {what} {job_id!r}", job=job_id[:64])
    data = storage.read_json_or_none(_job_key(job_id))
    if data is None:
        raise NotFound(f"no {what} {job_id!r}", job=job_id)
    job = JobStatus.model_validate(data)
    if kind is not None and job.kind != kind:
        raise NotFound(f"no {what} {job_id!r} (it is a {job.kind} job)", job=job_id)
    return job


