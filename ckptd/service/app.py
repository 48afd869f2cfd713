"""The FastAPI application: thin handlers over the store core (``ckptd.store``).

``create_app`` builds the shared objects (``services.Services``) once and includes the route
modules, each of which lists its routes in call order: ``upload_routes`` (a save's sessions, files
and indexes), ``read_routes`` (listings, manifests, load trees, read plans, file bytes, verification,
leases), ``reshard_routes`` and ``drill_routes`` (jobs), ``retention_routes`` (gc, one removal),
``ui_routes`` and ``ui_static`` (the web view), ``docs`` (``/openapi.json``, ``/docs``); the probes
(``/``, ``/healthz``, ``/readyz``, ``/metrics``) are here. All routes are under ``/v1`` except these.

Who may call what (bearer tokens and scopes) is declared in ``auth.ROUTE_RULES``
and enforced by ``auth.AccessMiddleware`` (401) and ``auth.authorize`` (403);
``logs.RequestContextMiddleware`` gives each request its id, access log line and
HTTP metrics. Inside them, ``limits.PrincipalRequests`` bounds one token's requests
in progress (429; probes are never counted) and ``limits.BodyTimeouts`` bounds each
request body in time (408). The probes answer from the event loop alone
(``/readyz`` adds one storage listing and a small write at the root, at most once per few seconds:
``readiness``), behind no limit a token holder can fill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Literal

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ckptd_schemas import StoragePermanent

from .. import __version__
from ..storage import Storage
from ..store.tiers import TieredStorage, open_root
from ..store import CheckpointReader
from ..store.durable import DurableCopier
from ..store.leases import ReadLeases
from ..store.rereads import Rereads
from ..store.retention import RetentionPolicy
from ..store.events import AfterCommit, CommitEvent
from ..store.sessions import SessionStore
from ..store.space import Space
from ..store.verification import VerifyRecord, verify_and_record
from ..store.visibility import Visibility
from .auth import ROUTE_RULES, AccessMiddleware, TokenStore, authorize, check_routes, iter_routes
from .docs import install_docs
from .drill_routes import DrillPolicy, count_drill, drill_router
from .local_uploads import LocalUploads
from .job_watch import JobWatch
from .errors import install_error_handlers
from .limits import BodyTimeouts, PrincipalRequests, UploadSlots, widen_threads
from .logs import RequestContextMiddleware
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .readiness import PROBE_DEADLINE, Readiness, answer
from .read_routes import read_router
from .reshard_routes import reshard_router
from .workers import Workers
from .retention_routes import gc_router
from .services import Services
from .settings import Settings
from .gc_log import GcLog
from .ui_routes import ui_router
from .ui_static import install_ui
from .upload_routes import upload_router

__all__ = ["create_app"]

log = logging.getLogger("ckptd.service")


def create_app(settings: Settings | None = None, storage: Storage | None = None,
               tokens: TokenStore | None = None) -> FastAPI:
    settings = settings or Settings()
    storage = storage or open_root(settings.storage_url())
    tokens = tokens or TokenStore.from_settings(settings)
    metrics = Metrics()
    uploads = UploadSlots(settings.max_uploads_per_principal)  # file uploads in progress, per token
    visibility = Visibility(storage, cache_bytes=settings.manifest_cache_bytes,
                            on_invisible=metrics.observe_invisible)
    metrics.watch_visibility(visibility)
    reader = CheckpointReader(storage, visibility=visibility)
    workers = Workers(settings.reshard_workers)  # reshard jobs, verifications and drills: one pool
    # Job records name this replica; jobs of replicas that stopped are resumed (drills) or failed (reshard).
    job_watch = JobWatch(storage, workers, settings, on_drill=lambda job_id: count_drill(metrics, f"job {job_id}"))
    jobs_router = reshard_router(storage, job_watch, metrics)

    def verify_in_worker(run: str, name: str) -> VerifyRecord:
        return VerifyRecord.model_validate(workers().submit(verify_and_record, storage.url, run, name).result())

    gc_log = GcLog()  # the last gc decisions, for the web view
    retention = RetentionPolicy(storage, settings.retention_keep_last, settings.retention_keep_every,
                                verify=verify_in_worker, record=gc_log.record)
    read_leases = ReadLeases(storage, settings.read_lease_seconds, settings.read_leases_per_token)

    # The re-reads due on the root (store.rereads): this replica's commits at once, any replica's on each sweep.
    rereads = Rereads(storage, visibility, lambda fn, *args: workers().submit(fn, *args), settings.reshard_workers,
                      renew_every=settings.job_heartbeat_seconds, claim_for=settings.job_takeover_seconds,
                      on_share=metrics.observe_reread, on_done=retention.after_commit)

    def after_commit(ev: CommitEvent) -> None:
        """Every commit that creates a marker here, on whichever path: verify (then retention, which
        relies on that record), or retention alone. The independent re-read of bytes the commit did not
        read (checked as they arrived: ``ev.reread``) is always due, in shares; ``CKPTD_VERIFY_AFTER_COMMIT``
        asks for a verification after every other commit."""
        if ev.reread:
            rereads.start(ev.run, ev.name, ev.session)
        elif settings.verify_after_commit:
            fut = workers().submit(verify_and_record, storage.url, ev.run, ev.name)
            fut.add_done_callback(lambda _: retention.after_commit(ev.run))
        else:
            retention.after_commit(ev.run)

    copier = None
    if isinstance(storage, TieredStorage):  # --durable: a background copy of every commit to the durable tier
        copier = DurableCopier(storage, keep_fast=settings.fast_keep_last, scan_seconds=settings.durable_scan_seconds)
        metrics.watch_durable(copier)
    drills = DrillPolicy(storage, settings, job_watch, metrics)  # CKPTD_DRILL_EVERY: a drill every N commits of a run
    # Every way bytes enter a session asks the root's space first: the writer's quota, the root's reserve.
    sessions = SessionStore(storage, visibility=visibility, dead_after=settings.dead_session_after,
                            space=Space(storage, settings.root_reserve), read_back=settings.verify_before_visible)
    # The store's one observer channel: metrics first (commits, refusals, open and reclaimed sessions),
    # then what follows every commit made here, whichever path committed.
    metrics.watch_sessions(sessions)
    for action in [after_commit, drills.after_commit] + ([copier.notify] if copier is not None else []):
        sessions.observers.add(AfterCommit(action))
    local = LocalUploads(sessions, tokens, uploads, metrics) if settings.local_uploads else None
    services = Services(settings=settings, storage=storage, metrics=metrics, visibility=visibility, reader=reader,
                        sessions=sessions, uploads=uploads, read_leases=read_leases, workers=workers, durable=copier,
                        local=local)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The sweep: commits complete sessions left without a marker, then reclaims stale staging, then
        # takes the re-reads due.
        async def reclaim_loop() -> None:
            while True:
                try:
                    await run_in_threadpool(sessions.sweeper.reclaim_stale, settings.stale_session_ttl)
                except StoragePermanent as e:  # a read-only root: nothing to reclaim there, one line each sweep
                    metrics.storage_errors.labels("reclaim").inc()
                    log.warning("stale-session sweep skipped: %s", e.message)
                except Exception:  # noqa: BLE001 - a failed sweep must not stop the service
                    metrics.storage_errors.labels("reclaim").inc()
                    log.exception("stale-session sweep failed")
                try:  # the re-reads due: a stopped replica's, or this one's before a restart
                    await run_in_threadpool(rereads.sweep)
                except Exception:  # noqa: BLE001 - a failed sweep must not stop the service
                    log.exception("re-read sweep failed")
                await asyncio.sleep(settings.reclaim_interval)

        widen_threads()  # a save's rank indexes wait for the store together, not for a thread each
        task = asyncio.create_task(reclaim_loop())
        job_watch.start()  # its first sweep finds the jobs a stopped replica left queued or running
        if copier is not None:
            copier.start()  # its first scan finds what a crash left committed locally only
        if local is not None:
            local.start()  # co-located ranks hand their files over here (named in each session's answer)
        log.info("ckptd %s serving storage %s", __version__, storage.url)
        try:
            yield
        finally:
            task.cancel()
            if local is not None:
                local.stop()
            drills.close()  # no drill queued past this point
            await run_in_threadpool(rereads.stop)  # nor a re-read's share; its claims released
            await run_in_threadpool(job_watch.stop)  # heartbeat deleted: its jobs are taken over at once
            if copier is not None:
                await run_in_threadpool(copier.stop)
            workers.close()

    app = FastAPI(title="ckptd", version=__version__, lifespan=lifespan, dependencies=[Depends(authorize)],
                  description="Distributed checkpoint and reshard service for sharded PyTorch training.",
                  openapi_url=None, docs_url=None, redoc_url=None)  # served offline by install_docs
    app.state.settings, app.state.storage, app.state.metrics, app.state.tokens = settings, storage, metrics, tokens
    readiness = app.state.readiness = Readiness(storage, on_failure=lambda _: metrics.storage_errors.labels(
        "readyz").inc())
    install_error_handlers(app)

    @app.get("/", tags=["probes"])
    async def index() -> dict:
        """Where to go from here: the web view, the API's documentation, the probes."""
        return {"service": "ckptd", "version": __version__, "ui": "/ui", "docs": "/docs", "health": "/healthz"}

    # Probes stay on the app itself: install_docs finds the open routes among the app's own routes.
    @app.get("/healthz", tags=["probes"])
    async def healthz() -> dict:
        return {"status": "ok", "version": __version__}

    # /readyz probes the storage on a thread of its own, and waits for it at most PROBE_DEADLINE: requests
    # that fill the shared pool never delay it, nor does a store that retries or hangs.

    @app.get("/readyz", tags=["probes"])
    async def readyz(request: Request, need: Literal["writes", "reads"] = Query(
            "writes", alias="for", description="writes: the root can be listed and written (a service that "
            "saves); reads: it can be listed (a service that serves loads from a read-only root)")) -> JSONResponse:
        """Ready when the storage answers a listing and, unless ``for=reads``, its root can be written (a
        hidden object created and deleted, at most once per few seconds); the body says both, and why not."""
        try:
            probe = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(readiness.start())), PROBE_DEADLINE)
        except asyncio.TimeoutError:
            probe = readiness.overdue(PROBE_DEADLINE)
        status, body = answer(probe, storage.url, need, request.scope.get("state", {}).get("request_id"))
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", name="metrics", tags=["probes"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    async def metrics_text() -> Response:
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)

    # The order of the routes as they always were: probes, uploads, reads, reshard jobs, gc.
    app.include_router(upload_router(services))
    app.include_router(read_router(services))
    app.include_router(jobs_router)
    app.include_router(drill_router(storage, job_watch, metrics))
    app.include_router(gc_router(storage, lambda: sessions.sweeper.reclaim_stale(settings.stale_session_ttl),
                                 verify_in_worker, record=gc_log.record))
    app.include_router(ui_router(services, gc_log))
    install_ui(app)
    install_docs(app, ROUTE_RULES)
    check_routes(app)
    open_paths = {r.path for r in iter_routes(app.router) if ROUTE_RULES[r.name].access == "open"}
    # Innermost first: a body's time limits, then one token's requests at once (429), then who it is (401).
    app.add_middleware(BodyTimeouts, idle_seconds=settings.body_idle_timeout_seconds,
                       min_rate=settings.body_min_bytes_per_second, grace_seconds=settings.body_rate_grace_seconds,
                       metrics=metrics)
    app.add_middleware(PrincipalRequests, limit=settings.max_requests_per_principal, open_paths=open_paths,
                       routes=app.router.routes, metrics=metrics)
    app.add_middleware(AccessMiddleware, tokens=tokens, open_paths=open_paths, index_limit=settings.max_index_bytes,
                       routes=app.router.routes)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)  # outermost: ids and logs for 401s too
    return app
