"""Service jobs (reshard jobs and conversion drills) and the Kubernetes work units of a reshard.

Service jobs: one record (``models.JobStatus``, ``jobs/<id>.json``, its ``kind`` reshard or drill),
one submission and one runner for both kinds:

1. :func:`submit_job` (``POST /v1/reshard``) or :func:`submit_drill` (``POST /v1/drill``, the drill
   policy) validates and plans without reading data (a reshard is cut into units,
   :func:`~.planner.outline_reshard`, its summary recorded; a drill plans every layout), then
   :func:`enqueue`: the owner's heartbeat, a lease on the source, the job listed as not final
   (``liveness.mark_active``), its record written queued;
2. the service hands the id to a worker process, which runs :func:`run_job` at low CPU and I/O
   priority with a bandwidth cap, so trainer uploads keep priority: the record running, the source's
   lease held by a renewing thread, the kind's body (a reshard plans each unit's reads as it runs it
   and commits its output; a drill assembles and hashes, writing only its record), progress kept in
   ``bytes_done``, and the final record (done with the result, or failed with the error) written
   while the lease is held. Status lives in storage, so any replica answers ``GET /v1/jobs/<id>``.

A job whose service stopped while it was queued or running is taken over by a live replica: a
drill is resumed, a reshard job failed (or done, when its output had committed): :mod:`.recovery`.

Kubernetes (``ckptd reshard --write-plan URI --workers N`` then ``ckptd reshard-worker
--plan URI --index I`` for I in 0..N-1, one pod each): :func:`write_job` stores which
conversion (:class:`WorkerJob`, a few hundred bytes at any world size) and opens the
output session; each worker cuts the units again, plans and runs its share (units
``i % N == I``) and records its results beside the job; whichever worker sees every
share recorded finalizes (the commit is idempotent, so two finalizers are harmless).
No process ever plans the reads of the whole job.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import fsspec
from pydantic import BaseModel, ConfigDict, Field

from ckptd_schemas import AlreadyCommitted, CheckpointNotFound, CkptdError, Manifest, parse_ref

from ..storage import Storage
from ..store.tiers import open_root
from ..store import CheckpointReader, SessionStore
from .drill import drill_bytes, drill_checkpoint, plan_drill
from .drill_layouts import check_layout
from .executor import (
    UnitResult, finalize, open_target, outline_again, plan_device, plan_engine, run_plan, run_share,
)
from ..store.leases import Leases
from .liveness import Kind, finish, mark_active
from .models import (
    FINAL, DrillRequest, JobStatus, ReshardRequest, get_job, get_plan_summary, now_utc, put_plan_summary, put_status,
)
from .planner import ReshardOutline, outline_reshard
from .preview import plan_summary
from .spec import default_out_name, parse_spec

__all__ = ["Conversion", "JobStatus", "ReshardRequest", "WorkerJob", "convert", "enqueue", "get_job", "outline_request",
           "output_ref", "plan_conversion", "run_job", "run_worker", "submit_drill", "submit_job", "write_job"]

log = logging.getLogger("ckptd.reshard")

Owner = Callable[[], str]


def output_ref(reader: CheckpointReader, req: ReshardRequest, manifest: Manifest, spec: Any) -> str:
    """The one rule for a conversion's output name (:func:`plan_conversion` asks it before any work):
    ``req.out``, or the default name for the conversion; refused (:class:`AlreadyCommitted`) when any
    marker holds it, visible or not (a name whose marker is damaged stays taken: a commit there would
    fail after converting everything)."""
    out = req.out or f"{manifest.run}/{default_out_name(manifest.name, str(spec), req.dtype)}"
    o = parse_ref(out)
    if reader.visibility.marker(o.run, o.name) is not None:
        raise AlreadyCommitted(f"output {out} is already committed (a committed name is never reused); name another "
                               f"output with --out RUN/NAME", ref=out)
    return out


@dataclass(frozen=True)
class Conversion:
    """A reshard request planned without reading data: its work units cut, its output's name taken."""

    outline: ReshardOutline
    out: str
    spec: str  # the target layout, canonical


def outline_request(reader: CheckpointReader, req: ReshardRequest) -> ReshardOutline:
    """``req``'s source cut into work units (no read planned; a bad spec is refused before any I/O)."""
    spec = parse_spec(req.to)
    src = parse_ref(req.source)
    return outline_reshard(reader.manifest(src.run, src.name), spec, dtype=req.dtype, min_units=req.jobs)


def plan_conversion(reader: CheckpointReader, req: ReshardRequest) -> Conversion:
    """The first step of every way a conversion comes in (a service job, ``ckptd reshard --root``,
    ``--write-plan``): the outline and the output's name (:func:`output_ref`), so a refusal comes
    before any work."""
    outline = outline_request(reader, req)
    spec = outline.header["target_spec"]
    return Conversion(outline, output_ref(reader, req, outline.manifest, spec), spec)


