"""The web view's JSON (:mod:`ckptd.service.ui_routes`), its router mounted alone over a real local root
(checkpoints committed through the upload routes), in process.

* runs list each run's checkpoint count, latest and newest step; a run page lists its checkpoints
  newest first (or oldest first), each with its figures and the commit's own verification; the
  step timeline is columns; every answer is paged and never kept by a browser;
* a run that is not under the root is a typed 404 naming the run (never an empty page), a run with
  nothing visible yet an empty page, an invalid run name a typed 400, a page over its maximum 422;
* a checkpoint page names its topology and files; its tensors are paged and filtered by name;
* an upload in progress shows per rank what it has stored and whether its index arrived (a
  committed one is no upload); jobs are those whose source or output is in the run, and a job's
  plan asked under a run it does not touch is a 404; the retention page is the gc log's, newest first;
* a token that reads one run sees only that run among the runs, and not the plan of a job whose
  output is in its run but whose source is not (403 naming the scope it lacks).
"""

from __future__ import annotations

import pytest
import xxhash

from ckptd.reshard.models import JobStatus, now_utc, put_status
from ckptd.service.gc_log import GcLog
from ckptd.service.ui_routes import MAX_CHECKPOINTS, ui_router
from ckptd.service.upload_routes import upload_router
from ckptd.service.auth import Principal
from ckptd_schemas import CheckpointNotFound, Forbidden, InvalidName, InvalidRequest, NotFound, error_from_body

from .wiring import app_with, call, rank_index, save_one, services


def _data(step: int) -> bytes:
    return bytes((i + step) % 251 for i in range(1024))


@pytest.fixture
def root(tmp_path):
    return tmp_path / "root"


@pytest.fixture
def svc(root):
    s = services(root)
    yield s
    s.workers.close()


@pytest.fixture
def gc_log():
    return GcLog()


@pytest.fixture
def app(svc, gc_log):
    a = app_with(upload_router(svc), ui_router(svc, gc_log))
    for step in (10, 20, 30):
        assert save_one(a, f"alpha/{step}", _data(step), step=step, sid=f"s{step}").json()["state"] == "committed"
    assert save_one(a, "beta/1", _data(1), step=1).json()["state"] == "committed"
    return a


def _ok(app, url: str, **params) -> dict:
    r = call(app, "GET", url, params=params)
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"] == "no-store"
    return r.json()


def _error(app, url: str, **params):
    r = call(app, "GET", url, params=params)
    return r.status_code, error_from_body(r.json(), r.status_code)


def test_runs_and_a_run_page_newest_first_with_figures_and_verification(app):
    runs = _ok(app, "/v1/ui/runs")
    assert [(x["run"], x["checkpoints"], x["latest"], x["newest_step"]) for x in runs["items"]] == [
        ("alpha", 3, "30", 30), ("beta", 1, "1", 1)]
    assert (runs["total"], runs["offset"]) == (2, 0)
    assert [x["run"] for x in _ok(app, "/v1/ui/runs", offset=1, limit=1)["items"]] == ["beta"]

    page = _ok(app, "/v1/ui/runs/alpha/checkpoints", limit=2)
    assert [c["name"] for c in page["items"]] == ["30", "20"] and page["total"] == 3 and page["latest"] == "30"
    row = page["items"][0]
    assert row["step"] == 30 and row["stats"]["file_bytes"] == 1024 and row["stats"]["tensors"] == 1
    assert row["verification"]["ok"] is True and row["leases"] == []  # the commit's own check, recorded
    assert [c["name"] for c in _ok(app, "/v1/ui/runs/alpha/checkpoints", order="asc")["items"]] == ["10", "20", "30"]
    steps = _ok(app, "/v1/ui/runs/alpha/steps")
    assert steps["columns"]["name"] == ["10", "20", "30"] and steps["columns"]["step"] == [10, 20, 30]


def test_an_unknown_run_is_a_typed_404_and_an_empty_run_an_empty_page(app, root):
    for url in ("/v1/ui/runs/nope/checkpoints", "/v1/ui/runs/nope/steps", "/v1/ui/checkpoints/nope/1"):
        status, err = _error(app, url)
        assert status == 404 and type(err) is NotFound and err.details == {"run": "nope"}, url
    status, err = _error(app, "/v1/ui/checkpoints/alpha/99")  # the run is there, the checkpoint is not
    assert status == 404 and isinstance(err, CheckpointNotFound)
    (root / "runs" / "empty").mkdir(parents=True)
    assert _ok(app, "/v1/ui/runs/empty/checkpoints")["items"] == []
    status, err = _error(app, "/v1/ui/runs/Bad_Run/checkpoints")
    assert status == 400 and type(err) is InvalidName
    status, err = _error(app, "/v1/ui/runs/alpha/checkpoints", limit=MAX_CHECKPOINTS + 1)
    assert status == 422 and type(err) is InvalidRequest


