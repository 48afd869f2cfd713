"""The service's shared objects built as ``create_app`` builds them, over a real local root, for the unit
tests of one route module: :func:`services` makes a :class:`~ckptd.service.services.Services`,
:func:`job_watch` the job watch over one worker process,
:func:`app_with` mounts routers in a bare FastAPI app with the service's error handlers (every
request one principal's: the open service's unless told), :func:`call` sends one request in process
(``httpx.ASGITransport``), and :func:`save_one` saves a one-rank checkpoint through the upload routes.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, Iterator

import httpx
import xxhash
from fastapi import APIRouter, FastAPI, Request

from ckptd.service.auth import OPEN_PRINCIPAL, Principal
from ckptd.service.errors import install_error_handlers
from ckptd.service.job_watch import JobWatch
from ckptd.service.limits import UploadSlots
from ckptd.service.metrics import Metrics
from ckptd.service.services import Services
from ckptd.service.settings import Settings
from ckptd.service.workers import Workers
from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader, SessionStore
from ckptd.store.leases import ReadLeases
from ckptd.store.visibility import Visibility

FILE = "r000000-0000.bin"


def services(root: Path, **settings: Any) -> Services:
    """One :class:`Services` over ``root`` (its workers never started unless a route needs them)."""
    s = Settings(root=str(root), **settings)
    storage = LocalStorage(root, durable=False)
    metrics = Metrics()
    visibility = Visibility(storage, cache_bytes=s.manifest_cache_bytes, on_invisible=metrics.observe_invisible)
    sessions = SessionStore(storage, visibility=visibility, dead_after=s.dead_session_after)
    metrics.watch_sessions(sessions)
    return Services(settings=s, storage=storage, metrics=metrics, visibility=visibility,
                    reader=CheckpointReader(storage, visibility=visibility), sessions=sessions,
                    uploads=UploadSlots(s.max_uploads_per_principal),
                    read_leases=ReadLeases(storage, s.read_lease_seconds, s.read_leases_per_token),
                    workers=Workers(s.reshard_workers))


@contextlib.contextmanager
def job_watch(storage: LocalStorage) -> Iterator[tuple[JobWatch, Metrics]]:
    """The job watch over a pool of one worker process, and metrics, as ``create_app`` makes them;
    the watch stopped and the pool closed at the end."""
    workers = Workers(1)
    watch = JobWatch(storage, workers, Settings(root=str(storage.root)))
    try:
        yield watch, Metrics()
    finally:
        watch.stop()
        workers.close()


def app_with(*routers: APIRouter, principal: Principal = OPEN_PRINCIPAL) -> FastAPI:
    """``routers`` in one app with the service's error handlers; every request is ``principal``'s (as
    ``auth.AccessMiddleware`` names it: by default the open service's, which may do anything)."""
    app = FastAPI()
    install_error_handlers(app)
    for r in routers:
        app.include_router(r)

    @app.middleware("http")
    async def as_principal(request: Request, call_next):
        request.scope.setdefault("state", {})["principal"] = principal
        return await call_next(request)

    return app


def call(app: FastAPI, method: str, url: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, url, **kw)
    return asyncio.run(go())


def rank_index(data: bytes, *, rank: int = 0, world: int = 1, name: str = "model.w",
               digest: str | None = None) -> dict:
    """Rank ``rank``'s index: its band of float32 tensor ``name`` in file ``r<rank>-0000.bin``."""
    n = len(data) // 4
    tensor: dict[str, Any] = {
        "name": name, "shape": [n * world], "dtype": "float32", "group": name.split(".")[0], "chunks": [{
            "kind": "box", "rank": rank, "offsets": [n * rank], "sizes": [n], "location": {
                "file": f"r{rank:06d}-0000.bin", "offset": 0, "length": len(data), "raw_length": len(data),
                "xxh3": xxhash.xxh3_64_hexdigest(data)}}]}
    if digest is not None:
        tensor["digest"] = digest
    return {"rank": rank, "world_size": world, "files": [f"r{rank:06d}-0000.bin"], "tensors": [tensor]}


def save_one(app: FastAPI, ref: str, data: bytes, *, step: int | None = None, sid: str = "s1") -> httpx.Response:
    """Open, upload and index a one-rank checkpoint through the upload routes; the index's answer."""
    base = f"/v1/checkpoints/{ref}/sessions"
    r = call(app, "POST", base, json={"session": sid, "world_size": 1, "step": step})
    assert r.status_code == 200, r.text
    r = call(app, "PUT", f"{base}/{sid}/files/{FILE}", content=data,
             headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
    assert r.status_code == 200, r.text
    return call(app, "PUT", f"{base}/{sid}/ranks/0", json=rank_index(data))