def convert(reader: CheckpointReader, outline: ReshardOutline, req: ReshardRequest, out: str, session: str, *,
            progress: Callable[[int], None] | None = None, max_bytes_per_s: float = 0.0) -> dict[str, Any]:
    """The conversion itself, every way in (a service job's body, ``ckptd reshard --root``): the units
    run and ``out`` committed by :func:`~.executor.run_plan` with the request's device and jobs; the
    result as the job records it. The caller holds a lease on the source."""
    return run_plan(reader, SessionStore(reader.storage), outline, out, session, device=req.device, jobs=req.jobs,
                    progress=progress, max_bytes_per_s=max_bytes_per_s).as_json()


# -- submission ------------------------------------------------------------------------------------

def submit_job(storage: Storage, req: ReshardRequest, owner: Owner | None = None) -> JobStatus:
    """A reshard job: :func:`plan_conversion` (no read planned, no data I/O: the worker plans each unit's
    reads as it runs it), the outline's summary recorded (the web view reads it; nothing plans the job
    again), then :func:`enqueue`."""
    conv = plan_conversion(CheckpointReader(storage), req)
    job_id = uuid.uuid4().hex
    put_plan_summary(storage, job_id, plan_summary(conv.outline))
    return enqueue(storage, job_id, "reshard", conv.outline.manifest.ref, owner, request=req.model_dump(mode="json"),
                   out=conv.out, spec=conv.spec, bytes_total=conv.outline.bytes_to_write)


def submit_drill(storage: Storage, req: DrillRequest, owner: Owner | None = None) -> JobStatus:
    """A drill job: plan every layout (no data read: a bad spec, or a layout this checkpoint cannot
    take, is refused here), then :func:`enqueue`."""
    src = parse_ref(req.source)
    manifest = CheckpointReader(storage).manifest(src.run, src.name)
    return enqueue(storage, uuid.uuid4().hex, "drill", manifest.ref, owner, request=req.model_dump(mode="json"),
                   layouts=[check_layout(x) for x in req.to], bytes_total=drill_bytes(plan_drill(manifest, req.to)))


def enqueue(storage: Storage, job_id: str, kind: Kind, source: str, owner: Owner | None,
            **fields: Any) -> JobStatus:
    """Record a valid job of checkpoint ``source`` (RUN/NAME, resolved) as queued: ``owner`` (a service's)
    is called first, before anything names it (it renews the replica's heartbeat and returns its id,
    :mod:`.recovery`); the source leased under the job's id (the worker takes the lease over); the job
    listed as not final before its record."""
    replica = owner() if owner is not None else None
    src = parse_ref(source)
    Leases(storage).acquire(src.run, src.name, job_id, ttl=300)
    now = now_utc()
    job = JobStatus(id=job_id, kind=kind, state="queued", source=source, created_at=now, updated_at=now,
                    owner=replica, **fields)
    mark_active(storage, kind, job_id)
    put_status(storage, job)
    return job


# -- the runner ------------------------------------------------------------------------------------

def run_job(root: str, job_id: str, max_bytes_per_s: float = 0.0) -> dict[str, Any]:
    """Body of a service worker process, for a job of either kind (module docstring); returns the final
    record as a dict (it crosses the process boundary). A job already final (failed by another replica
    while it waited here) is not run: its record is returned."""
    storage = open_root(root)
    job = get_job(storage, job_id)
    if job.state not in FINAL:
        src = parse_ref(job.source)
        leases = Leases(storage)
        update: dict[str, Any] = {"state": "running", "updated_at": now_utc()}
        if job.kind == "reshard":  # recorded before anything is written to it (recovery reads it)
            update["session"] = uuid.uuid4().hex
        put_status(storage, job := job.model_copy(update=update))
        try:
            with leases.hold(src.run, src.name, job.kind, holder=job_id):
                # The final record is written while the lease is held: a job seen queued or running
                # always holds its source's lease.
                put_status(storage, job := _finished(job, lambda: _BODIES[job.kind](
                    storage, job, _progress(storage, job), max_bytes_per_s)))
        except Exception as e:  # noqa: BLE001 - the lease could not be taken: recorded for the caller
            put_status(storage, job := _failed(job, e))
        finally:
            leases.release(src.run, src.name, job_id)  # a job that failed before its hold began
    finish(storage, job.kind, job_id)
    return job.model_dump(mode="json")


def _progress(storage: Storage, job: JobStatus) -> Callable[[int], None]:
    """Counts bytes done; the running record is rewritten at most twice a second."""
    lock = threading.Lock()
    done, last = [0], [0.0]

    def progress(n: int) -> None:
        with lock:
            done[0] += n
            if time.monotonic() - last[0] > 0.5:
                last[0] = time.monotonic()
                put_status(storage, job.model_copy(update={"bytes_done": done[0], "updated_at": now_utc()}))
    return progress


def _reshard(storage: Storage, job: JobStatus, progress: Callable[[int], None], rate: float) -> dict[str, Any]:
    req = ReshardRequest.model_validate(job.request)
    reader = CheckpointReader(storage)
    session = get_plan_summary(storage, job.id)["source_session"]
    outline = outline_again(reader, job.source, session, req.to, req.dtype, req.jobs)
    assert job.out is not None and job.session is not None
    return convert(reader, outline, req, job.out, job.session, progress=progress, max_bytes_per_s=rate)


