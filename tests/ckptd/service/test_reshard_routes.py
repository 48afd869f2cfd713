"""Reshard job routes (:mod:`ckptd.service.reshard_routes`), mounted alone over a real local root with the
service's job watch, worker pool and metrics, in process.

* a request that cannot be planned (a spec that does not parse, a source that is not there, an
  output name already committed) is refused with its typed error, and nothing is queued or recorded;
* the preview is each target rank's bytes for the plan, and writes nothing;
* ``GET /v1/jobs/{id}`` answers any job as recorded (a drill too), a reshard job whose replica stopped
  as failed by this replica, and an unknown id as a typed 404;
* a job is accepted 202 with its ``Location``, runs in the pool to ``done``,
  its output is committed, and its progress is in the metrics.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from ckptd.reshard.liveness import mark_active
from ckptd.reshard.models import JobStatus, now_utc, put_status
from ckptd.service.reshard_routes import reshard_router
from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from stored_tensors import write_tensors
from ckptd_schemas import AlreadyCommitted, CheckpointNotFound, InvalidRequest, NotFound, error_from_body
from support import scaled

from .wiring import app_with, call, job_watch


@pytest.fixture
def storage(tmp_path):
    s = LocalStorage(tmp_path / "root", durable=False)
    sessions = SessionStore(s)
    write_tensors(sessions, "rs/1", {"model.w": torch.arange(64.0).reshape(8, 8), "model.b": torch.ones(8)}, step=1)
    write_tensors(sessions, "rs/1-full", {"model.w": torch.zeros(8, 8)}, step=1)
    return s


@pytest.fixture
def parts(storage):
    with job_watch(storage) as (watch, metrics):
        yield app_with(reshard_router(storage, watch, metrics)), watch, metrics


def _refused(app, body: dict):
    r = call(app, "POST", "/v1/reshard", json=body)
    return r.status_code, error_from_body(r.json(), r.status_code)


def test_a_request_that_cannot_be_planned_is_refused_and_nothing_is_queued(parts, storage):
    app, _, _ = parts
    status, err = _refused(app, {"source": "rs/1", "to": "no-such-layout:x=1", "out": "rs/1-bad"})
    assert status == 400 and isinstance(err, InvalidRequest)
    status, err = _refused(app, {"source": "rs/77", "to": "full", "out": "rs/77-full"})
    assert status == 404 and isinstance(err, CheckpointNotFound)
    status, err = _refused(app, {"source": "rs/1", "to": "full"})  # its default output, rs/1-full, is taken
    assert status == 409 and isinstance(err, AlreadyCommitted)
    assert "output rs/1-full is already committed" in err.message
    status, err = _refused(app, {"source": "rs/1", "to": "full", "jobs": 0})
    assert status == 422 and isinstance(err, InvalidRequest)
    assert storage.list("jobs") == []  # no record, no index entry, no heartbeat


def test_the_preview_is_per_rank_bytes_and_writes_nothing(parts, storage):
    app, _, _ = parts
    r = call(app, "POST", "/v1/reshard/preview", json={"source": "rs/1", "to": "full"})
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["world_size"] == 1 and p["spec"].startswith("full")
    assert sum(p["per_rank"][0].values()) == (64 + 8) * 4  # every byte of the source, on the one target rank
    assert storage.list("jobs") == []
    r = call(app, "POST", "/v1/reshard/preview", json={"source": "rs/77", "to": "full"})
    assert r.status_code == 404 and isinstance(error_from_body(r.json(), 404), CheckpointNotFound)


def _record(storage, job_id: str, kind: str, owner: str | None, age: float = 0.0) -> JobStatus:
    then = now_utc() - timedelta(seconds=age)
    st = JobStatus(id=job_id, kind=kind, state="running", source="rs/1", out="rs/1-x" if kind == "reshard" else None,
                   created_at=then, updated_at=then, owner=owner)
    mark_active(storage, kind, job_id)
    put_status(storage, st)
    return st


def test_a_job_is_answered_as_recorded_or_failed_when_its_replica_stopped(parts, storage):
    app, watch, _ = parts
    _record(storage, "drill1", "drill", watch.owner())
    r = call(app, "GET", "/v1/jobs/drill1")
    assert r.status_code == 200 and (r.json()["kind"], r.json()["state"]) == ("drill", "running")
    _record(storage, "gone1", "reshard", "stopped0replica", age=3600)
    r = call(app, "GET", "/v1/jobs/gone1")
    assert r.status_code == 200 and r.json()["state"] == "failed"
    assert "the service stopped while this job ran" in r.json()["error"]["message"]
    r = call(app, "GET", "/v1/jobs/nosuchjob")
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 404 and type(err) is NotFound and err.details == {"job": "nosuchjob"}


def test_a_job_runs_in_the_pool_to_its_committed_output(parts, storage):
    app, _, metrics = parts
    r = call(app, "POST", "/v1/reshard", json={"source": "rs/1", "to": "full", "out": "rs/1-whole"})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["state"] == "queued" and r.headers["location"] == f"/v1/jobs/{job['id']}"
    deadline = time.monotonic() + scaled(180)
    while (st := call(app, "GET", f"/v1/jobs/{job['id']}").json())["state"] not in ("done", "failed"):
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    assert st["state"] == "done", st
    assert (storage.root / "runs" / "rs" / "1-whole" / "COMMITTED").exists()
    assert metrics.registry.get_sample_value("ckptd_reshard_job_bytes_planned", {"job": job["id"]}) is None
    metrics.render()  # progress is read from the record at scrape time
    assert metrics.registry.get_sample_value("ckptd_reshard_job_bytes_done", {"job": job["id"]}) == st["bytes_total"]
