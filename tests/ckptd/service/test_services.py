"""What the route modules share (:mod:`ckptd.service.services`): one :class:`Services`, built once.

* without a durable tier or a co-located socket those parts are None, and the object cannot be
  changed once built (every router reads the same parts for the life of the app);
* the routers built from one ``Services`` work on its parts: a checkpoint saved through the upload
  routes is read through the read routes, its commit is counted by its metrics, and a byte read
  without a lease is leased under its read leases' own holder.
"""

from __future__ import annotations

import dataclasses

import pytest

from ckptd.service.read_routes import read_router
from ckptd.service.services import Services
from ckptd.service.upload_routes import upload_router

from .wiring import FILE, app_with, call, save_one, services

DATA = bytes(range(128)) * 8


@pytest.fixture
def svc(tmp_path):
    s = services(tmp_path / "root")
    yield s
    s.workers.close()


def test_optional_parts_are_none_and_nothing_is_rebound(svc):
    assert isinstance(svc, Services) and svc.durable is None and svc.local is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        svc.storage = None  # type: ignore[misc]
    assert {f.name for f in dataclasses.fields(Services)} >= {
        "settings", "storage", "metrics", "visibility", "reader", "sessions", "uploads", "read_leases", "workers"}


def test_routers_of_one_services_share_its_parts(svc):
    app = app_with(upload_router(svc), read_router(svc))
    st = save_one(app, "sh/4", DATA, step=4).json()
    assert st["state"] == "committed"
    r = call(app, "GET", "/v1/checkpoints/sh/latest")
    assert r.status_code == 200 and r.json()["name"] == "4"
    assert r.headers["x-ckptd-manifest-xxh3"] == st["manifest_xxh3"]
    assert svc.metrics.registry.get_sample_value("ckptd_commits_total") == 1  # the same metrics heard the commit
    r = call(app, "GET", f"/v1/checkpoints/sh/4/files/{FILE}", headers={"Range": "bytes=0-7"})
    assert r.status_code == 206 and r.content == DATA[:8]
    assert svc.storage.list("leases/sh/4") == [f"{svc.read_leases.holder}.json"]  # leased by these read leases
