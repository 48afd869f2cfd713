"""Service jobs cut by a stop of their service (``ckptd.reshard.recovery``): a drill is resumed, a reshard job
failed (or done when its own output session had committed), never left queued or running; a live replica's
jobs are never taken. The rules over a real local root (no server), then real ``ckptd serve`` processes
SIGKILLed while one job runs and another waits in the pool: restarted on the same root, and beside a second
replica that takes the jobs over."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.reshard.jobs import submit_drill, submit_job
from ckptd.reshard.liveness import ACTIVE, active, beat, forget
from ckptd.reshard.models import DrillRequest, ReshardRequest, get_job, put_status
from ckptd.reshard.recovery import CLAIMS, MAX_DRILL_STARTS, orphaned, take_over
from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader, SessionStore
from ckptd.store.leases import Leases
from stored_tensors import write_tensors
from support import ServerProcess, scaled

AFTER = 60.0  # the takeover bound of the pure tests (their clock is passed in: nothing waits for it)
LATER = 10 * AFTER  # a "now" when every record and heartbeat written by the test is older than the bound


def _source(root: Path, ref: str = "src/1", rows: int = 64) -> LocalStorage:
    storage = LocalStorage(str(root))
    g = torch.Generator().manual_seed(1)
    write_tensors(SessionStore(storage), ref, {f"model.w{i}": torch.randn(rows, 256, generator=g) for i in range(3)},
                  step=1)
    return storage


@pytest.fixture
def storage(tmp_path) -> LocalStorage:
    return _source(tmp_path / "root")


def _drill(storage: LocalStorage, owner: str | None = "deadreplica") -> str:
    if owner is not None:
        beat(storage, owner)
    return submit_drill(storage, DrillRequest(source="src/1", to=["full"]), (lambda: owner) if owner else None).id


def _reshard(storage: LocalStorage, owner: str = "deadreplica") -> str:
    beat(storage, owner)
    return submit_job(storage, ReshardRequest(source="src/1", to="fsdp2:dp=2", out="src/1-dp2"), lambda: owner).id


# -- the rules (pure: a local root, a clock passed in) ---------------------------------------------------

def test_a_job_is_orphaned_only_when_its_replica_and_its_record_are_both_older_than_the_bound(storage):
    job = get_job(storage, _drill(storage))
    now = time.time()
    assert orphaned(storage, job, after=AFTER, now=now) is None  # just recorded, replica just beat
    assert orphaned(storage, job, after=AFTER, now=now + LATER).startswith("replica deadreplica that ran it has not")
    old = job.model_copy(update={"updated_at": datetime.fromtimestamp(now - LATER, timezone.utc)})
    beat(storage, "deadreplica")  # a live replica's job: never orphaned however old its record is
    assert orphaned(storage, old, after=AFTER, now=now) is None
    forget(storage, "deadreplica")  # a clean shutdown deleted the heartbeat
    assert orphaned(storage, old, after=AFTER, now=now) == "replica deadreplica that ran it has stopped"
    assert orphaned(storage, job, after=AFTER, now=now) is None  # ... but a record that changed just now waits
    legacy = old.model_copy(update={"owner": None})  # a record of a service that kept no heartbeat
    assert "names no replica" in orphaned(storage, legacy, after=AFTER, now=now)
    assert orphaned(storage, old.model_copy(update={"state": "done"}), after=AFTER, now=now) is None


def test_an_orphaned_drill_is_resumed_once_then_failed_after_max_starts(storage, tmp_path):
    job_id = _drill(storage)
    assert active(storage) == [("drill", job_id)]
    Leases(storage).release("src", "1", job_id)  # the submission's lease expired meanwhile
    new = take_over(storage, "drill", job_id, "livereplica", after=AFTER, now=time.time() + LATER)
    assert new is not None and (new.state, new.owner, new.attempts) == ("queued", "livereplica", 2)
    assert get_job(storage, job_id) == new and active(storage) == [("drill", job_id)]
    assert job_id in Leases(storage).active("src", "1")  # leased again until its worker holds it
    assert not list(Path(tmp_path, "root", CLAIMS).glob("*"))  # the claim is dropped once the record is written
    # a second replica reading the record it replaced finds it changed and does nothing
    assert take_over(storage, "drill", job_id, "thirdreplica", after=AFTER, now=time.time()) is None
    # a drill that keeps stopping its service is not resumed for ever
    put_status(storage, new.model_copy(update={"attempts": MAX_DRILL_STARTS}))
    end = take_over(storage, "drill", job_id, "livereplica", after=AFTER, now=time.time() + LATER)
    assert end is not None and end.state == "failed" and end.error["code"] == "unavailable"
    assert f"the service stopped while this drill ran, {MAX_DRILL_STARTS} times" in end.error["message"]
    assert "submit it again" in end.error["message"] and active(storage) == []


def test_an_orphaned_drill_whose_source_was_deleted_is_failed_not_resumed(storage):
    job_id = _drill(storage)
    Leases(storage).release("src", "1", job_id)  # the submission's lease expired, and rm took the source
    storage.delete("runs/src/1/COMMITTED")
    new = take_over(storage, "drill", job_id, "livereplica", after=AFTER, now=time.time() + LATER)
    assert new is not None and new.state == "failed" and new.error["code"] == "checkpoint_not_found", new
    assert active(storage) == [] and Leases(storage).active("src", "1") == []  # no lease left behind


def test_an_orphaned_reshard_job_is_failed_with_its_reason_and_its_source_released(storage):
    job_id = _reshard(storage)
    assert job_id in Leases(storage).active("src", "1")
    st = take_over(storage, "reshard", job_id, "livereplica", after=AFTER, now=time.time() + LATER)
    assert st is not None and st.state == "failed" and get_job(storage, job_id) == st
    msg = st.error["message"]
    assert st.error["code"] == "unavailable" and msg.startswith("the service stopped while this job ran (replica "
                                                                "deadreplica that ran it has not been seen since")
    assert "its output src/1-dp2 was not committed: submit the job again" in msg, msg
    assert st.error["details"] == {"job": job_id, "source": "src/1", "out": "src/1-dp2"}
    assert active(storage) == [] and job_id not in Leases(storage).active("src", "1")
    assert take_over(storage, "reshard", job_id, "livereplica", after=AFTER, now=time.time() + LATER) is None


def test_a_reshard_job_whose_own_session_committed_before_the_stop_is_done(storage):
    job_id, other = _reshard(storage), _reshard(storage)  # two jobs to one output, both queued before its commit
    digest = write_tensors(SessionStore(storage), "src/1-dp2", {"model.w0": torch.zeros(4, 4)}, step=1)
    marker = CheckpointReader(storage).marker("src", "1-dp2")
    put_status(storage, get_job(storage, job_id).model_copy(update={"state": "running", "session": marker.session}))
    st = take_over(storage, "reshard", job_id, "livereplica", after=AFTER, now=time.time() + LATER)
    assert st is not None and st.state == "done" and st.error is None, st
    assert (st.result["ref"], st.result["manifest_xxh3"]) == ("src/1-dp2", digest) and st.result["recovered"]
    # another session's commit under the output's name is not this job's: failed
    put_status(storage, get_job(storage, other).model_copy(update={"state": "running", "session": "f" * 32}))
    st = take_over(storage, "reshard", other, "livereplica", after=AFTER, now=time.time() + LATER)
    assert st is not None and st.state == "failed"


def test_a_claimed_takeover_is_left_to_its_taker_and_a_dead_takers_claim_is_dropped(storage, tmp_path):
    job_id = _drill(storage)
    claim = Path(tmp_path, "root", CLAIMS, f"drill.{job_id}.1.json")
    claim.parent.mkdir(parents=True)
    claim.write_text(json.dumps({"owner": "otherreplica", "at": time.time()}))
    assert take_over(storage, "drill", job_id, "livereplica", after=AFTER, now=time.time() + LATER) is None
    assert claim.exists() and get_job(storage, job_id).attempts == 1
    claim.write_text(json.dumps({"owner": "otherreplica", "at": time.time() - LATER}))  # its taker died
    assert take_over(storage, "drill", job_id, "livereplica", after=AFTER, now=time.time() + LATER) is None
    assert not claim.exists()  # dropped: the next sweep takes the job over
    new = take_over(storage, "drill", job_id, "livereplica", after=AFTER, now=time.time() + LATER)
    assert new is not None and new.attempts == 2


def test_a_final_job_left_listed_is_dropped_from_the_index(storage):
    job_id = _drill(storage)
    put_status(storage, get_job(storage, job_id).model_copy(update={"state": "failed"}))
    assert take_over(storage, "drill", job_id, "livereplica", after=AFTER, now=time.time() + LATER) is None
    assert active(storage) == []


# -- real services, SIGKILLed ----------------------------------------------------------------------------

HEARTBEAT = 0.5
TAKEOVER = max(6.0, scaled(6.0))  # well above the heartbeat, even on a loaded machine


def _env() -> dict[str, str]:
    """One worker process, and a reshard job capped so slow that it runs until the kill: the drill queued
    after it waits in the pool."""
    return {"CKPTD_RESHARD_WORKERS": "1", "CKPTD_RESHARD_MAX_MBPS": "0.02",
            "CKPTD_JOB_HEARTBEAT_SECONDS": str(HEARTBEAT), "CKPTD_JOB_TAKEOVER_SECONDS": str(TAKEOVER)}


def _submit_both(url: str) -> tuple[str, str]:
    """A reshard job (running once its worker has started) and a drill queued behind it."""
    r = httpx.post(f"{url}/v1/reshard", json={"source": "src/1", "to": "fsdp2:dp=2", "out": "src/1-dp2"}, timeout=60)
    assert r.status_code == 202, r.text
    reshard = r.json()["id"]
    r = httpx.post(f"{url}/v1/drill", json={"source": "src/1", "to": ["full", "fsdp2:dp=3"]}, timeout=60)
    assert r.status_code == 202, r.text
    drill = r.json()["id"]
    deadline = time.monotonic() + scaled(120)
    while httpx.get(f"{url}/v1/jobs/{reshard}", timeout=30).json()["state"] != "running":
        assert time.monotonic() < deadline, "the reshard job never started"
        time.sleep(0.1)
    return reshard, drill


def _on_disk(root: Path, kind: str, job_id: str) -> dict:
    return json.loads((root / "jobs" / f"{job_id}.json").read_text())


def _until_final(read, what: str) -> dict:
    deadline = time.monotonic() + scaled(180)
    while (job := read())["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, f"{what} still {job['state']}: {job}"
        time.sleep(0.2)
    return job


def _check_taken_over(root: Path, url: str, reshard: str, drill: str, killed: dict) -> None:
    """The drill resumed and passed, the reshard job failed with its reason; nothing left listed or leased."""
    d = _until_final(lambda: _on_disk(root, "drill", drill), "the drill")  # the sweep, nobody asking
    assert d["state"] == "done" and d["result"]["ok"], d
    assert d["attempts"] == 2 and d["owner"] != killed["drill"]["owner"], d
    assert httpx.get(f"{url}/v1/drills/{drill}", timeout=30).json() == d == httpx.get(f"{url}/v1/jobs/{drill}",
                                                                                      timeout=30).json()
    assert httpx.get(f"{url}/v1/drills/{reshard}", timeout=30).status_code == 404  # one store, kinds kept apart
    assert [x["spec"] for x in d["result"]["layouts"]] == ["full", "fsdp2:dp=3"]
    assert json.loads((root / "runs/src/1/DRILL.json").read_text())["ok"]
    st = _until_final(lambda: httpx.get(f"{url}/v1/jobs/{reshard}", timeout=30).json(), "the reshard job")
    assert st["state"] == "failed" and st["error"]["code"] == "unavailable", st
    msg = st["error"]["message"]
    assert msg.startswith(f"the service stopped while this job ran (replica {killed['reshard']['owner']}"), msg
    assert msg.endswith("its output src/1-dp2 was not committed: submit the job again"), msg
    assert not CheckpointReader(LocalStorage(str(root))).marker("src", "1-dp2")
    assert not list((root / ACTIVE).glob("*"))
    held = Leases(LocalStorage(str(root))).active("src", "1")
    assert reshard not in held and drill not in held, held


@pytest.mark.slow
def test_a_sigkilled_service_restarted_resumes_the_drill_and_fails_the_reshard_job(tmp_path):
    root = tmp_path / "root"
    _source(root, rows=2048)  # 6 MiB: minutes at the job's bandwidth cap
    srv = ServerProcess(root, env=_env()).start()
    try:
        reshard, drill = _submit_both(srv.url)
        srv.kill()
        killed = {"reshard": _on_disk(root, "reshard", reshard), "drill": _on_disk(root, "drill", drill)}
        assert killed["reshard"]["state"] == "running" and killed["drill"]["state"] == "queued", killed
        assert killed["reshard"]["owner"] == killed["drill"]["owner"] is not None
        srv.start()  # a new replica id: the old one's heartbeat ages out, then its jobs are taken over
        _check_taken_over(root, srv.url, reshard, drill, killed)
        # the source is intact and free: a new job converts it
        r = httpx.post(f"{srv.url}/v1/drill", json={"source": "src/1", "to": ["full"]}, timeout=60)
        assert _until_final(lambda: httpx.get(f"{srv.url}/v1/drills/{r.json()['id']}", timeout=30).json(),
                            "a new drill")["state"] == "done"
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_live_replicas_jobs_are_left_alone_and_taken_over_when_it_is_killed(tmp_path):
    root = tmp_path / "root"
    _source(root, rows=2048)
    a = ServerProcess(root, env=_env(), log=tmp_path / "a.log").start()
    b = ServerProcess(root, env=_env(), log=tmp_path / "b.log").start()
    try:
        reshard, drill = _submit_both(a.url)
        # several takeover bounds pass while A works: B sweeps and reads the jobs, and takes nothing
        time.sleep(2.5 * TAKEOVER)
        seen = httpx.get(f"{b.url}/v1/drills/{drill}", timeout=30).json()
        st = httpx.get(f"{b.url}/v1/jobs/{reshard}", timeout=30).json()
        assert (seen["state"], seen["attempts"]) == ("queued", 1) and st["state"] == "running", (seen, st)
        assert seen["owner"] == st["owner"] and (root / f"jobs/replicas/{st['owner']}.json").exists()
        a.kill()
        killed = {"reshard": _on_disk(root, "reshard", reshard), "drill": _on_disk(root, "drill", drill)}
        assert killed["reshard"]["state"] == "running" and killed["drill"]["state"] == "queued", killed
        _check_taken_over(root, b.url, reshard, drill, killed)
        d = _on_disk(root, "drill", drill)
        assert (root / f"jobs/replicas/{d['owner']}.json").exists(), d  # B's: it beat before it took the drill
    finally:
        a.stop()
        b.stop()