def _drill(storage: Storage, job: JobStatus, progress: Callable[[int], None], rate: float) -> dict[str, Any]:
    req = DrillRequest.model_validate(job.request)
    return drill_checkpoint(storage, job.source, job.layouts, jobs=req.jobs,
                            start=lambda total: progress).model_dump(mode="json")


_BODIES: dict[str, Callable[[Storage, JobStatus, Callable[[int], None], float], dict[str, Any]]] = {
    "reshard": _reshard, "drill": _drill}


def _finished(job: JobStatus, run: Callable[[], dict[str, Any]]) -> JobStatus:
    """The job's final record: done with its result, or failed with the error ``run`` raised."""
    try:
        result = run()
    except Exception as e:  # noqa: BLE001 - recorded for the caller
        return _failed(job, e)
    return job.model_copy(update={"state": "done", "bytes_done": job.bytes_total, "updated_at": now_utc(),
                                  "result": result})


def _failed(job: JobStatus, e: Exception) -> JobStatus:
    if not isinstance(e, CkptdError):
        log.error("%s job %s failed", job.kind, job.id, exc_info=e)
        e = CkptdError(f"internal error: {type(e).__name__}: {e}")
    return job.model_copy(update={"state": "failed", "updated_at": now_utc(), "error": e.to_body()["error"]})


# -- Kubernetes Indexed Job ---------------------------------------------------------------------

class WorkerJob(BaseModel):
    """What ``--write-plan`` stores for ``ckptd reshard-worker`` pods: which conversion, not its plan (a few
    hundred bytes at any world size). Each worker cuts the units again from the source and plans the reads
    of its own share only (``index`` of ``workers``: units ``i`` with ``i % workers == index``)."""

    model_config = ConfigDict(extra="forbid")
    root: str
    out: str
    session: str
    device: str
    source: str
    source_session: str
    to: str
    dtype: str | None = None
    min_units: int = 1
    workers: int = Field(ge=1)


def write_job(uri: str, outline: ReshardOutline, workers: int, out: str, session: str, device: str,
              sessions: SessionStore) -> WorkerJob:
    """Open the output session and store the job for ``workers`` pods at ``uri``: what cuts the same units
    again (the outline's source, target, dtype and unit count), not the units."""
    open_target(sessions, outline.plan(reads=False), out, session)
    h = outline.header
    doc = WorkerJob(root=sessions.storage.url, out=out, session=session, device=device, source=h["source"],
                    source_session=h["source_session"], to=h["target_spec"], dtype=h["dtype"],
                    min_units=outline.min_units, workers=workers)
    with fsspec.open(uri, "w") as f:
        f.write(doc.model_dump_json())
    return doc


def run_worker(uri: str, index: int, *, root: str | None = None) -> dict[str, Any]:
    """Worker ``index`` of the job at ``uri``: cut the units, plan and run its share one unit at a time,
    record its results beside the job (``URI.units/INDEX.json``, all of them in one write, so a retried pod
    replaces them whole); the worker that finds every share recorded commits (idempotent: two finalizers
    are harmless)."""
    with fsspec.open(uri, "r") as f:
        job = WorkerJob.model_validate_json(f.read())
    if not 0 <= index < job.workers:
        raise CheckpointNotFound(f"plan {uri} has workers 0..{job.workers - 1}, not {index}", index=index)
    storage = open_root(root or job.root)
    reader, sessions = CheckpointReader(storage), SessionStore(storage)

    def committed() -> str | None:  # the output's digest when this job's own session committed it
        r = parse_ref(job.out)
        m = reader.marker(r.run, r.name)
        return m.manifest_xxh3 if m is not None and m.session == job.session else None

    if (digest := committed()) is not None:  # a retried pod after the commit: nothing left to do
        return {"worker": index, "committed": digest}
    outline = outline_again(reader, job.source, job.source_session, job.to, job.dtype, job.min_units)
    choice = plan_device(outline, job.device)  # per pod: each may or may not have a GPU
    engine = plan_engine(outline, choice)
    results = run_share(reader, sessions, outline, index, job.workers, job.out, job.session, engine=engine)
    fs, base = fsspec.url_to_fs(uri)
    fs.makedirs(f"{base}.units", exist_ok=True)
    fs.pipe_file(f"{base}.units/{index:06d}.json", _Results(results=results).model_dump_json().encode())
    out: dict[str, Any] = {"worker": index, "units": [r.index for r in results],
                           "bytes_written": sum(r.bytes_written for r in results),
                           "engine": {"device": choice.device, "reason": choice.reason, "impl": engine.name}}
    names = fs.ls(f"{base}.units", detail=False)
    if len(names) == job.workers:
        every = [r for n in sorted(names) for r in _Results.model_validate_json(fs.cat_file(n)).results]
        try:
            out["committed"] = finalize(reader, sessions, outline.plan(reads=False), every, job.out, job.session)
        except AlreadyCommitted:  # two workers finished together and the other one committed first
            if (digest := committed()) is None:
                raise
            out["committed"] = digest
    return out


class _Results(BaseModel):
    model_config = ConfigDict(extra="forbid")
    results: list[UnitResult]
