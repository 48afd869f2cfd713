"""Reshard jobs: the service's background conversions and Kubernetes work units.

Service jobs (``POST /v1/reshard``): :func:`submit_job` validates, leases the
source, records ``jobs/<id>.json`` in storage and hands the job to a worker
process, which runs :func:`run_service_job` at low CPU and I/O priority with a
bandwidth cap, so trainer uploads keep priority. Status lives in storage, so
any replica answers ``GET /v1/jobs/<id>``.

Kubernetes (``ckptd reshard --write-plan URI`` then one ``ckptd
reshard-worker --plan URI --index I`` per pod): :func:`write_job` stores the
plan and opens the output session; each worker runs one unit and records its
result beside the plan; whichever worker sees every result finalizes (the
commit is idempotent, so two finalizers are harmless).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Callable

import fsspec
from pydantic import BaseModel, ConfigDict

from ckptd_schemas import AlreadyCommitted, CheckpointNotFound, CkptdError, parse_ref

from ..storage import Storage
from ..store.tiers import open_root
from ..store import CheckpointReader, SessionStore
from .executor import UnitResult, finalize, open_target, plan_device, plan_engine, run_unit
from ..store.leases import Leases
from .models import JobStatus, ReshardRequest, get_job, now_utc, put_plan_summary, put_status
from .planner import ReshardPlan, plan_reshard
from .preview import plan_summary
from .spec import default_out_name, parse_spec

__all__ = ["JobStatus", "ReshardRequest", "WorkerJob", "get_job", "run_service_job", "run_worker", "submit_job",
           "write_job"]

log = logging.getLogger("ckptd.reshard")


def submit_job(storage: Storage, req: ReshardRequest) -> tuple[JobStatus, ReshardPlan]:
    """Validate and plan (no data I/O), lease the source, record the job as queued."""
    spec = parse_spec(req.to)
    src = parse_ref(req.source)
    reader = CheckpointReader(storage)
    manifest = reader.manifest(src.run, src.name)
    plan = plan_reshard(manifest, spec, dtype=req.dtype, min_units=req.jobs)
    out = req.out or f"{manifest.run}/{default_out_name(manifest.name, str(spec), req.dtype)}"
    o = parse_ref(out)
    if reader.visibility.marker(o.run, o.name) is not None:  # taken, visible or not
        raise AlreadyCommitted(f"output {out} is already committed; committed checkpoints are immutable (pass another "
                               f"--out)", ref=out)
    job_id = uuid.uuid4().hex
    Leases(storage).acquire(manifest.run, manifest.name, job_id, ttl=300)
    now = now_utc()
    st = JobStatus(id=job_id, state="queued", source=manifest.ref, out=out, spec=str(spec),
                   bytes_total=plan.bytes_to_write, created_at=now, updated_at=now)
    put_plan_summary(storage, job_id, plan_summary(plan))  # the web view reads it; nothing plans the job again
    put_status(storage, st)
    return st, plan


def run_service_job(root: str, job_id: str, plan_json: str, request_json: str, max_bytes_per_s: float) -> None:
    """Body of a service worker process: run the job, keep its status fresh, and hold the source's
    lease (the one :func:`submit_job` took) by a renewing thread until the job ends, however long
    a single read or write of it takes."""
    storage = open_root(root)
    st = get_job(storage, job_id)
    plan = ReshardPlan.model_validate_json(plan_json)
    req = ReshardRequest.model_validate_json(request_json)
    reader, sessions = CheckpointReader(storage), SessionStore(storage)
    src = parse_ref(st.source)
    leases = Leases(storage)
    lock = threading.Lock()
    done = [0]
    last = [0.0]
    throttle = _Throttle(max_bytes_per_s)

    def progress(n: int) -> None:
        throttle.spend(n)
        with lock:
            done[0] += n
            if time.monotonic() - last[0] > 0.5:
                last[0] = time.monotonic()
                put_status(storage, st.model_copy(update={"state": "running", "bytes_done": done[0],
                                                           "updated_at": now_utc()}))

    put_status(storage, st := st.model_copy(update={"state": "running", "updated_at": now_utc()}))
    try:
        with leases.hold(src.run, src.name, "reshard", holder=job_id):
            # The final status is written while the lease is held: a job seen queued or running
            # always holds its source's lease.
            put_status(storage, _finished(st, lambda: _run(reader, sessions, plan, st.out, req, progress), job_id))
    except Exception as e:  # noqa: BLE001 - the lease could not be taken: recorded for the caller
        put_status(storage, _failed(st, e, job_id))
    finally:
        leases.release(src.run, src.name, job_id)  # a job that failed before its hold began


def _run(reader: CheckpointReader, sessions: SessionStore, plan: ReshardPlan, out: str, req: ReshardRequest,
         progress: Callable[[int], None]) -> Any:
    from .executor import run_plan

    return run_plan(reader, sessions, plan, out, uuid.uuid4().hex, device=req.device, jobs=req.jobs,
                    progress=progress)


def _finished(st: JobStatus, run: Callable[[], Any], job_id: str) -> JobStatus:
    """The job's final status: done with its result, or failed with the error ``run`` raised."""
    try:
        res = run()
    except Exception as e:  # noqa: BLE001 - recorded for the caller
        return _failed(st, e, job_id)
    return st.model_copy(update={
        "state": "done", "bytes_done": st.bytes_total, "updated_at": now_utc(),
        "result": {"ref": res.ref, "manifest_xxh3": res.manifest_xxh3, "units": res.units,
                   "bytes_read": res.bytes_read, "bytes_written": res.bytes_written,
                   "seconds": round(res.seconds, 3),
                   "engine": {"device": res.device, "reason": res.reason, "impl": res.engine}}})