def test_a_checkpoint_page_and_its_tensors(app):
    c = _ok(app, "/v1/ui/checkpoints/alpha/latest")
    assert (c["ref"], c["name"], c["run"]) == ("alpha/30", "30", "alpha")
    assert c["topology"]["world_size"] == 1 and [f["file"] for f in c["files"]] == ["r000000-0000.bin"]
    assert c["files"][0]["size"] == 1024 and c["derived"] == []
    t = _ok(app, "/v1/ui/checkpoints/alpha/30/tensors")
    assert [x["name"] for x in t["items"]] == ["model.w"] and t["total"] == 1
    assert _ok(app, "/v1/ui/checkpoints/alpha/30/tensors", q="optim")["items"] == []
    assert _ok(app, "/v1/ui/checkpoints/alpha/30/objects")["total"] == 0


def test_an_upload_in_progress_shows_each_ranks_progress(app):
    base = "/v1/checkpoints/alpha/40/sessions/s40"
    assert call(app, "POST", "/v1/checkpoints/alpha/40/sessions",
                json={"session": "s40", "world_size": 2, "step": 40}).status_code == 200
    data = _data(40)
    assert call(app, "PUT", f"{base}/files/r000000-0000.bin", content=data,
                headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)}).status_code == 200
    assert call(app, "PUT", f"{base}/ranks/0", json=rank_index(data, world=2)).json()["state"] == "open"
    up = _ok(app, "/v1/ui/runs/alpha/uploads")
    assert up["run_exists"] is True and [u["name"] for u in up["items"]] == ["40"]  # committed ones are no upload
    u = up["items"][0]
    assert (u["session"], u["state"], u["world_size"], u["ranks_done"], u["step"]) == ("s40", "open", 2, 1, 40)
    assert [(r["rank"], r["files"], r["bytes"], r["index"]) for r in u["ranks"]] == [(0, 1, 1024, True),
                                                                                     (1, 0, 0, False)]
    assert (u["files"], u["bytes"], u["partial_files"]) == (1, 1024, 0) and u["stale"] is False
    nothing = _ok(app, "/v1/ui/runs/nope/uploads")
    assert nothing["items"] == [] and nothing["run_exists"] is False


def test_jobs_of_the_run_and_a_plan_asked_under_another_run(app, svc):
    now = now_utc()
    for job_id, source, out in (("jalpha", "alpha/30", "alpha/30-full"), ("jbeta", "beta/1", "beta/1-full")):
        put_status(svc.storage, JobStatus(id=job_id, state="queued", source=source, out=out, spec="full",
                                          created_at=now, updated_at=now))
    svc.storage.put("jobs/not-a-job.json", b"{}")  # not a record this service wrote: left out
    jobs = _ok(app, "/v1/ui/runs/alpha/jobs")
    assert [j["id"] for j in jobs["items"]] == ["jalpha"] and jobs["total"] == 1
    status, err = _error(app, "/v1/ui/runs/alpha/jobs/jbeta/plan")
    assert status == 404 and type(err) is NotFound and err.details == {"job": "jbeta", "run": "alpha"}


def test_the_retention_page_is_the_gc_log_newest_first(app, gc_log):
    for i in (1, 2, 3):
        gc_log.record("alpha", {"keep": {}, "delete": [str(i)], "deleted": [str(i)]}, "policy")
    page = _ok(app, "/v1/ui/runs/alpha/retention", limit=2)
    assert [d["delete"] for d in page["items"]] == [["3"], ["2"]] and page["total"] == 3
    assert _ok(app, "/v1/ui/runs/beta/retention")["items"] == []


def test_a_reader_of_one_run_sees_that_run_only(app, svc, gc_log):
    reader = app_with(ui_router(svc, gc_log), principal=Principal("alpha-reader", read=("alpha",)))
    assert [x["run"] for x in _ok(reader, "/v1/ui/runs")["items"]] == ["alpha"]
    now = now_utc()
    put_status(svc.storage, JobStatus(id="jcross", state="queued", source="beta/1", out="alpha/1-from-beta",
                                      spec="full", created_at=now, updated_at=now))
    status, err = _error(reader, "/v1/ui/runs/alpha/jobs/jcross/plan")  # its output is in alpha, its source not
    assert status == 403 and type(err) is Forbidden and err.details["needs"] == "read:beta"
