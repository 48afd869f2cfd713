"""Service jobs whose service stopped: each is resumed or failed, never left queued or running.

A service job (a reshard job, ``POST /v1/reshard``, or a conversion drill, ``POST /v1/drill``) runs in
the worker pool of the replica (one ``ckptd serve`` process) that queued it, and the pool's processes
exit with that replica, even a SIGKILLed one (``service.workers``). So:

* each job record names its **owner**, the replica that queued it (a random id per start);
* while a replica has jobs in its pool it renews its **heartbeat**, ``jobs/replicas/OWNER.json`` (its
  wall-clock time), every ``CKPTD_JOB_HEARTBEAT_SECONDS``, and deletes it when it shuts down;
* a queued or running job whose owner's heartbeat is gone or older than ``CKPTD_JOB_TAKEOVER_SECONDS``,
  and whose record has not changed for as long, runs nowhere: it is **orphaned** (:func:`orphaned`).
  A job of a live replica is never taken: its heartbeat is fresh however long the job runs;
* every queued or running job is listed in ``jobs/active/KIND.ID.json`` (written before its record,
  deleted once the record is final: ``liveness.finish``), so finding them costs one listing however many
  jobs ever ran.

What becomes of an orphaned job (:func:`take_over`):

* a **drill is resumed**: queued again under the new owner (``attempts`` + 1) and run from the start.
  A drill only reads and writes its record, so a second run is harmless; after :data:`MAX_DRILL_STARTS`
  starts it is failed instead (a drill that keeps taking its service down is not run again);
* a **reshard job is failed** (:class:`Unavailable`: "the service stopped while this job ran ... submit
  it again"); the staging of its output session is reclaimed by the stale-session sweep. Running it
  again would redo the whole conversion, so the caller decides. If its own output session had already
  committed (the service stopped between the commit and the record), it is marked done instead.

A takeover is done once: the replica that creates ``jobs/claims/KIND.ID.N.json`` (N: the attempt)
first reads the record again and writes the new one only if it is unchanged; a claim whose taker
died is dropped after the same bound, and the next sweep tries again.

Call order: the service calls ``liveness.beat`` before it queues a job; ``jobs.enqueue`` calls
``liveness.mark_active`` then writes the record; the worker ends with the
final record and ``liveness.finish``; every replica's sweep (``service.job_watch``, and a status read of
a job) calls :func:`take_over` for each of ``liveness.active``. The replicas' clocks are assumed to
agree to well within the bound (as for leases).
"""

from __future__ import annotations

import json
import logging
import time

from ckptd_schemas import CkptdError, NotFound, Unavailable, parse_ref

from ..storage import Storage
from ..store import CheckpointReader
from ..store.leases import Leases
from .liveness import Kind, finish, last_beat
from .models import FINAL, JobStatus, get_job, get_plan_summary, now_utc, put_status

__all__ = ["CLAIMS", "MAX_DRILL_STARTS", "orphaned", "take_over"]

log = logging.getLogger("ckptd.reshard")

CLAIMS = "jobs/claims"
#: Starts of one drill at most; an orphaned drill started this often is failed, not resumed.
MAX_DRILL_STARTS = 3


# -- orphans -------------------------------------------------------------------------------------------

