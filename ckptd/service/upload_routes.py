"""Upload routes: a save's sessions, files and rank indexes (``write`` scope, ``auth.ROUTE_RULES``).

Call order of a save::

    POST   /v1/checkpoints/{run}/{name}/sessions                        open or join an upload session
    PUT    /v1/checkpoints/{run}/{name}/sessions/{sid}/files/{f}        stream a data file (X-Ckptd-Xxh3; with
                                                                        X-Ckptd-Chunks, its chunks declared first), or
    POST   /v1/checkpoints/{run}/{name}/sessions/{sid}/files/{f}/link   hold an earlier checkpoint's file (incremental), or
    POST   .../files/{f}/presign, then PUT to the store, then .../confirm  upload to the object store (direct uploads)
    PUT    /v1/checkpoints/{run}/{name}/sessions/{sid}/ranks/{r}        each rank's index; the last one commits
    GET    /v1/checkpoints/{run}/{name}/sessions/{sid}?wait=S           session status (long poll; &durable=true:
                                                                        until durable, with a durable tier)
    DELETE /v1/checkpoints/{run}/{name}/sessions/{sid}                  abort

Every file route ends in the store's intake, behind its one write gate (``session_reads.writable``); the
ranks long-polling a session's status share one watch of it in each process (``session_watch``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import APIRouter, Header, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from ckptd_schemas import (
    ConfirmUpload, Forbidden, InvalidIndex, InvalidRequest, LinkFile, OpenSession, PayloadTooLarge, PresignedUpload,
    PresignUpload, RankIndex, SessionInfo, SessionStatus, UploadResult, check_name, check_run, check_session, parse_ref,
)

from ckptd_schemas import arrival
from ckptd_schemas.arrival import CHUNKS_HEADER

from ..store.session_reads import read_meta
from .auth import principal_of
from .bodies import parse_body, read_body_limited
from .services import Services
from .session_watch import SessionWatches

__all__ = ["MAX_WAIT_SECONDS", "upload_router"]

#: The longest a status request may wait for its session to settle: long enough that a rank waits for a
#: save of 10,000 ranks in one request (each request is about a millisecond of the service's CPU).
MAX_WAIT_SECONDS = 600.0
T = TypeVar("T")


def _refuse_declared_digests(index: RankIndex) -> None:
    """A rank's index may not declare a tensor's layout-independent digest (``TensorEntry.digest``).

    Export and reshard check what they assemble against that digest, so a false one would make a
    checkpoint that verifies fail there. Only the service's own conversions record it, computed from
    the bytes they wrote; a client has no use for it, so the claim is refused rather than checked.
    """
    named = [n for n, d in zip(index.tensor_table.name, index.tensor_table.digest or ()) if d is not None]
    if named:
        raise InvalidIndex(f"index of rank {index.rank} declares the layout-independent digest of tensor "
                           f"{named[0]!r}: only the service's own conversions record tensor digests",
                           rank=index.rank, tensor=named[0])


async def _first_bytes(body: AsyncIterator[bytes], n: int) -> tuple[bytes, bytes]:
    """The first ``n`` bytes of ``body`` and what came with them past ``n`` (400 when it ends before)."""
    got: list[bytes] = []
    have = 0
    async for piece in body:
        got.append(piece)
        have += len(piece)
        if have >= n:
            break
    if have < n:
        raise InvalidRequest(f"the body ended after {have} of the {n} bytes its {CHUNKS_HEADER} header declares",
                             field=CHUNKS_HEADER)
    joined = b"".join(got)
    return joined[:n], joined[n:]


def upload_router(svc: Services) -> APIRouter:
    router = APIRouter(tags=["upload"])
    settings, sessions, uploads = svc.settings, svc.sessions, svc.uploads

    @router.post("/v1/checkpoints/{run}/{name}/sessions", response_model=SessionInfo)
    async def open_session(request: Request, run: str, name: str, body: OpenSession) -> SessionInfo:
        if body.parent is not None:
            # A parent is kept from retention while this checkpoint is visible, and whether it exists is
            # answered: naming one takes read access to its run (write on this run is not enough).
            parent_run = parse_ref(body.parent).run
            if not principal_of(request).can_read(parent_run):
                raise Forbidden(f"parent {body.parent!r}: this token may not read run {parent_run}",
                                field="parent", run=parent_run)
        info = await run_in_threadpool(sessions.open, run, name, body, principal_of(request))
        info.arrival_checks = True
        # bytes go through here, checked as they arrive, unless the service opts in to direct uploads
        if body.direct_uploads and settings.direct_uploads and sessions.storage.presigns:
            info.presigned = True
        if svc.local is not None and svc.local.address is not None:  # ranks on this host hand files over there
            info.local_socket, info.local_host = svc.local.address, svc.local.host
            info.local_key = svc.local.key_for(principal_of(request).name, run, name, info.session)
        return info

    async def in_slot(request: Request, file: str, way: Callable[..., T], *args: Any) -> T:
        """``way(*args)`` off the event loop, holding one of the token's upload slots (a presign creates a
        multipart upload, a confirmation assembles it, a link on S3 is a copy): 429 past them."""
        with uploads.held(principal_of(request).name, file):
            return await run_in_threadpool(way, *args)

    @router.post("/v1/checkpoints/{run}/{name}/sessions/{sid}/files/{file}/presign", response_model=PresignedUpload)
    async def presign_file(request: Request, run: str, name: str, sid: str, file: str,
                           body: PresignUpload) -> PresignedUpload:
        """Direct uploads: presigned URLs through which the client PUTs ``file`` straight into the
        object store (no byte through here); 400 where the store takes none (the client then uploads)."""
        if not settings.direct_uploads:
            raise InvalidRequest(f"file {file!r}: direct uploads are off on this service (CKPTD_DIRECT_UPLOADS); "
                                 f"upload the file", file=file)
        return await in_slot(request, file, sessions.intake.presign, run, name, sid, file, body,
                             settings.direct_upload_seconds, principal_of(request))

    @router.post("/v1/checkpoints/{run}/{name}/sessions/{sid}/files/{file}/confirm", response_model=UploadResult)
    async def confirm_file(request: Request, run: str, name: str, sid: str, file: str,
                           body: ConfirmUpload) -> UploadResult:
        """Direct uploads: the file PUT with presigned URLs is in place (``Intake.place``: its parts are
        assembled now, its size and the store's SHA-256, where kept, checked now; every byte at the commit)."""
        return await in_slot(request, file, sessions.intake.place, run, name, sid, file, body)

    @router.post("/v1/checkpoints/{run}/{name}/sessions/{sid}/files/{file}/link", response_model=UploadResult)
    async def link_file(request: Request, run: str, name: str, sid: str, file: str, body: LinkFile) -> UploadResult:
        """Incremental saves: a file of an earlier visible checkpoint of the run held as ``file``, linked in
        the store, not sent (``Intake.place``); 400 when it cannot be (the saver then sends the bytes)."""
        return await in_slot(request, file, sessions.intake.place, run, name, sid, file, body, principal_of(request))

    @router.put("/v1/checkpoints/{run}/{name}/sessions/{sid}/files/{file}", response_model=UploadResult)
    async def upload_file(request: Request, run: str, name: str, sid: str, file: str,
                          x_ckptd_xxh3: str = Header(..., pattern=r"^[0-9a-fA-F]{16}$"),
                          x_ckptd_chunks: int | None = Header(None, ge=0)) -> UploadResult:
        """The file's bytes, hashed as they are written; with ``X-Ckptd-Chunks: N``, the body's first N
        bytes declare its chunks (``ckptd_schemas.arrival``), each checked as it passes."""
        if x_ckptd_chunks is not None and x_ckptd_chunks > arrival.MAX_BYTES:
            raise PayloadTooLarge(f"file {file!r}: a chunk declaration of {x_ckptd_chunks} bytes is over the "
                                  f"{arrival.MAX_BYTES} a service takes", file=file, field=CHUNKS_HEADER,
                                  limit=arrival.MAX_BYTES)
        with uploads.held(principal_of(request).name, file):  # 429 past this token's uploads at once
            body, sink, pending = request.stream(), None, None
            try:
                parts: list[bytes] = []  # batched, never copied
                declared = None
                if x_ckptd_chunks is not None:
                    head, rest = await _first_bytes(body, x_ckptd_chunks)
                    declared, parts = await run_in_threadpool(arrival.parse, head, file), [rest] if rest else []
                sink = await run_in_threadpool(sessions.intake.receive, run, name, sid, file, principal_of(request),
                                               declared)
                nbytes = sum(map(len, parts))
                async for piece in body:
                    parts.append(piece)
                    nbytes += len(piece)
                    if nbytes >= settings.write_batch_bytes:
                        if pending is not None:
                            await pending
                        pending = asyncio.ensure_future(run_in_threadpool(sink.write_parts, parts))
                        parts, nbytes = [], 0
                if pending is not None:
                    await pending
                if parts:
                    await run_in_threadpool(sink.write_parts, parts)
                declared_length = request.headers.get("content-length")
                if declared_length is not None and int(declared_length) != sink.size + (x_ckptd_chunks or 0):
                    raise InvalidRequest(f"file {file!r}: received {sink.size} of {declared_length} bytes", file=file)
                return await run_in_threadpool(sink.finish, x_ckptd_xxh3)
            except BaseException:
                if pending is not None and not pending.done():
                    with contextlib.suppress(BaseException):
                        await pending
                if sink is not None:
                    await run_in_threadpool(sink.abort)
                raise

    @router.put("/v1/checkpoints/{run}/{name}/sessions/{sid}/ranks/{rank}", response_model=SessionStatus)
    async def put_index(request: Request, run: str, name: str, sid: str, rank: int) -> SessionStatus:
        raw = await read_body_limited(request, settings.max_index_bytes)
        index = await run_in_threadpool(parse_body, RankIndex, raw, f"index of rank {rank}", InvalidIndex,
                                        rank=rank)  # off the event loop: a large index parses for seconds
        if index.rank != rank:
            raise InvalidRequest(f"index body is for rank {index.rank}, URL says rank {rank}", rank=rank)
        _refuse_declared_digests(index)
        st: SessionStatus | None = None
        try:
            st = await run_in_threadpool(sessions.put_index, run, name, sid, index, principal_of(request))
            return st
        finally:
            if st is None or st.state != "open":  # committed, or refused: the session's waiters read it now
                watches.wake(sid)

    def with_durability(st: SessionStatus) -> SessionStatus:
        """A committed status says whether it is durable (``DurableCopier.state``; without a durable
        tier, the root is the durable store)."""
        if st.state == "committed" and st.manifest_xxh3 is not None:
            if svc.durable is None:
                st.durable = True
            else:
                found = svc.durable.state(st.run, st.name, st.manifest_xxh3)
                st.durable, st.durable_error = found.durable, found.error
        return st

    quick = svc.storage.for_probes()  # each call tried once: a long poll's first read

    def precheck(run: str, name: str, sid: str) -> None:
        """The session's record read once, tried once (``StorageError`` at once while the store fails);
        whether it is there or not, the state's own reads decide the answer (404 without a record)."""
        check_run(run), check_name(name), check_session(sid)
        read_meta(quick, run, name, sid)

    watches = SessionWatches(lambda run, name, sid: sessions.status(run, name, sid, list_ranks=False),
                             with_durability, precheck)

    @router.get("/v1/checkpoints/{run}/{name}/sessions/{sid}", response_model=SessionStatus)
    async def session_status(run: str, name: str, sid: str, wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_SECONDS),
                             durable: bool = Query(False)) -> SessionStatus:
        """``wait``: long-poll that many seconds while the session is open. ``durable``: say whether a
        committed checkpoint is durable, and long-poll while it is not yet. A long poll's answer is
        shared by every rank waiting on the session (``session_watch``) and lists no ranks
        (``ranks_done`` empty); without ``wait`` the ranks whose index is stored are listed."""
        if wait > 0:  # the one answer of the session's watch, serialized once for every waiter
            body = await watches.answer(run, name, sid, seconds=wait, durable=durable)
            return Response(body, media_type="application/json")  # type: ignore[return-value]
        st = await run_in_threadpool(sessions.status, run, name, sid)
        return await run_in_threadpool(with_durability, st) if durable else st

    @router.post("/v1/checkpoints/{run}/{name}/sessions/{sid}/alive", status_code=204)
    async def keep_session_alive(run: str, name: str, sid: str) -> Response:
        """A rank that joined the session is alive (``SessionInfo.keepalive_seconds``): the sweep reclaims
        a session only when no rank was heard from for ``CKPTD_DEAD_SESSION_AFTER``."""
        await run_in_threadpool(sessions.keep_alive, run, name, sid)
        return Response(status_code=204)

    @router.delete("/v1/checkpoints/{run}/{name}/sessions/{sid}", status_code=204)
    async def abort_session(run: str, name: str, sid: str) -> Response:
        await run_in_threadpool(sessions.sweeper.abort, run, name, sid)
        return Response(status_code=204)

    return router
