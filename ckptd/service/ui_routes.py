"""The JSON the web view (``/ui``) reads: paged, read-only, under the API's tokens and scopes.

Every route needs a token (``auth.ROUTE_RULES``: ``read`` on the run in the path; ``/v1/ui/runs``
takes any token and lists only the runs it may read), and every list is paged (``offset``,
``limit`` up to a maximum per route): the view never asks for a whole root or a whole manifest.
What is visible is asked of the service's one :class:`~ckptd.store.visibility.Visibility`;
nothing here decides it. Call order of the view::

    GET /v1/ui/runs                                    runs page: runs, checkpoint counts, latest
    GET /v1/ui/runs/{run}/checkpoints                  run page: one page of checkpoints with sizes,
                                                       layout, verification, leases, lineage
    GET /v1/ui/runs/{run}/steps                        run page: the step timeline (markers only, cheap)
    GET /v1/ui/checkpoints/{run}/{name}                checkpoint page: topology, files, groups, lineage
    GET /v1/ui/checkpoints/{run}/{name}/tensors        checkpoint page: tensors with chunks and rank segments
    GET /v1/ui/checkpoints/{run}/{name}/objects        checkpoint page: objects
    GET /v1/ui/runs/{run}/uploads                      live page: open upload sessions, per-rank progress,
                                                       bytes held, last activity, staleness
    GET /v1/ui/runs/{run}/jobs                         live page: reshard jobs of the run, newest first
    GET /v1/ui/runs/{run}/jobs/{job_id}/plan           live page: a job's plan (recomputed, pure planner)
    GET /v1/ui/runs/{run}/retention                    live page: the last gc decisions and their reasons

Cost: a run page lists the run (one marker read and one stat per checkpoint, shared with every other
summary of the run for a moment: ``Visibility.recent_listing``) and parses only the manifests of the
page it shows; their figures are cached by manifest digest (a digest fixes the bytes, so the cache
never outlives them). The view takes no read lease: looking at a checkpoint does not keep it from gc.
The handlers are plain functions: they read storage, and FastAPI runs them in its thread pool.

A run that is not under the root (no directory of it) is answered ``404 not_found`` with
``details.run`` by the run page's routes and the checkpoint routes ("no such run"), never an empty
page; a run that exists with nothing visible yet answers an empty page.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import ValidationError

from ckptd_schemas import (
    CheckpointNotFound, CkptdError, Forbidden, Manifest, NotFound, check_run, check_session, parse_ref,
)

from ..store.paths import Paths
from ..store.session_reads import read_meta
from ..store.leases import Leases
from ..store.records import record_of
from ..store.paths import Committed
from .auth import principal_of
from .gc_log import GcLog
from .services import Services
from .ui_views import manifest_stats, object_row, page, param_group_row, tensor_row

__all__ = ["ui_router"]

MAX_RUNS, MAX_CHECKPOINTS, MAX_STEPS, MAX_TENSORS, MAX_OBJECTS = 500, 500, 5000, 200, 500
MAX_UPLOADS, MAX_JOBS, MAX_UNITS, MAX_DECISIONS = 100, 100, 200, 20
STATS_CACHE = 20_000  # manifest digests whose figures are kept (a few hundred bytes each)
_CLIENT_FILE = re.compile(r"r(\d{6})-\d{4}\.bin")  # the client's data file names: r<rank>-<n>.bin
# what a writer leaves while it writes (or was killed writing): the hidden temp of a local root
# (``ckptd.storage.local``: ``.NAME.tmp-XXXXXXXXXXXX``), renamed to NAME when the file is complete
_PARTIAL_FILE = re.compile(r"\.(.+)\.tmp-[0-9a-f]{12}")


def _json(obj: Any) -> Response:
    return Response(json.dumps(obj, separators=(",", ":"), default=str).encode(), media_type="application/json",
                    headers={"Cache-Control": "no-store"})  # a token's view: never kept by a browser or proxy


def _offset() -> Any:
    return Query(0, ge=0, le=1 << 40, description="first item of the page")


def _limit(maximum: int, default: int) -> Any:
    return Query(default, ge=1, le=maximum, description=f"items per page (at most {maximum})")


def ui_router(svc: Services, gc_log: GcLog) -> APIRouter:
    router = APIRouter(tags=["ui"])
    storage, visibility, sessions = svc.storage, svc.visibility, svc.sessions
    session_ttl = svc.settings.stale_session_ttl
    leases = Leases(storage)
    stats: OrderedDict[str, dict[str, Any]] = OrderedDict()
    lock = threading.Lock()
    listed = visibility.recent_listing  # one listing per run shared for a moment by every page and summary

    def require_run(run: str) -> None:
        """The 404 of a run that is not under the root (asked only once something came back empty; the
        run's name is checked by then)."""
        if run not in visibility.runs():
            raise NotFound(f"no such run {run!r}", run=run)

    def stats_of(c: Committed) -> dict[str, Any] | None:
        """The figures of a visible checkpoint's manifest (cached by digest); None if it went meanwhile."""
        with lock:
            hit = stats.get(c.digest)
            if hit is not None:
                stats.move_to_end(c.digest)
                return hit
        try:
            s = manifest_stats(visibility.manifest(c))
        except CheckpointNotFound:
            return None
        with lock:
            stats[c.digest] = s
            while len(stats) > STATS_CACHE:
                stats.popitem(last=False)
        return s

    def verification_of(c: Committed) -> dict[str, Any] | None:
        """The stored verification record of ``c`` (``VERIFIED.json``: the commit's own check, ``POST
        .../verify``, ``ckptd verify --in-service``, a gc's fresh check), if it is about the manifest
        committed there; None when there is none (``ckptd verify --root`` reads and checks but records
        nothing, so the view cannot know of it)."""
        rec = record_of(storage, c)
        if rec is None:
            return None
        return {"ok": rec.ok, "verified_at": rec.verified_at.isoformat(), "problems": rec.problems[:5],
                "problem_count": len(rec.problems), "bytes_read": rec.bytes_read, "seconds": round(rec.seconds, 3),
                "files": rec.files, "tensors": rec.tensors, "chunks": rec.chunks}

    def leases_of(run: str, names: list[str]) -> dict[str, list[str]]:
        held = set(storage.list(f"leases/{run}"))  # one listing; only checkpoints with lease files are read
        return {n: leases.active(run, n) for n in names if n in held}

    def row(c: Committed, held: dict[str, list[str]]) -> dict[str, Any]:
        return {"name": c.name, "step": c.step, "derived_from": c.derived_from, "parent": c.parent,
                "session": c.session, "committed_at": c.committed_at.isoformat(), "manifest_xxh3": c.digest,
                "stats": stats_of(c), "verification": verification_of(c), "leases": held.get(c.name, [])}

    # -- runs and checkpoints --------------------------------------------------------------------
    @router.get("/v1/ui/runs", response_class=Response)
    def ui_runs(request: Request, offset: int = _offset(),
                limit: int = _limit(MAX_RUNS, 100)) -> Response:
        """The runs the token may read, by name: checkpoint count, latest, newest step."""
        principal = principal_of(request)
        runs = [r for r in visibility.runs() if principal.can_read(r)]
        out = page(runs, offset, limit)
        items = []
        for run in out["items"]:
            listing = listed(run)
            latest = visibility.latest(listing).checkpoint
            items.append({"run": run, "checkpoints": len(listing), "latest": latest.name if latest else None,
                          "newest_step": max((c.step for c in listing if c.step is not None), default=None),
                          "last_commit": max((c.committed_at for c in listing), default=None)})
        out["items"] = items
        return _json(out)

    @router.get("/v1/ui/runs/{run}/checkpoints", response_class=Response)
    def ui_checkpoints(run: str, offset: int = _offset(),
                       limit: int = _limit(MAX_CHECKPOINTS, 100),
                       order: str = Query("desc", pattern="^(asc|desc)$")) -> Response:
        """One page of the run's visible checkpoints (``desc``: newest first), each with its sizes,
        layout, verification, leases and lineage."""
        listing = listed(run)
        if not listing:
            require_run(run)
        latest = visibility.latest(listing).checkpoint
        if order == "desc":
            listing = listing[::-1]
        out = page(listing, offset, limit, run=run, latest=latest.name if latest else None)
        held = leases_of(run, [c.name for c in out["items"]])
        out["items"] = [row(c, held) for c in out["items"]]
        return _json(out)

    @router.get("/v1/ui/runs/{run}/steps", response_class=Response)
    def ui_steps(run: str, offset: int = _offset(),
                 limit: int = _limit(MAX_STEPS, MAX_STEPS)) -> Response:
        """The run's step timeline, oldest first, as columns (markers only: no manifest is parsed)."""
        listing = listed(run)
        if not listing:
            require_run(run)
        out = page(listing, offset, limit)
        cs = out.pop("items")
        out["columns"] = {"name": [c.name for c in cs], "step": [c.step for c in cs],
                          "derived_from": [c.derived_from for c in cs],
                          "committed_at": [c.committed_at.isoformat() for c in cs]}
        return _json(out)

    # -- one checkpoint ---------------------------------------------------------------------------
    def manifest_of(run: str, name: str) -> tuple[Committed, Manifest]:
        try:
            c = visibility.resolve(run, name)
        except CheckpointNotFound:
            require_run(run)
            raise
        return c, visibility.manifest(c)

    @router.get("/v1/ui/checkpoints/{run}/{name}", response_class=Response)
    def ui_checkpoint(run: str, name: str) -> Response:
        """One checkpoint: its row, topology, files (the first 200), param groups (the first 100),
        and lineage (its sources, and the checkpoints of the run derived from it)."""
        c, m = manifest_of(run, name)
        held = leases_of(run, [c.name])
        derived = [d.name for d in listed(run) if d.derived_from == c.ref]
        files = sorted(m.files.items())
        topo = m.topology
        return _json({**row(c, held), "run": run, "ref": c.ref, "derived": derived[:200],
                      "topology": {"world_size": topo.world_size, "mesh": dict(topo.mesh), "layouts": dict(topo.layouts),
                                   "ranks": [{"rank": r.rank, "coords": dict(r.coords)} for r in topo.ranks[:256]]},
                      "files": [{"file": f, "size": e.size, "linked": e.linked, "xxh3": e.xxh3} for f, e in files[:200]],
                      "param_groups": [param_group_row(g) for g in m.param_groups[:100]]})

    @router.get("/v1/ui/checkpoints/{run}/{name}/tensors", response_class=Response)
    def ui_tensors(run: str, name: str, offset: int = _offset(),
                   limit: int = _limit(MAX_TENSORS, 50),
                   q: str = Query("", max_length=200, description="only tensors whose name contains this")
                   ) -> Response:
        """One page of the manifest's tensors (in manifest order), each with its chunks and the part
        of the tensor each rank holds."""
        _, m = manifest_of(run, name)
        tensors = [t for t in m.tensors if q in t.name] if q else m.tensors
        out = page(tensors, offset, limit, q=q)
        out["items"] = [tensor_row(t) for t in out["items"]]
        return _json(out)

    @router.get("/v1/ui/checkpoints/{run}/{name}/objects", response_class=Response)
    def ui_objects(run: str, name: str, offset: int = _offset(),
                   limit: int = _limit(MAX_OBJECTS, 100)) -> Response:
        """One page of the manifest's objects (JSON values cut short)."""
        _, m = manifest_of(run, name)
        out = page(m.objects, offset, limit)
        out["items"] = [object_row(o) for o in out["items"]]
        return _json(out)

    # -- live: uploads, reshard jobs, gc ------------------------------------------------------------
    def held_by(run: str, name: str, sid: str, world: int) -> dict[str, Any]:
        """What session ``sid`` holds on storage now, read through the storage the session store writes
        (``sessions.storage``): its stored data files (every name; per rank by the client's names
        ``r<rank>-<n>.bin``) and their sizes. On a local root also the writes not finished (the hidden
        temps a writer fills until the file is complete, and leaves when its process is killed). An object
        store does not show them (an unfinished multipart upload is invisible there): ``partial_bytes``
        is None."""
        store = sessions.storage
        session_key = Paths.session(run, name, sid)
        files_key = f"{session_key}/files"
        per_rank: dict[int, list[int]] = {}  # rank -> [files, bytes, unfinished bytes]
        stored = [0, 0]  # files, bytes
        other = [0, 0]  # files, bytes, of names that are no rank's
        partial: list[int] | None = None  # unfinished writes, bytes (local roots only)

        def rank_of(f: str) -> int | None:
            mm = _CLIENT_FILE.fullmatch(f)
            return int(mm[1]) if mm is not None and int(mm[1]) < world else None

        def add(f: str, size: int) -> None:
            stored[0] += 1
            stored[1] += size
            r = rank_of(f)
            acc = other if r is None else per_rank.setdefault(r, [0, 0, 0])
            acc[0] += 1
            acc[1] += size

        root = store.local_path(session_key)
        if root is not None and os.path.isdir(root):
            partial = [0, 0]
            files_dir = os.path.join(root, "files")
            try:
                names = os.listdir(files_dir)
            except OSError:
                names = []  # nothing stored yet, or reclaimed meanwhile
            for f in names:
                try:
                    st = os.lstat(os.path.join(files_dir, f))
                except OSError:
                    continue  # gone meanwhile (a temp renamed, a session reclaimed)
                if (pm := _PARTIAL_FILE.fullmatch(f)) is not None:
                    partial[0] += 1
                    partial[1] += st.st_size
                    if (r := rank_of(pm[1])) is not None:
                        per_rank.setdefault(r, [0, 0, 0])[2] += st.st_size
                elif not f.startswith("."):
                    add(f, st.st_size)
        else:
            for f in store.list(files_key):
                add(f, store.size(f"{files_key}/{f}") or 0)
        return {"files": stored[0], "bytes": stored[1], "other_files": other[0], "other_bytes": other[1],
                "partial_files": partial[0] if partial else None, "partial_bytes": partial[1] if partial else None,
                "per_rank": per_rank}

    def upload_of(run: str, name: str, sid: str) -> dict[str, Any] | None:
        try:
            st = sessions.status(run, name, sid)  # only reads
        except CkptdError:
            return None  # gone meanwhile, or not a session
        meta = read_meta(storage, run, name, sid)
        world = st.world_size
        held = held_by(run, name, sid, world)
        per_rank = held.pop("per_rank")
        done = set(st.ranks_done)
        ranks = [{"rank": r, "files": per_rank.get(r, [0, 0, 0])[0], "bytes": per_rank.get(r, [0, 0, 0])[1],
                  "partial_bytes": per_rank.get(r, [0, 0, 0])[2], "index": r in done} for r in range(min(world, 1024))]
        # stale as the service's sweep decides (Sweeper.reclaim_of): no live writer for
        # CKPTD_DEAD_SESSION_AFTER, or opened longer ago than the TTL, so the next sweep deletes it
        # (it never commits a session whose indexes are missing)
        reclaim = sessions.sweeper.reclaim_of(run, name, sid, meta, session_ttl) if meta else None
        stale = reclaim is not None and reclaim.at <= datetime.now(timezone.utc)
        return {"name": name, "session": sid, "state": st.state, "world_size": world, "ranks_done": len(done),
                "step": meta.step if meta else None, "created_at": meta.created_at.isoformat() if meta else None,
                "derived_from": meta.derived_from if meta else None, "ranks": ranks, **held,
                "last_activity": reclaim.last.isoformat() if reclaim else None,
                "receiving": dict(zip(("files", "bytes"), sessions.intake.receiving(run, name, sid))),
                "ttl_seconds": session_ttl, "dead_after_seconds": sessions.dead_after,
                "reclaim_at": reclaim.at.isoformat() if reclaim else None,
                "reclaim_reason": reclaim.reason if reclaim else None, "stale": stale, "error": st.error}

    @router.get("/v1/ui/runs/{run}/uploads", response_class=Response)
    def ui_uploads(run: str, offset: int = _offset(),
                   limit: int = _limit(MAX_UPLOADS, 20)) -> Response:
        """Upload sessions of checkpoints not committed yet (open, or refused at commit), with each
        rank's progress: data files stored (by the client's file names, ``r<rank>-<n>.bin``) and
        whether its index arrived; the bytes the session holds (stored, and on a local root not yet
        finished), its last activity, and whether it is stale (opened longer ago than
        ``CKPTD_STALE_SESSION_TTL``: the next sweep deletes it). ``run_exists`` is false for a run
        that is not under the root (the live page then says so, unless a reshard job is to write it)."""
        found: list[tuple[str, str]] = []
        names = visibility.names(run)
        for name in names:
            if visibility.marker(run, name) is not None:
                continue  # committed (or taken): its sessions are no upload in progress
            for sid in storage.list(Paths.sessions(run, name)):
                try:
                    check_session(sid)
                except CkptdError:
                    continue
                found.append((name, sid))
        out = page(found, offset, limit, run_exists=bool(names) or run in visibility.runs())
        out["items"] = [u for n, s in out["items"] if (u := upload_of(run, n, s)) is not None]
        return _json(out)

    def jobs_of(run: str) -> list[Any]:
        from ..reshard.models import get_job

        out = []
        for entry in storage.list("jobs"):
            if not entry.endswith(".json") or entry.endswith(".plan.json"):  # a job's recorded plan
                continue
            try:
                job = get_job(storage, entry[:-5])
                if run in (parse_ref(job.source).run, parse_ref(job.out).run):
                    out.append(job)
            except (CkptdError, ValidationError, ValueError):
                continue  # not a job record this service wrote
        return sorted(out, key=lambda j: j.updated_at, reverse=True)

    @router.get("/v1/ui/runs/{run}/jobs", response_class=Response)
    def ui_jobs(run: str, offset: int = _offset(), limit: int = _limit(MAX_JOBS, 20)) -> Response:
        """Reshard jobs whose source or output is in the run, most recently updated first."""
        out = page(jobs_of(run), offset, limit)
        out["items"] = [j.model_dump(mode="json") for j in out["items"]]
        return _json(out)

    @router.get("/v1/ui/runs/{run}/jobs/{job_id}/plan", response_class=Response)
    def ui_job_plan(request: Request, run: str, job_id: str,
                    limit: int = Query(50, ge=1, le=MAX_UNITS, description="work units shown")) -> Response:
        """A job's plan as recorded when the job was planned (``reshard.models.get_plan_summary``; nothing
        plans it again): work units, bytes per target rank, imbalance."""
        from ..reshard.models import get_job, get_plan_summary

        principal = principal_of(request)
        job = get_job(storage, job_id)
        src, out_ref = parse_ref(job.source), parse_ref(job.out)
        if run not in (src.run, out_ref.run):
            raise NotFound(f"reshard job {job_id!r} does not touch run {run!r}", job=job_id, run=run)
        if not principal.can_read(src.run):
            raise Forbidden(f"token {principal.name!r} may not read run {src.run!r}, the source of job {job_id}",
                            token=principal.name, needs=f"read:{src.run}")
        summary = get_plan_summary(storage, job_id)
        return _json({"job": job.id, "source": job.source, "out": job.out,
                      **{k: v for k, v in summary.items() if k != "units"}, "units": summary["units"][:limit]})

    @router.get("/v1/ui/runs/{run}/retention", response_class=Response)
    async def ui_retention(run: str, offset: int = _offset(),
                           limit: int = _limit(MAX_DECISIONS, MAX_DECISIONS)) -> Response:
        """The last gc decisions of the run this service made (``POST .../gc`` or its retention
        policy), newest first: what each kept and why, what it deleted (memory only: since start)."""
        check_run(run)
        return _json(page(gc_log.recent(run), offset, limit))

    return router

