"""Reshard job records (pydantic, no torch): requests, status, and their place in storage."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ckptd_schemas import NotFound

from ..storage import Storage

__all__ = ["JobStatus", "ReshardRequest", "get_job", "get_plan_summary", "now_utc", "put_plan_summary", "put_status"]


class ReshardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(description="RUN/NAME or RUN/latest")
    to: str = Field(description="target layout spec")
    out: str | None = Field(None, description="output ref (default RUN/NAME-<spec>)")
    dtype: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    jobs: int = Field(2, ge=1, le=64)


class JobStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    state: Literal["queued", "running", "done", "failed"]
    source: str
    out: str
    spec: str
    bytes_total: int = 0
    bytes_done: int = 0
    created_at: datetime
    updated_at: datetime
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    owner: str | None = Field(None, description="the service replica whose worker pool holds the job (its heartbeat: "
                                                "jobs/replicas/OWNER.json; ckptd.reshard.recovery)")
    session: str | None = Field(None, description="the output's upload session, once the job runs")


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
    get_job(storage, job_id)  # the same refusals for an unknown or malformed id
    data = storage.read_json_or_none(_plan_key(job_id))
    if data is None:
        raise NotFound(f"reshard job {job_id!r} has no recorded plan (planned before plans were recorded)",
                       job=job_id)
    return data


def get_job(storage: Storage, job_id: str) -> JobStatus:
    if not job_id.isalnum() or len(job_id) > 64:
        raise NotFound(f"no reshard job {job_id!r}", job=job_id[:64])
    data = storage.read_json_or_none(_job_key(job_id))
    if data is None:
        raise NotFound(f"no reshard job {job_id!r}", job=job_id)
    return JobStatus.model_validate(data)


