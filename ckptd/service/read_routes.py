"""Read routes: runs, checkpoints, manifests, read plans, file bytes, verification and read leases.

All need the ``read`` scope on their run (``auth.ROUTE_RULES``; ``GET /v1/runs`` takes any token and
lists only the runs it may read). Call order of a load::

    GET    /v1/runs                                      runs (those the token may read), a page at a time
    GET    /v1/runs/{run}/checkpoints                    committed checkpoints of a run, a page at a time
                                                         (?limit=, ?after=NAME; X-Ckptd-Next: where the
                                                         next page starts; CKPTD_LIST_MAX_ITEMS at most)
    GET    /v1/checkpoints/{run}/{name}                  manifest ({name} may be "latest": the newest
                                                         trainer checkpoint not known to be bad, named in
                                                         X-Ckptd-Name; the newer ones it skipped, and why,
                                                         in X-Ckptd-Skipped)
    GET    /v1/checkpoints/{run}/{name}/load-tree        the head of its load tree (X-Ckptd-Load-Tree: the
                                                         root its marker names; "latest" as above)
    POST   /v1/checkpoints/{run}/{name}/load-tree        a rank's pieces of it: chunk rows, files, objects,
                                                         each with its path to the head; the rank plans its
                                                         reads itself (a manifest is read instead from a
                                                         service or checkpoint without load trees)
    POST   /v1/checkpoints/{run}/{name}/read-plan        byte ranges that fill given regions
    GET    /v1/checkpoints/{run}/{name}/files/{file}     file bytes (Range supported)
    PUT    /v1/checkpoints/{run}/{name}/leases/{holder}  hold a read lease (a long load renews it)
    DELETE /v1/checkpoints/{run}/{name}/leases/{holder}  release it

and, at any time::

    POST   /v1/checkpoints/{run}/{name}/verify           re-read and check every byte, record the outcome
    POST   /v1/checkpoints/{run}/{name}/damaged          a reader found damaged bytes in these files, or a
                                                         damaged marker, manifest or load tree: check them
                                                         again, record a failure (RUN/latest then skips it)
    GET    /v1/checkpoints/{run}/{name}/verification     the last recorded verification

Reading metadata takes no lease; a load holds its own (the lease routes, owned by its token), and
file bytes served to a request that names no lease of its token lease the checkpoint on this
replica's account for a while (``store.leases``, which decides this), so gc spares it while it is read.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Literal

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from ckptd_schemas import (
    CheckpointSummary, InvalidRequest, Manifest, NotFound, PayloadTooLarge, ReadPlan, ReadRequest, RunSummary,
    TooManyRequests, check_file, check_name, check_run, check_session, plan_reads,
)

from ckptd_schemas.api import LOAD_TREE_HEADER, MAX_SKIPPED_SENT, NEXT_HEADER, READ_REQUEST_BYTES, SKIPPED_HEADER

from ..store.paths import Paths
from ..store.verification import VerifyRecord, read_record, recheck_and_record, verify_and_record
from .auth import principal_of
from .bodies import parse_read_requests, read_body_limited
from .limits import read_plan_budget
from .services import Services

__all__ = ["PLAN_THREADS", "DamageReport", "DamageVerdict", "LoadTreeBody", "ReadPlanBody", "read_router"]

#: Threads of a replica that parse read-plan and load-tree requests, plan them and serialize their
#: answers: the CPU and memory all such requests take at once are at most this many bounded requests'
#: (``CKPTD_READ_PLAN_MAX_REQUESTS``); more wait their turn, off the event loop, which keeps answering.
PLAN_THREADS = 2


class LoadTreeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: list[ReadRequest] = []
    objects: list[str] = []  # the object names the rank restores
    rank: int = Field(0, ge=0)
    local_paths: bool = False  # also answer with each file's path here (direct reads)


class ReadPlanBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: list[ReadRequest]
    local_paths: bool = False  # also answer with each file's path here (direct reads, see ReadPlan)


class DamageReport(BaseModel):
    """A reader's report: these data files of the checkpoint gave it bytes that fail their digests, or
    these parts of its metadata failed the load (``verification.DAMAGE_PARTS``); one or the other."""

    model_config = ConfigDict(extra="forbid")
    files: list[str] = Field([], max_length=16)
    parts: list[Literal["marker", "manifest", "load tree"]] = Field([], max_length=3)

    @model_validator(mode="after")
    def _names_files_or_parts(self) -> "DamageReport":
        if not self.files and not self.parts:
            raise ValueError("a report names the damaged data files, or the damaged parts, or both")
        return self


class DamageVerdict(BaseModel):
    """What the service found when it read the reported files again (``verification.recheck_files``)."""

    ref: str
    files: list[str]
    parts: list[str] = []
    damaged: bool
    problems: list[str]
    recorded: bool = Field(description="this report stored the failed verification record (false when one was "
                                       "stored already, or the files are intact)")
    latest: str | None = Field(description="the checkpoint RUN/latest resolves to now (null: none)")


MAX_RECHECKS = 8  # reports of damaged bytes checked at once per replica (each reads files in a worker): 429 past it


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


#: The most bytes of the ``X-Ckptd-Skipped`` header: a client reads a response head of 16 KiB or more.
MAX_SKIPPED_HEADER_BYTES = 4096


def _skipped_header(skipped: tuple) -> str:
    """The skipped checkpoints (``Visibility.resolve_ref``) as the ``X-Ckptd-Skipped`` value: a JSON array,
    ASCII (a header carries Latin-1 only, and a problem may name any tensor), newest first, as many
    entries as fit in ``MAX_SKIPPED_HEADER_BYTES`` (the newest always: its reason is cut to fit)."""
    out: list[dict] = []
    for s in skipped[:MAX_SKIPPED_SENT]:
        entry = s.as_json()
        if not out:
            entry["reason"] = entry["reason"][:MAX_SKIPPED_HEADER_BYTES // 8]
        text = json.dumps([*out, entry], ensure_ascii=True, separators=(",", ":"))
        if len(text) > MAX_SKIPPED_HEADER_BYTES and out:
            break
        out.append(entry)
    return json.dumps(out, ensure_ascii=True, separators=(",", ":"))


def read_router(svc: Services) -> APIRouter:
    router = APIRouter(tags=["read"])
    settings, storage, metrics, reader = svc.settings, svc.storage, svc.metrics, svc.reader
    visibility, read_leases, workers = svc.visibility, svc.read_leases, svc.workers
    plan_threads = ThreadPoolExecutor(PLAN_THREADS, thread_name_prefix="ckptd-plan")
    max_requests = settings.read_plan_max_requests

    async def planned(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn`` on the plan threads (the request's context along: its id in the log lines)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kw)
        return await asyncio.get_running_loop().run_in_executor(plan_threads, call)

    async def read_requests(request: Request, model: type[BaseModel], what: str) -> Any:
        """A read-plan or load-tree request's body: at most ``max_requests`` regions (and object names)
        in at most ``READ_REQUEST_BYTES`` a region, counted before it is parsed; 413 past either, with
        ``max_requests`` in its details (a client splits its regions by it)."""
        try:
            raw = await read_body_limited(
                request, max_requests * READ_REQUEST_BYTES,
                f"{max_requests} regions of {READ_REQUEST_BYTES} bytes, CKPTD_READ_PLAN_MAX_REQUESTS",
                field="body", setting="CKPTD_READ_PLAN_MAX_REQUESTS", max_requests=max_requests)
            return await planned(parse_read_requests, model, raw, what, max_requests)
        except PayloadTooLarge:
            metrics.limit_refusals.labels("read_plan").inc()
            raise

    def page_limit(limit: int | None) -> int:
        """The items one listing answer holds: ``limit`` when asked, at most ``CKPTD_LIST_MAX_ITEMS`` (also
        the default); 413 beyond it, naming the parameter and the setting (the pages are what to follow)."""
        most = settings.list_max_items
        if limit is None:
            return most
        if limit < 1:
            raise InvalidRequest(f"limit {limit} is not a page size: ask for 1 to {most} items", field="limit")
        if limit > most:
            metrics.limit_refusals.labels("list").inc()
            raise PayloadTooLarge(f"limit {limit} is over the most one listing answers, {most} (CKPTD_LIST_MAX_ITEMS): "
                                  f"follow the pages its {NEXT_HEADER} header names", field="limit", needed=limit,
                                  limit=most, setting="CKPTD_LIST_MAX_ITEMS")
        return limit

    async def budgeted(fn: Callable[..., Any], regions: int, *args: Any) -> Any:
        """``fn(*args, budget=...)`` on the plan threads, within the budget of a request naming ``regions``
        regions (``limits.read_plan_budget``); 413 past it, counted."""
        budget = read_plan_budget(regions, settings.read_plan_chunk_budget, settings.read_plan_answer_budget)
        try:
            return await planned(fn, *args, budget=budget)
        except PayloadTooLarge:
            metrics.limit_refusals.labels("read_plan").inc()
            raise

    def local_paths(body: ReadPlanBody | LoadTreeBody, run: str, name: str, session: str,
                    files: list[str]) -> dict[str, str] | None:
        """Each file's path on this host (direct reads) where the request asks, the service offers them and
        every file has one; else None."""
        if not (body.local_paths and settings.direct_reads):
            return None
        paths = {f: storage.local_path(Paths.file(run, name, session, f)) for f in files}
        return paths if all(paths.values()) else None  # type: ignore[return-value]

    def ref_headers(c: Any, skipped: tuple, **more: str) -> dict[str, str]:
        """What a ref resolved to (``X-Ckptd-Name``; for ``latest``, ``X-Ckptd-Skipped``) and the lease period."""
        headers = {"X-Ckptd-Name": c.name, **more, "X-Ckptd-Lease-Seconds": f"{settings.read_lease_seconds:g}"}
        if skipped:
            headers[SKIPPED_HEADER] = _skipped_header(skipped)
        return headers

    def paged(response: Response, page: tuple[list, str | None]) -> list:
        if page[1] is not None:
            response.headers[NEXT_HEADER] = page[1]
        return page[0]

    @router.get("/v1/runs", response_model=list[RunSummary])
    async def list_runs(request: Request, response: Response, limit: int | None = None,
                        after: str | None = None) -> list[RunSummary]:
        """The runs the token may read, by name: one page (``limit``, after the run ``after``); the
        ``X-Ckptd-Next`` header names where the next starts."""
        principal, most = principal_of(request), page_limit(limit)
        if after is not None:
            check_run(after)
        return paged(response, await run_in_threadpool(reader.runs_page, principal.can_read, after=after,
                                                       limit=most))

    @router.get("/v1/runs/{run}/checkpoints", response_model=list[CheckpointSummary])
    async def list_checkpoints(run: str, response: Response, limit: int | None = None,
                               after: str | None = None) -> list[CheckpointSummary]:
        """A page of the run's committed checkpoints: those among ``limit`` of its names after ``after``,
        oldest first; the ``X-Ckptd-Next`` header names where the next page starts."""
        most = page_limit(limit)
        if after is not None:
            check_name(after)
        return paged(response, await run_in_threadpool(reader.checkpoints_page, run, after=after, limit=most))

    @router.get("/v1/checkpoints/{run}/{name}", response_model=Manifest)
    async def get_manifest(run: str, name: str) -> Response:
        """The manifest's bytes as stored, served only when they hash to the marker's digest (sent as
        ``X-Ckptd-Manifest-Xxh3``, so a client checks what it received against what was committed).

        This answer is what resolves a ref for a load: ``X-Ckptd-Name`` names the checkpoint, and for
        ``latest``, ``X-Ckptd-Skipped`` lists the newer trainer checkpoints skipped as known to be bad
        (``SkippedCheckpoint``: ref and reason, newest first), decided by ``Visibility.resolve_ref``."""
        c, skipped = await run_in_threadpool(visibility.resolve_ref, run, name)
        raw = await run_in_threadpool(visibility.manifest_bytes, c)
        return Response(raw, media_type="application/json", headers=ref_headers(c, skipped, **{
            "X-Ckptd-Manifest-Xxh3": c.digest}))

    @router.post("/v1/checkpoints/{run}/{name}/read-plan", response_model=ReadPlan,
                 response_model_exclude_none=True)  # no local_paths key unless offered: older clients parse it
    async def read_plan(request: Request, run: str, name: str) -> ReadPlan:
        body = await read_requests(request, ReadPlanBody, "read-plan request")
        manifest = await run_in_threadpool(reader.manifest, run, name)
        plan = await budgeted(plan_reads, len(body.requests), manifest, body.requests)
        plan.local_paths = local_paths(body, run, manifest.name, manifest.session, [f.file for f in plan.fetches])
        raw_plan = await planned(plan.model_dump_json, exclude_none=True)  # a large answer: not on the loop
        return Response(raw_plan, media_type="application/json")  # type: ignore[return-value]

    @router.get("/v1/checkpoints/{run}/{name}/load-tree", responses={200: {"content": {"application/json": {}}}})
    async def get_load_tree(run: str, name: str) -> Response:
        """The head of the checkpoint's load tree (``ckptd_schemas.loadtree``: identity, tensors' names,
        shapes and dtypes, the objects' directory, the roots of the trees of chunk rows, files and
        objects), whose bytes hash to the root its marker names, sent as ``X-Ckptd-Load-Tree``. ``{name}``
        may be ``latest``, resolved as for the manifest (``X-Ckptd-Name``, ``X-Ckptd-Skipped``)."""
        c, skipped = await run_in_threadpool(visibility.resolve_ref, run, name)
        tree = await run_in_threadpool(visibility.load_tree, c)
        return Response(tree.head, media_type="application/json", headers=ref_headers(c, skipped, **{
            LOAD_TREE_HEADER: c.marker.load_tree or ""}))

    @router.post("/v1/checkpoints/{run}/{name}/load-tree")
    async def load_tree_pieces(request: Request, run: str, name: str) -> Response:
        """What one loading rank needs of the checkpoint, each piece with the sibling digests that lead to
        the head's root: the chunk rows its regions' interval indexes find, the files they lie in, the
        entries that decide the objects it restores (``LoadTree.answer``); with ``local_paths``, each
        file's path on a local root (direct reads). Budgeted as a read plan."""
        body = await read_requests(request, LoadTreeBody, "load-tree request")
        c = await run_in_threadpool(reader.committed, run, name)
        tree = await run_in_threadpool(visibility.load_tree, c)
        answer = await budgeted(tree.answer, len(body.requests), body.requests, body.objects, body.rank)
        if answer["files"] and (paths := local_paths(body, run, c.name, c.marker.session, answer["files"])):
            answer["local_paths"] = paths
        data = await planned(json.dumps, answer, separators=(",", ":"))
        return Response(data, media_type="application/json")

    @router.post("/v1/checkpoints/{run}/{name}/verify", response_model=VerifyRecord)
    async def verify_checkpoint(run: str, name: str) -> VerifyRecord:
        """Re-read and check every byte of a committed checkpoint in a worker process (as `ckptd verify`),
        record the outcome and return it; 200 either way: ``ok`` says whether it holds."""
        name, _ = await run_in_threadpool(reader.resolve, run, name)  # 404 before any work; the manifest is checked
        rec = await asyncio.wrap_future(workers().submit(verify_and_record, storage.url, run, name))
        return VerifyRecord.model_validate(rec)

    rechecks: dict[tuple[str, str, tuple[str, ...], tuple[str, ...]], asyncio.Future] = {}  # at most MAX_RECHECKS

    @router.post("/v1/checkpoints/{run}/{name}/damaged", response_model=DamageVerdict)
    async def report_damage(run: str, name: str, body: DamageReport) -> DamageVerdict:
        """A reader found bytes of ``files`` that fail their digests, or a load failed on ``parts`` of the
        checkpoint's metadata: check those files again, and the metadata, with the one checker (in a
        worker) and, when they are damaged, record the failed verification, so that ``RUN/latest``
        resolves past this checkpoint from now on; a reader's word alone changes nothing. Concurrent
        reports of the same files share one check; once a failure is recorded, a report is answered
        from the record."""
        for f in body.files:
            check_file(f)
        c = await run_in_threadpool(reader.committed, run, name)
        key = (run, c.name, tuple(sorted(set(body.files))), tuple(sorted(set(body.parts))))
        fut = rechecks.get(key)
        if fut is None and len(rechecks) >= MAX_RECHECKS:
            raise TooManyRequests(f"{len(rechecks)} reports of damaged bytes are being checked already; report "
                                  f"again later", ref=f"{run}/{c.name}", limit_name="damage_rechecks")
        if fut is None:
            fut = rechecks[key] = asyncio.wrap_future(workers().submit(recheck_and_record, storage.url, run, c.name,
                                                                       list(key[2]), list(key[3])))
            fut.add_done_callback(lambda _: rechecks.pop(key, None))
        return DamageVerdict.model_validate(await asyncio.shield(fut))

    @router.get("/v1/checkpoints/{run}/{name}/verification", response_model=VerifyRecord)
    async def get_verification(run: str, name: str) -> VerifyRecord:
        """The last verification the service recorded for this checkpoint (404 when there is none)."""
        name, _ = await run_in_threadpool(reader.resolve, run, name)
        rec = await run_in_threadpool(read_record, storage, run, name)
        if rec is None:
            raise NotFound(f"checkpoint {run}/{name} has not been verified by the service", ref=f"{run}/{name}")
        return rec

    @router.get("/v1/checkpoints/{run}/{name}/files/{file}", responses={206: {"description": "partial content"}})
    async def get_file(request: Request, run: str, name: str, file: str, range: str | None = Header(None),
                       x_ckptd_lease: str | None = Header(None)) -> Response:
        check_file(file)
        key, size = await run_in_threadpool(reader.file_key, run, name, file)
        concrete = key.split("/")[2]  # runs/RUN/NAME/...: the concrete name
        principal = principal_of(request).name
        await run_in_threadpool(read_leases.touch, run, concrete, x_ckptd_lease, principal)
        start, end = _parse_range(range, size)
        # A committed file absent or resized on storage is corrupt: 422 before any byte is sent.
        await run_in_threadpool(storage.check_committed, key, size, file=file)
        headers = {"Accept-Ranges": "bytes", "Content-Length": str(end - start)}
        status = 206 if range else 200
        if range:
            headers["Content-Range"] = f"bytes {start}-{max(end - 1, start)}/{size}"
        piece = storage.read_piece  # per read and send: bounds the memory of one GET
        if end - start <= piece:
            data = await run_in_threadpool(storage.read_committed, key, start, end, size, file=file)
            return Response(data, status_code=status, headers=headers, media_type="application/octet-stream")

        async def pieces() -> AsyncIterator[bytes]:
            pos = start
            while pos < end:
                nxt = min(pos + piece, end)
                await run_in_threadpool(read_leases.touch, run, concrete, x_ckptd_lease, principal)  # a long stream
                yield await run_in_threadpool(storage.read_committed, key, pos, nxt, size, file=file)
                pos = nxt

        return StreamingResponse(pieces(), status_code=status, headers=headers,
                                 media_type="application/octet-stream")

    async def on_lease(act: Callable[..., None], request: Request, run: str, name: str, holder: str) -> Any:
        """``act`` (``ReadLeases.hold`` or ``release``) on lease ``holder`` of the committed ``run/name``, for
        the request's token; the committed checkpoint."""
        check_session(holder)  # the same safe-name rule as a session id
        c = await run_in_threadpool(reader.committed, run, name)
        p = principal_of(request)
        await run_in_threadpool(lambda: act(run, c.name, holder, p.name, admin=p.admin))
        return c

    @router.put("/v1/checkpoints/{run}/{name}/leases/{holder}")
    async def hold_lease(request: Request, run: str, name: str, holder: str) -> dict:
        """Take or renew the request's token's read lease ``holder`` (``ckptd.store.leases``): renewed by
        the reader every third of ``seconds``; gc spares the checkpoint meanwhile. 403 when another
        token holds that lease (an admin token takes it over, logged), 429 past the leases one token may hold."""
        c = await on_lease(read_leases.hold, request, run, name, holder)
        return {"ref": c.ref, "holder": holder, "seconds": settings.read_lease_seconds}

    @router.delete("/v1/checkpoints/{run}/{name}/leases/{holder}", status_code=204)
    async def release_lease(request: Request, run: str, name: str, holder: str) -> Response:
        """Release read lease ``holder``: its own token may, and an admin token, which breaks it (logged)."""
        await on_lease(read_leases.release, request, run, name, holder)
        return Response(status_code=204)

    return router