def orphaned(storage: Storage, job: JobStatus, *, after: float, now: float | None = None) -> str | None:
    """Why ``job`` runs nowhere (module docstring), or None: it is final, its record changed less than
    ``after`` seconds ago, or its owner's heartbeat is younger than that."""
    now = time.time() if now is None else now
    if job.state in FINAL or now - job.updated_at.timestamp() < after:
        return None
    if job.owner is None:  # a record of a service that kept no heartbeat
        return f"its record names no replica and has not changed since {_when(job.updated_at.timestamp())}"
    at = last_beat(storage, job.owner)
    if at is None:
        return f"replica {job.owner} that ran it has stopped"
    if now - at < after:
        return None
    return f"replica {job.owner} that ran it has not been seen since {_when(at)}"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def take_over(storage: Storage, kind: Kind, job_id: str, owner: str, *, after: float,
              now: float | None = None) -> JobStatus | None:
    """Resume or fail job ``job_id`` if it is orphaned (module docstring), as replica ``owner``; the new
    record, or None when nothing was done (not orphaned, already final, or another replica is taking it
    over). A drill returned queued must be submitted to ``owner``'s pool by the caller."""
    job = get_job(storage, job_id, kind)
    if job.state in FINAL:
        finish(storage, kind, job_id)  # a worker stopped between its final record and the index
        return None
    why = orphaned(storage, job, after=after, now=now)
    if why is None:
        return None
    attempt = job.attempts
    claim = f"{CLAIMS}/{kind}.{job_id}.{attempt}.json"
    if not storage.create_if_absent(claim, json.dumps({"owner": owner, "at": time.time()}).encode()):
        _drop_dead_claim(storage, claim, after)
        return None
    try:
        again = get_job(storage, job_id, kind)
        if (again.state, again.owner, again.updated_at) != (job.state, job.owner, job.updated_at):
            return None  # it moved meanwhile: its worker is alive after all, or another replica took it
        new = _resume_drill(storage, again, owner, why) if again.kind == "drill" else _end_reshard(storage, again, why)
        put_status(storage, new)
        if new.state in FINAL:
            finish(storage, kind, job_id)
        log.warning("%s job %s: %s; %s", kind, job_id, why,
                    "resumed here" if new.state == "queued" else f"marked {new.state}")
        return new
    finally:
        storage.delete(claim)


def _drop_dead_claim(storage: Storage, claim: str, after: float) -> None:
    """A claim older than ``after`` belongs to a replica that died while it took the job over."""
    try:
        data = storage.read_json_or_none(claim)
        if isinstance(data, dict) and time.time() - float(data.get("at", 0)) > after:
            storage.delete(claim)
    except (CkptdError, TypeError, ValueError):
        storage.delete(claim)


def _resume_drill(storage: Storage, job: JobStatus, owner: str, why: str) -> JobStatus:
    """Queued again under ``owner``, its source leased again; failed after :data:`MAX_DRILL_STARTS`."""
    now = now_utc()
    if job.attempts >= MAX_DRILL_STARTS:
        err = Unavailable(f"the service stopped while this drill ran, {job.attempts} times ({why}); it is not "
                          f"resumed again: submit it again", job=job.id, source=job.source)
        return job.model_copy(update={"state": "failed", "updated_at": now, "error": err.to_body()["error"]})
    src = parse_ref(job.source)
    try:
        Leases(storage).acquire(src.run, src.name, job.id, ttl=300)  # as at submission; the worker holds its own
    except NotFound as e:  # its source was deleted meanwhile: nothing to resume
        return job.model_copy(update={"state": "failed", "updated_at": now, "error": e.to_body()["error"]})
    return job.model_copy(update={"state": "queued", "owner": owner, "attempts": job.attempts + 1,
                                  "updated_at": now})


def _end_reshard(storage: Storage, st: JobStatus, why: str) -> JobStatus:
    """Done when its own output session committed (the stop fell between the commit and the record),
    else failed; the source's lease released either way."""
    now = now_utc()
    assert st.out is not None
    out = parse_ref(st.out)
    marker = CheckpointReader(storage).marker(out.run, out.name)
    src = parse_ref(st.source)
    Leases(storage).release(src.run, src.name, st.id)
    if st.session is not None and marker is not None and marker.session == st.session:
        try:
            units = int(get_plan_summary(storage, st.id).get("units_total", 0))
        except (NotFound, TypeError, ValueError):
            units = 0
        try:
            seconds = max(0.0, (marker.committed_at - st.created_at).total_seconds())
        except TypeError:  # a marker time without a zone
            seconds = 0.0
        return st.model_copy(update={"state": "done", "bytes_done": st.bytes_total, "updated_at": now, "result": {
            "ref": st.out, "manifest_xxh3": marker.manifest_xxh3, "units": units, "bytes_read": 0,
            "bytes_written": st.bytes_total, "seconds": round(seconds, 3), "processes": 0, "engine": None,
            "recovered": f"the service stopped after the commit, before it recorded the result ({why}); "
                         f"bytes_written is the plan's, bytes_read was not recorded"}})
    err = Unavailable(f"the service stopped while this job ran ({why}); its output {st.out} was not committed: "
                      f"submit the job again", job=st.id, source=st.source, out=st.out)
    return st.model_copy(update={"state": "failed", "updated_at": now, "error": err.to_body()["error"]})
