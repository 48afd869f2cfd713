"""Conversion drills through the service (:mod:`ckptd.service.drill_routes`): the routes mounted alone
over a real local root with the service's job watch, worker pool and metrics, in process; the policy
fed the store's commit events.

* a drill is accepted 202 with its ``Location``, runs in the pool to ``done``, its record is then
  the checkpoint's drill, and it counts as ok in ``ckptd_drills_total``;
* a layout that does not parse, or a source that is not there, is refused with its typed error and
  nothing is queued; a checkpoint never drilled has no drill (typed 404 naming it), and a reshard
  job is no drill;
* every drill that ends counts once: ok only when it is done and its record says ok; failed when
  it found a problem, could not run, or its worker stopped;
* the policy (``CKPTD_DRILL_EVERY`` = 2) drills every second trainer commit of a run, counted per run;
  derived checkpoints do not count, and with the policy off nothing is drilled.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
import torch

from ckptd.reshard.models import JobStatus, get_job, now_utc, put_status
from ckptd.service.drill_routes import DrillPolicy, count_drill, drill_router
from ckptd.service.metrics import Metrics
from ckptd.service.reshard_routes import reshard_router
from ckptd.service.settings import Settings
from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from ckptd.store.events import CommitEvent
from stored_tensors import write_tensors
from ckptd_schemas import CheckpointNotFound, InvalidRequest, NotFound, error_from_body
from support import scaled

from .wiring import app_with, call, job_watch


@pytest.fixture
def storage(tmp_path):
    s = LocalStorage(tmp_path / "root", durable=False)
    sessions = SessionStore(s)
    for step in (1, 2, 3, 4):
        write_tensors(sessions, f"dr/{step}", {"model.w": torch.arange(64.0).reshape(8, 8) + step}, step=step)
    return s


@pytest.fixture
def parts(storage):
    with job_watch(storage) as (watch, metrics):
        yield storage, watch, metrics


@pytest.fixture
def app(parts):
    storage, watch, metrics = parts
    return app_with(drill_router(storage, watch, metrics), reshard_router(storage, watch, metrics))


def _drills(metrics: Metrics, result: str) -> float:
    return metrics.registry.get_sample_value("ckptd_drills_total", {"result": result})


def _wait_until(what, timeout: float = 180):
    deadline = time.monotonic() + scaled(timeout)
    while not (got := what()):
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.1)
    return got


def test_a_drill_runs_in_the_pool_and_its_record_is_the_checkpoints_drill(app, parts):
    _, _, metrics = parts
    r = call(app, "GET", "/v1/checkpoints/dr/1/drill")
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 404 and type(err) is NotFound and err.details == {"ref": "dr/1"}
    r = call(app, "POST", "/v1/drill", json={"source": "dr/1", "to": ["full", "tp=2"]})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["kind"] == "drill" and job["state"] == "queued" and r.headers["location"] == f"/v1/jobs/{job['id']}"
    done = _wait_until(lambda: (st := call(app, "GET", f"/v1/jobs/{job['id']}").json())["state"] in (
        "done", "failed") and st)
    assert done["state"] == "done" and done["result"]["ok"] is True, done
    old = call(app, "GET", f"/v1/drills/{job['id']}")  # the deprecated alias: the same record, marked so
    assert old.json() == done and old.headers["deprecation"] == "true", old.headers
    assert old.headers["link"] == f'</v1/jobs/{job["id"]}>; rel="successor-version"'
    assert call(app, "GET", "/openapi.json").json()["paths"]["/v1/drills/{job_id}"]["get"]["deprecated"] is True
    rec = call(app, "GET", "/v1/checkpoints/dr/1/drill").json()
    assert rec["ok"] is True and rec["ref"] == "dr/1" and [x["layout"] for x in rec["layouts"]] == ["full", "tp=2"]
    _wait_until(lambda: _drills(metrics, "ok") == 1)  # the future's callback, once
    assert _drills(metrics, "failed") == 0


def test_a_drill_that_cannot_be_planned_is_refused_and_nothing_is_queued(app, parts):
    storage, watch, _ = parts
    r = call(app, "POST", "/v1/drill", json={"source": "dr/1", "to": ["nonsense:q=1"]})
    assert r.status_code == 400 and isinstance(error_from_body(r.json(), 400), InvalidRequest)
    r = call(app, "POST", "/v1/drill", json={"source": "dr/9", "to": ["full"]})
    assert r.status_code == 404 and isinstance(error_from_body(r.json(), 404), CheckpointNotFound)
    assert storage.list("jobs") == []


def test_a_reshard_job_is_no_drill(app, parts):
    storage, watch, _ = parts
    now = now_utc()
    put_status(storage, JobStatus(id="reshard1", state="queued", source="dr/2", out="dr/2-full", spec="full",
                                  created_at=now, updated_at=now, owner=watch.owner()))
    r = call(app, "GET", "/v1/drills/reshard1")
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 404 and type(err) is NotFound and "it is a reshard job" in err.message
    assert call(app, "GET", "/v1/jobs/reshard1").json()["kind"] == "reshard"  # answered as a job of any kind


def _ended(result: dict | None = None, error: BaseException | None = None) -> Future:
    fut: Future = Future()
    fut.set_exception(error) if error is not None else fut.set_result(result)
    return fut


def test_every_drill_that_ends_counts_once_as_ok_or_failed():
    metrics = Metrics()
    count = count_drill(metrics, "test")
    count(_ended({"state": "done", "result": {"ok": True}}))
    count(_ended({"state": "done", "result": {"ok": False, "ref": "dr/1", "layouts": [
        {"problems": [{"layout": "full", "tensor": "model.w", "message": "digest differs"}]}]}}))
    count(_ended({"state": "failed", "error": {"message": "the checkpoint went"}}))
    count(_ended({"state": "done"}))  # no record: not ok
    count(_ended(error=RuntimeError("worker stopped")))
    assert (_drills(metrics, "ok"), _drills(metrics, "failed")) == (1, 4)


def _event(name: str, derived_from: str | None = None) -> CommitEvent:
    return CommitEvent(run="dr", name=name, session="s", manifest_xxh3="0" * 16, files=1, bytes=256,
                       derived_from=derived_from)


def test_the_policy_drills_every_nth_trainer_commit_of_a_run(parts):
    storage, watch, metrics = parts
    off = DrillPolicy(storage, Settings(root=str(storage.root)), watch, metrics)  # CKPTD_DRILL_EVERY unset: off
    for name in ("1", "2", "3"):
        off.after_commit(_event(name))
    policy = DrillPolicy(storage, Settings(root=str(storage.root), drill_every=2), watch, metrics)
    policy.after_commit(_event("1"))
    policy.after_commit(_event("1-full", derived_from="dr/1"))  # derived: not counted
    policy.after_commit(_event("2"))  # the second trainer commit: drilled
    _wait_until(lambda: _drills(metrics, "ok") + _drills(metrics, "failed") >= 1)
    assert (_drills(metrics, "ok"), _drills(metrics, "failed")) == (1, 0)
    # one job (submissions are queued in order: one due before this one would be recorded by now)
    [job] = [get_job(storage, e[:-5]) for e in storage.list("jobs") if e.endswith(".json")]
    assert (job.kind, job.source, job.state) == ("drill", "dr/2", "done") and job.owner == watch.replica
    assert "dr" not in policy.running  # its turn ended with the job


def test_a_closed_policy_queues_no_drill_and_leaves_no_thread(parts):
    """At the service's shutdown the policy stops: a commit after it queues nothing (no job recorded),
    and its submitting thread is gone."""
    import threading

    storage, watch, metrics = parts
    before = set(threading.enumerate())  # other tests' policies may have threads of the same name
    policy = DrillPolicy(storage, Settings(root=str(storage.root), drill_every=1), watch, metrics)
    policy.after_commit(_event("1"))  # queued: its thread exists now
    mine = [t for t in threading.enumerate() if t.name.startswith("ckptd-drill-policy") and t not in before]
    assert len(mine) == 1
    _wait_until(lambda: _drills(metrics, "ok") + _drills(metrics, "failed") >= 1)
    jobs = sorted(storage.list("jobs"))
    policy.close()
    policy.after_commit(_event("2"))
    assert sorted(storage.list("jobs")) == jobs and "dr" not in policy.running
    deadline = time.monotonic() + scaled(10)
    while mine[0].is_alive():
        assert time.monotonic() < deadline, "the policy's thread outlived close()"
        time.sleep(0.02)
