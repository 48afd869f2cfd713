"""The FastAPI application: thin handlers over the store core (``ckptd.store``).

Routes (all under ``/v1`` except probes)::

    POST   /v1/checkpoints/{run}/{name}/sessions                  open or join an upload session
    PUT    /v1/checkpoints/{run}/{name}/sessions/{sid}/files/{f}  stream a data file (X-Ckptd-Xxh3)
    PUT    /v1/checkpoints/{run}/{name}/sessions/{sid}/ranks/{r}  a rank's index; the last one commits
    GET    /v1/checkpoints/{run}/{name}/sessions/{sid}?wait=S     session status (long poll)
    DELETE /v1/checkpoints/{run}/{name}/sessions/{sid}            abort
    GET    /v1/runs                                               runs
    GET    /v1/runs/{run}/checkpoints                             committed checkpoints of a run
    GET    /v1/checkpoints/{run}/{name}                           manifest ({name} may be "latest")
    POST   /v1/checkpoints/{run}/{name}/read-plan                 byte ranges that fill given regions
    GET    /v1/checkpoints/{run}/{name}/files/{file}              file bytes (Range supported)
    PUT    /v1/checkpoints/{run}/{name}/leases/{holder}           hold a read lease (a long load renews it)
    DELETE /v1/checkpoints/{run}/{name}/leases/{holder}           release it
    GET    /healthz, /readyz, /metrics

Who may call what (bearer tokens and scopes) is declared in ``auth.ROUTE_RULES``
and enforced by ``auth.AccessMiddleware`` (401) and ``auth.authorize`` (403);
``logs.RequestContextMiddleware`` gives each request its id, access log line and
HTTP metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool

from ckptd_schemas import (
    AdoptFile, CheckpointSummary, InvalidIndex, InvalidRequest, Manifest, NotFound, OpenSession, PayloadTooLarge,
    RankIndex, ReadPlan, ReadRequest, RunSummary, SessionInfo, SessionStatus, UploadResult, check_file, check_session,
    plan_reads,
)

from .. import __version__
from ..storage import Storage, open_storage
from ..store import CheckpointReader
from ..store.faults import crash_point
from ..store.layout import Paths
from ..store.sessions import CommitEvent
from ..store.verification import VerifyRecord, read_record, verify_and_record
from ..store.visibility import Visibility
from .auth import ROUTE_RULES, AccessMiddleware, TokenStore, authorize, check_routes, iter_routes, principal_of
from .errors import install_error_handlers
from .limits import BodyIdleTimeout, UploadSlots, read_plan_budget
from .logs import RequestContextMiddleware
from .metrics import CONTENT_TYPE_LATEST, MeteredSessionStore, Metrics
from .reshard_routes import reshard_router
from .retention_routes import ReadLeases, RetentionPolicy, gc_router
from .settings import Settings

__all__ = ["create_app"]

log = logging.getLogger("ckptd.service")


class ReadPlanBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: list[ReadRequest]
    local_paths: bool = False  # also answer with each file's path here (direct reads, see ReadPlan)


def _parse_range(header: str | None, size: int) -> tuple[int, int]:
    if not header:
        return 0, size
    try:
        unit, spec = header.split("=", 1)
        first, last = spec.split("-", 1)
        if unit.strip() != "bytes" or "," in spec:
            raise ValueError
        if first == "":
            n = int(last)
            start, end = max(size - n, 0), size
        else:
            start = int(first)
            end = min(int(last) + 1, size) if last else size
    except ValueError:
        raise InvalidRequest(f"unsupported Range header {header!r}: expected bytes=START-END") from None
    if start < 0 or start > end or start >= size and size > 0:
        raise InvalidRequest(f"Range {header!r} outside a file of {size} bytes", size=size)
    return start, end


def _parse_body(model: type[BaseModel], raw: bytes, what: str, err: type[InvalidRequest] = InvalidRequest,
                **details: object) -> BaseModel:
    """Validate a JSON body read by hand: a bad body is the client's fault (4xx), never a 500."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise err(f"{what} is invalid at {where}: {first.get('msg', 'invalid')}",
                  errors=[{"loc": [str(p) for p in x.get("loc", ())], "msg": x.get("msg")} for x in errors[:20]],
                  **details) from None


