"""This replica's part in job recovery (:mod:`ckptd.service.job_watch`), over a real local root; job
records written as the job modules write them (``put_status``, ``liveness.mark_active``).

* ``owner`` renews this replica's heartbeat (a new replica id per watch) and ``stop`` deletes it, so
  another replica takes its jobs over at once; a watch that never named itself deletes nothing;
* a status read returns a final job, a job of a live replica, and this replica's own job as recorded,
  and writes nothing for them;
  a reshard job whose replica stopped is failed by the read ("the service stopped while this job
  ran"), and dropped from the index of jobs not yet final; a read of the other kind is a 404;
* the sweep fails the orphaned jobs, drops from the index a final job and a job listed long ago but
  never recorded, and keeps one listed just now (its record may be on its way);
* a job the pool refuses is failed at once ("could not queue it"), and the refusal is raised.

A drill resumed by a restarted service and run to its end in a worker: tests/ckptd/reshard/test_job_recovery.py.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest

from ckptd.reshard.liveness import REPLICAS, active, beat, mark_active
from ckptd.reshard.models import JobStatus, get_job, now_utc, put_status
from ckptd.service.job_watch import JobWatch
from ckptd.service.settings import Settings
from ckptd.service.workers import Workers
from ckptd.storage import LocalStorage
from ckptd_schemas import NotFound

TAKEOVER = 60.0  # seconds: the records below are older, or a heartbeat younger


@pytest.fixture
def storage(tmp_path):
    return LocalStorage(tmp_path / "root", durable=False)


@pytest.fixture
def workers():
    w = Workers(1)
    yield w
    w.close()


def _settings(storage) -> Settings:
    return Settings(root=str(storage.root), job_heartbeat_seconds=TAKEOVER / 4, job_takeover_seconds=TAKEOVER)


@pytest.fixture
def watch(storage, workers):
    w = JobWatch(storage, workers, _settings(storage))
    yield w
    w.stop()


def _job(storage, job_id: str, *, owner: str | None, state: str = "running", kind: str = "reshard",
         age: float = 2 * TAKEOVER) -> JobStatus:
    """A job record last changed ``age`` seconds ago, listed as not final unless it is."""
    then = now_utc() - timedelta(seconds=age)
    st = JobStatus(id=job_id, kind=kind, state=state, source="r/1", out="r/1-full" if kind == "reshard" else None,
                   spec="full", created_at=then, updated_at=then, owner=owner)
    mark_active(storage, kind, job_id)
    put_status(storage, st)
    return st


def test_owner_renews_the_heartbeat_and_stop_deletes_it(storage, workers, watch):
    other = JobWatch(storage, workers, _settings(storage))
    assert other.replica != watch.replica and len(watch.replica) == 16
    assert watch.owner() == watch.replica
    beat_rec = json.loads((storage.root / REPLICAS / f"{watch.replica}.json").read_text())
    assert beat_rec["owner"] == watch.replica and time.time() - beat_rec["at"] < TAKEOVER
    other.stop()  # never named itself: nothing of it to delete, nothing else touched
    assert storage.list(REPLICAS) == [f"{watch.replica}.json"]
    watch.stop()
    assert storage.list(REPLICAS) == []


def test_a_read_fails_a_reshard_job_whose_replica_stopped(storage, watch):
    _job(storage, "orphan", owner="gone0replica")
    job = watch.read("orphan")
    assert job.state == "failed" and "the service stopped while this job ran" in job.error["message"]
    assert "replica gone0replica that ran it has stopped" in job.error["message"]
    assert get_job(storage, "orphan").state == "failed" and ("reshard", "orphan") not in active(storage)


def test_a_read_leaves_final_live_and_own_jobs_as_recorded(storage, watch):
    beat(storage, "live0replica")
    _job(storage, "done1", owner="gone0replica", state="done")
    _job(storage, "live1", owner="live0replica")  # its record is old, its replica's heartbeat is not
    _job(storage, "mine1", owner=watch.replica)  # this replica's own: its pool holds it
    for job_id, state in (("done1", "done"), ("live1", "running"), ("mine1", "running")):
        assert watch.read(job_id).state == state
        assert get_job(storage, job_id).state == state
    assert storage.list(REPLICAS) == ["live0replica.json"]  # only reads: no takeover was attempted
    with pytest.raises(NotFound) as info:
        watch.read("live1", "drill")
    assert info.value.details == {"job": "live1"}


def test_the_sweep_fails_orphans_and_tidies_the_index(storage, watch):
    _job(storage, "orphan2", owner=None)  # a record naming no replica, unchanged for long
    _job(storage, "final2", owner="gone0replica", state="failed")
    mark_active(storage, "reshard", "unrecorded")
    (storage.root / "jobs" / "active" / "reshard.unrecorded.json").write_text(
        json.dumps({"at": time.time() - 2 * TAKEOVER}))  # listed long ago, its record never written
    mark_active(storage, "drill", "onitsway")  # listed just now: its record may follow
    taken = watch.sweep()
    assert [(j.id, j.state) for j in taken] == [("orphan2", "failed")]
    assert sorted(active(storage)) == [("drill", "onitsway")]
    assert get_job(storage, "final2").state == "failed"


def test_a_job_the_pool_refuses_is_failed_at_once(storage, workers, watch):
    workers().shutdown()  # a pool that takes no more jobs
    st = _job(storage, "refused", owner=watch.owner(), state="queued", age=0)
    with pytest.raises(RuntimeError):
        watch.submit(st)
    job = get_job(storage, "refused")
    assert job.state == "failed" and "the service could not queue it (RuntimeError" in job.error["message"]
    assert job.error["code"] == "unavailable" and ("reshard", "refused") not in active(storage)
