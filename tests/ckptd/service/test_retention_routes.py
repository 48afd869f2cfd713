"""Retention over HTTP (:mod:`ckptd.service.retention_routes`), through the whole app (``create_app``) over
a real local root, in process: only the routes' public surface (status codes, typed errors, the
answers' JSON, what is left on disk), whatever the modules behind them.

* ``POST /v1/runs/{run}/gc`` keeps the N newest steps: a dry run lists what would go and deletes
  nothing (no stale session either); a real run deletes it, answers the stale sessions it reclaimed,
  and both are the run's retention decisions in the web view (who asked, dry run or not);
* a gc request that is not valid (N below 1, a field it does not know, a bad run name) is refused
  with a typed error naming it, and nothing is deleted;
* ``DELETE /v1/checkpoints/{run}/{name}`` removes an unprotected checkpoint (a dry run only says it
  would), keeps the newest and a leased one and says why, and a checkpoint that is not there is a
  typed 404.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

import ckptd.service.retention_routes as retention_routes
from ckptd.service import Settings, create_app
from ckptd.service.auth import iter_routes
from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from stored_tensors import write_tensors
from ckptd_schemas import CheckpointLeased, CheckpointNotFound, InvalidName, InvalidRequest, OpenSession, error_from_body


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "root"
    sessions = SessionStore(LocalStorage(root, durable=False))
    for step in (1, 2, 3, 4):
        write_tensors(sessions, f"rt/{step}", {"model.w": torch.full((4, 4), float(step))}, step=step)
    return root


@pytest.fixture
def app(root):
    return create_app(Settings(root=str(root), stale_session_ttl=0.0), LocalStorage(root, durable=False))


def _call(app, method: str, url: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, url, **kw)
    return asyncio.run(go())


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "runs" / "rt").iterdir() if (p / "COMMITTED").exists())


def test_the_routes_are_this_modules(app):
    mine = {(r.path, m) for r in iter_routes(app.router) for m in r.methods
            if r.endpoint.__module__ == retention_routes.__name__}
    assert mine == {("/v1/runs/{run}/gc", "POST"), ("/v1/checkpoints/{run}/{name}", "DELETE")}


def test_gc_keeps_the_newest_a_dry_run_deletes_nothing_and_both_are_remembered(app, root):
    SessionStore(LocalStorage(root, durable=False)).open("rt", "9", OpenSession(session="stale1", world_size=2))
    r = _call(app, "POST", "/v1/runs/rt/gc", json={"keep_last": 2, "dry_run": True})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert sorted(plan["delete"]) == ["1", "2"] and plan["deleted"] == [] and sorted(plan["keep"]) == ["3", "4"]
    assert plan["reclaimed_sessions"] == [] and (root / "runs" / "rt" / "9" / "sessions" / "stale1").is_dir()
    assert _names(root) == ["1", "2", "3", "4"]

    r = _call(app, "POST", "/v1/runs/rt/gc", json={"keep_last": 2})
    plan = r.json()
    assert r.status_code == 200 and sorted(plan["deleted"]) == ["1", "2"] and _names(root) == ["3", "4"]
    assert any(s.endswith("stale1") for s in plan["reclaimed_sessions"])  # the sweep ran after the collection

    decisions = _call(app, "GET", "/v1/ui/runs/rt/retention").json()["items"]
    assert [(d["source"], d["dry_run"], sorted(d["delete"])) for d in decisions] == [
        ("POST /v1/runs/{run}/gc", False, ["1", "2"]), ("POST /v1/runs/{run}/gc", True, ["1", "2"])]


@pytest.mark.parametrize("url, body, kind, where", [
    ("/v1/runs/rt/gc", {"keep_last": 0}, InvalidRequest, "keep_last"),
    ("/v1/runs/rt/gc", {"keep_last": 1, "keep_all": True}, InvalidRequest, "keep_all"),
    ("/v1/runs/rt/gc", {}, InvalidRequest, "keep_last"),
    ("/v1/runs/Bad_Run/gc", {"keep_last": 1}, InvalidName, "Bad_Run"),
])
def test_a_gc_request_that_is_not_valid_is_refused_and_deletes_nothing(app, root, url, body, kind, where):
    r = _call(app, "POST", url, json=body)
    err = error_from_body(r.json(), r.status_code)
    assert 400 <= r.status_code < 500 and isinstance(err, kind) and where in err.message, r.text
    assert _names(root) == ["1", "2", "3", "4"]


def test_rm_removes_an_unprotected_checkpoint_and_keeps_a_protected_one_saying_why(app, root):
    r = _call(app, "DELETE", "/v1/checkpoints/rt/1", params={"dry_run": "true"})
    assert r.status_code == 200 and r.json() == {"ref": "rt/1", "removed": False, "reason": "would be removed"}
    assert _names(root) == ["1", "2", "3", "4"]
    r = _call(app, "DELETE", "/v1/checkpoints/rt/1")
    assert r.json() == {"ref": "rt/1", "removed": True, "reason": "removed"} and _names(root) == ["2", "3", "4"]

    r = _call(app, "DELETE", "/v1/checkpoints/rt/4")  # the newest
    assert r.status_code == 200 and r.json()["removed"] is False and r.json()["reason"] != "removed"
    assert _call(app, "PUT", "/v1/checkpoints/rt/2/leases/reader7").status_code == 200
    r = _call(app, "DELETE", "/v1/checkpoints/rt/2")  # leased: refused, naming the lease
    err = error_from_body(r.json(), r.status_code)
    assert r.status_code == 409 and isinstance(err, CheckpointLeased) and "client-reader7" in err.message, r.text
    assert err.details["holders"] == ["client-reader7"]
    assert _names(root) == ["2", "3", "4"]

    r = _call(app, "DELETE", "/v1/checkpoints/rt/1")  # gone now
    assert r.status_code == 404 and isinstance(error_from_body(r.json(), 404), CheckpointNotFound)