async def _read_body_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit}", limit=limit)
    buf = bytearray()
    async for piece in request.stream():
        buf += piece
        if len(buf) > limit:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes", limit=limit)
    return bytes(buf)


def _refuse_declared_digests(index: RankIndex) -> None:
    """A rank's index may not declare a tensor's layout-independent digest (``TensorEntry.digest``).

    Export and reshard check what they assemble against that digest, so a false one would make a
    checkpoint that verifies fail there. Only the service's own conversions record it, computed from
    the bytes they wrote; a client has no use for it, so the claim is refused rather than checked.
    """
    digests = index.tensor_table.digest
    if digests is None:
        return
    named = [n for n, d in zip(index.tensor_table.name, digests) if d is not None]
    if named:
        raise InvalidIndex(f"index of rank {index.rank} declares the layout-independent digest of tensor "
                           f"{named[0]!r}: only the service's own conversions record tensor digests",
                           rank=index.rank, tensor=named[0])


def create_app(settings: Settings | None = None, storage: Storage | None = None,
               tokens: TokenStore | None = None) -> FastAPI:
    settings = settings or Settings()
    storage = storage or open_storage(settings.root)
    tokens = tokens or TokenStore.from_settings(settings)
    metrics = Metrics()
    uploads = UploadSlots(settings.max_uploads_per_principal)  # file uploads in progress, per token
    visibility = Visibility(storage, on_invisible=metrics.observe_invisible)
    reader = CheckpointReader(storage, visibility=visibility)
    jobs_router, close_jobs, workers = reshard_router(storage, settings, metrics)

    def verify_in_worker(run: str, name: str) -> VerifyRecord:
        return VerifyRecord.model_validate(workers().submit(verify_and_record, storage.url, run, name).result())

    retention = RetentionPolicy(storage, settings, verify=verify_in_worker)
    read_leases = ReadLeases(storage, settings.read_lease_seconds)

    def after_commit(ev: CommitEvent) -> None:
        """Every commit that creates a marker here, on whichever path: verify (then retention, which
        relies on that record), or retention alone."""
        if settings.verify_after_commit:
            fut = workers().submit(verify_and_record, storage.url, ev.run, ev.name)
            fut.add_done_callback(lambda _: retention.after_commit(ev.run))
        else:
            retention.after_commit(ev.run)

    sessions = MeteredSessionStore(storage, metrics, visibility=visibility, on_commit=[after_commit])

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The sweep: commits complete sessions left without a marker, then reclaims stale staging.
        async def reclaim_loop() -> None:
            while True:
                try:
                    await run_in_threadpool(sessions.reclaim_stale, settings.stale_session_ttl)
                except Exception:  # noqa: BLE001 - a failed sweep must not stop the service
                    metrics.storage_errors.labels("reclaim").inc()
                    log.exception("stale-session sweep failed")
                await asyncio.sleep(settings.reclaim_interval)

        task = asyncio.create_task(reclaim_loop())
        log.info("ckptd %s serving storage %s", __version__, storage.url)
        try:
            yield
        finally:
            task.cancel()
            close_jobs()

    app = FastAPI(title="ckptd", version=__version__, lifespan=lifespan, dependencies=[Depends(authorize)],
                  description="Distributed checkpoint and reshard service for sharded PyTorch training.")
    app.state.settings, app.state.storage, app.state.metrics, app.state.tokens = settings, storage, metrics, tokens
    install_error_handlers(app)

    @app.get("/healthz", tags=["probes"])
    async def healthz() -> dict:
        return {"status": "ok", "version": __version__}

    @app.get("/readyz", tags=["probes"])
    async def readyz() -> dict:
        await run_in_threadpool(storage.list, "runs")
        return {"status": "ready", "storage": storage.url}

    @app.get("/metrics", name="metrics", tags=["probes"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    async def metrics_text() -> Response:
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)

    # -- uploads ---------------------------------------------------------------
    @app.post("/v1/checkpoints/{run}/{name}/sessions", response_model=SessionInfo, tags=["upload"],
              response_model_exclude_none=True)  # no `direct` key unless offered
    async def open_session(run: str, name: str, body: OpenSession) -> SessionInfo:
        info = await run_in_threadpool(sessions.open, run, name, body)
        if body.direct_writes and settings.direct_writes:
            info.direct = await run_in_threadpool(sessions.direct_writes, run, name, info.session)
        return info

    @app.put("/v1/checkpoints/{run}/{name}/sessions/{sid}/files/{file}", response_model=UploadResult,
             tags=["upload"])
    async def upload_file(request: Request, run: str, name: str, sid: str, file: str,
                          x_ckptd_xxh3: str = Header(..., pattern=r"^[0-9a-fA-F]{16}$")) -> UploadResult:
        release = uploads.acquire(principal_of(request).name, file)  # 429 past this token's uploads at once
        try:
            sink = await run_in_threadpool(sessions.begin_file, run, name, sid, file)
        except BaseException:
            release()
            raise
        batch_limit = settings.write_batch_bytes
        pending: asyncio.Future | None = None
        parts: list[bytes] = []  # the body's pieces as uvicorn hands them over: batched, never copied
        nbytes = 0
        try:
            async for piece in request.stream():
                parts.append(piece)
                nbytes += len(piece)
                if nbytes >= batch_limit:
                    if pending is not None:
                        await pending
                    pending = asyncio.ensure_future(run_in_threadpool(sink.write_parts, parts))
                    parts, nbytes = [], 0
                    crash_point("upload-mid-stream")
            if pending is not None:
                await pending
            if parts:
                await run_in_threadpool(sink.write_parts, parts)
            declared = request.headers.get("content-length")
            if declared is not None and int(declared) != sink.size:
                raise InvalidRequest(f"file {file!r}: received {sink.size} of {declared} bytes", file=file)
            return await run_in_threadpool(sink.finish, x_ckptd_xxh3)
        except BaseException:
            if pending is not None and not pending.done():
                with contextlib.suppress(BaseException):
                    await pending
            await run_in_threadpool(sink.abort)
            raise
        finally:
            release()

    @app.post("/v1/checkpoints/{run}/{name}/sessions/{sid}/files/{file}/adopt", response_model=UploadResult,
              tags=["upload"])
    async def adopt_file(request: Request, run: str, name: str, sid: str, file: str, body: AdoptFile) -> UploadResult:
        """Direct writes: take the file the rank wrote into the session's directory (``SessionInfo.direct``)
        as the upload of ``file``, after hashing every byte of it as an upload is hashed."""
        if not settings.direct_writes:
            raise InvalidRequest(f"file {file!r}: direct writes are off on this service (CKPTD_DIRECT_WRITES); "
                                 f"upload the file", file=file)
        release = uploads.acquire(principal_of(request).name, file)  # an adopt hashes a whole file: a slot too
        try:
            return await run_in_threadpool(sessions.adopt_file, run, name, sid, file, body)
        finally:
            release()

    waiters: dict[str, asyncio.Event] = {}  # session id -> event set when one of its indexes arrives here

    def _wake(sid: str) -> None:
        event = waiters.pop(sid, None)
        if event is not None:
            event.set()

    @app.put("/v1/checkpoints/{run}/{name}/sessions/{sid}/ranks/{rank}", response_model=SessionStatus,
             tags=["upload"])
    async def put_index(request: Request, run: str, name: str, sid: str, rank: int) -> SessionStatus:
        raw = await _read_body_limited(request, settings.max_index_bytes)
        index = await run_in_threadpool(_parse_body, RankIndex, raw, f"index of rank {rank}", InvalidIndex,
                                        rank=rank)  # off the event loop: a large index parses for seconds
        if index.rank != rank:
            raise InvalidRequest(f"index body is for rank {index.rank}, URL says rank {rank}", rank=rank)
        _refuse_declared_digests(index)
        try:
            return await run_in_threadpool(sessions.put_index, run, name, sid, index)
        finally:
            _wake(sid)

    @app.get("/v1/checkpoints/{run}/{name}/sessions/{sid}", response_model=SessionStatus, tags=["upload"])
    async def session_status(run: str, name: str, sid: str,
                             wait: float = Query(0.0, ge=0.0, le=60.0)) -> SessionStatus:
        deadline = time.monotonic() + wait
        event: asyncio.Event | None = None
        try:
            while True:
                event = waiters.setdefault(sid, asyncio.Event())  # before reading: no lost wake-up
                st = await run_in_threadpool(sessions.status, run, name, sid)
                left = deadline - time.monotonic()
                if st.state != "open" or left <= 0:
                    return st
                # Woken at once when an index arrives at this process; polled every 0.1 s otherwise
                # (another replica may take the last index).
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), min(0.1, left))
        finally:
            if event is not None and waiters.get(sid) is event:
                del waiters[sid]  # a waiter sharing it falls back to the 0.1 s poll

    @app.delete("/v1/checkpoints/{run}/{name}/sessions/{sid}", status_code=204, tags=["upload"])
    async def abort_session(run: str, name: str, sid: str) -> Response:
        await run_in_threadpool(sessions.abort, run, name, sid)
        return Response(status_code=204)

    # -- reads -----------------------------------------------------------------
    @app.get("/v1/runs", response_model=list[RunSummary], tags=["read"])
    async def list_runs(request: Request) -> list[RunSummary]:
        principal = principal_of(request)
        return [r for r in await run_in_threadpool(reader.list_runs) if principal.can_read(r.run)]

    @app.get("/v1/runs/{run}/checkpoints", response_model=list[CheckpointSummary], tags=["read"])
    async def list_checkpoints(run: str) -> list[CheckpointSummary]:
        return await run_in_threadpool(reader.list_checkpoints, run)

    @app.get("/v1/checkpoints/{run}/{name}", response_model=Manifest, tags=["read"])
    async def get_manifest(run: str, name: str) -> Response:
        """The manifest's bytes as stored, served only when they hash to the marker's digest (sent as
        ``X-Ckptd-Manifest-Xxh3``, so a client checks what it received against what was committed)."""
        c = await run_in_threadpool(reader.committed, run, name)
        await run_in_threadpool(read_leases.touch, run, c.name)
        raw = await run_in_threadpool(visibility.manifest_bytes, c)
        return Response(raw, media_type="application/json",
                        headers={"X-Ckptd-Name": c.name, "X-Ckptd-Manifest-Xxh3": c.digest,
                                 "X-Ckptd-Lease-Seconds": f"{settings.read_lease_seconds:g}"})

    @app.post("/v1/checkpoints/{run}/{name}/read-plan", response_model=ReadPlan, tags=["read"],
              response_model_exclude_none=True)  # no local_paths key unless offered: older clients parse it
    async def read_plan(request: Request, run: str, name: str) -> ReadPlan:
        raw = await _read_body_limited(request, settings.max_index_bytes)
        body = await run_in_threadpool(_parse_body, ReadPlanBody, raw, "read-plan request")  # off the event loop
        manifest = await run_in_threadpool(reader.manifest, run, name)
        await run_in_threadpool(read_leases.touch, run, manifest.name)
        budget = read_plan_budget(len(raw), settings.read_plan_chunk_budget, settings.read_plan_answer_budget)
        try:
            plan = await run_in_threadpool(plan_reads, manifest, body.requests, budget=budget)
        except PayloadTooLarge:
            metrics.limit_refusals.labels("read_plan").inc()
            raise
        if body.local_paths and settings.direct_reads:
            paths = {f.file: storage.local_path(Paths.file(run, manifest.name, manifest.session, f.file))
                     for f in plan.fetches}
            if all(paths.values()):
                plan.local_paths = paths  # type: ignore[assignment]
        raw_plan = await run_in_threadpool(plan.model_dump_json, exclude_none=True)  # a large answer: not on the loop
        return Response(raw_plan, media_type="application/json")  # type: ignore[return-value]

    @app.post("/v1/checkpoints/{run}/{name}/verify", response_model=VerifyRecord, tags=["read"])
    async def verify_checkpoint(run: str, name: str) -> VerifyRecord:
        """Re-read and check every byte of a committed checkpoint in a worker process (as `ckptd verify`),
        record the outcome and return it; 200 either way: ``ok`` says whether it holds."""
        name, _ = await run_in_threadpool(reader.resolve, run, name)  # 404 before any work; the manifest is checked
        rec = await asyncio.wrap_future(workers().submit(verify_and_record, storage.url, run, name))
        return VerifyRecord.model_validate(rec)

    @app.get("/v1/checkpoints/{run}/{name}/verification", response_model=VerifyRecord, tags=["read"])
    async def get_verification(run: str, name: str) -> VerifyRecord:
        """The last verification the service recorded for this checkpoint (404 when there is none)."""
        name, _ = await run_in_threadpool(reader.resolve, run, name)
        rec = await run_in_threadpool(read_record, storage, run, name)
        if rec is None:
            raise NotFound(f"checkpoint {run}/{name} has not been verified by the service", ref=f"{run}/{name}")
        return rec

    @app.get("/v1/checkpoints/{run}/{name}/files/{file}", tags=["read"],
             responses={206: {"description": "partial content"}})
    async def get_file(run: str, name: str, file: str, range: str | None = Header(None)) -> Response:
        check_file(file)
        key, size = await run_in_threadpool(reader.file_key, run, name, file)
        await run_in_threadpool(read_leases.touch, run, key.split("/")[2])  # runs/RUN/NAME/...: the concrete name
        start, end = _parse_range(range, size)
        # A committed file absent or resized on storage is corrupt: 422 before any byte is sent.
        await run_in_threadpool(storage.check_committed, key, size, file=file)
        headers = {"Accept-Ranges": "bytes", "Content-Length": str(end - start)}
        status = 200
        if range:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{max(end - 1, start)}/{size}"
        piece = storage.read_piece  # per read and send: bounds the memory of one GET
        if end - start <= piece:
            data = await run_in_threadpool(storage.read_committed, key, start, end, size, file=file)
            return Response(data, status_code=status, headers=headers, media_type="application/octet-stream")

        async def pieces() -> AsyncIterator[bytes]:
            pos = start
            while pos < end:
                nxt = min(pos + piece, end)
                await run_in_threadpool(read_leases.touch, run, key.split("/")[2])  # a long stream keeps its lease
                yield await run_in_threadpool(storage.read_committed, key, pos, nxt, size, file=file)
                pos = nxt

        return StreamingResponse(pieces(), status_code=status, headers=headers,
                                 media_type="application/octet-stream")

    @app.put("/v1/checkpoints/{run}/{name}/leases/{holder}", tags=["read"])
    async def hold_lease(run: str, name: str, holder: str) -> dict:
        """Lease a checkpoint for a reader that reads for longer than a lease (direct reads fetch no
        byte through the service): renewed by the reader every third of ``seconds``; gc spares it."""
        check_session(holder)  # the same safe-name rule as a session id
        c = await run_in_threadpool(reader.committed, run, name)
        await run_in_threadpool(read_leases.hold, run, c.name, holder)
        return {"ref": c.ref, "holder": holder, "seconds": settings.read_lease_seconds}

    @app.delete("/v1/checkpoints/{run}/{name}/leases/{holder}", status_code=204, tags=["read"])
    async def release_lease(run: str, name: str, holder: str) -> Response:
        check_session(holder)  # the same safe-name rule as a session id
        c = await run_in_threadpool(reader.committed, run, name)
        await run_in_threadpool(read_leases.release, run, c.name, holder)
        return Response(status_code=204)

    app.include_router(jobs_router)
    app.include_router(gc_router(storage, settings, verify_in_worker))
    check_routes(app)
    open_paths = {r.path for r in iter_routes(app.router) if ROUTE_RULES[r.name].access == "open"}
    app.add_middleware(BodyIdleTimeout, seconds=settings.body_idle_timeout_seconds, metrics=metrics)
    app.add_middleware(AccessMiddleware, tokens=tokens, open_paths=open_paths, index_limit=settings.max_index_bytes,
                       routes=app.router.routes)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)  # outermost: ids and logs for 401s too
    return app