def _failed(st: JobStatus, e: Exception, job_id: str) -> JobStatus:
    if not isinstance(e, CkptdError):
        log.error("reshard job %s failed", job_id, exc_info=e)
        e = CkptdError(f"internal error: {type(e).__name__}: {e}")
    return st.model_copy(update={"state": "failed", "updated_at": now_utc(), "error": e.to_body()["error"]})


class _Throttle:
    """Token bucket: conversion I/O never exceeds ``rate`` bytes/s (0 = unlimited)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.t0 = time.monotonic()
        self.spent = 0

    def spend(self, n: int) -> None:
        if self.rate <= 0:
            return
        self.spent += n
        ahead = self.spent / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            time.sleep(ahead)


# -- Kubernetes Indexed Job ---------------------------------------------------------------------

class WorkerJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str
    out: str
    session: str
    device: str
    plan: ReshardPlan


def write_job(uri: str, plan: ReshardPlan, out: str, session: str, device: str, sessions: SessionStore) -> None:
    open_target(sessions, plan, out, session)
    doc = WorkerJob(root=sessions.storage.url, out=out, session=session, device=device, plan=plan)
    with fsspec.open(uri, "w") as f:
        f.write(doc.model_dump_json())


def run_worker(uri: str, index: int, *, root: str | None = None) -> dict[str, Any]:
    with fsspec.open(uri, "r") as f:
        job = WorkerJob.model_validate_json(f.read())
    if not 0 <= index < len(job.plan.units):
        raise CheckpointNotFound(f"plan {uri} has units 0..{len(job.plan.units) - 1}, not {index}", index=index)
    storage = open_root(root or job.root)
    reader, sessions = CheckpointReader(storage), SessionStore(storage)

    def committed() -> str | None:  # the output's digest when this job's own session committed it
        r = parse_ref(job.out)
        m = reader.marker(r.run, r.name)
        return m.manifest_xxh3 if m is not None and m.session == job.session else None

    if (digest := committed()) is not None:  # a retried pod after the commit: nothing left to do
        return {"unit": index, "committed": digest}
    choice = plan_device(job.plan, job.device)  # per pod: each may or may not have a GPU
    engine = plan_engine(job.plan, choice)
    res = run_unit(reader, sessions, job.plan, job.plan.units[index], job.out, job.session, engine=engine)
    fs, base = fsspec.url_to_fs(uri)
    fs.makedirs(f"{base}.units", exist_ok=True)
    fs.pipe_file(f"{base}.units/{index:06d}.json", res.model_dump_json().encode())
    out: dict[str, Any] = {"unit": index, "file": res.file, "bytes_written": res.bytes_written,
                           "engine": {"device": choice.device, "reason": choice.reason, "impl": engine.name}}
    names = fs.ls(f"{base}.units", detail=False)
    if len(names) == len(job.plan.units):
        results = [UnitResult.model_validate_json(fs.cat_file(n)) for n in sorted(names)]
        try:
            out["committed"] = finalize(reader, sessions, job.plan, results, job.out, job.session)
        except AlreadyCommitted:  # two workers finished together and the other one committed first
            if (digest := committed()) is None:
                raise
            out["committed"] = digest
    return out


