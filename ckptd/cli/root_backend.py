"""The :class:`~.backends.Backend` over a storage root: the store's own code, in this process.

A root is opened read-only by a command that only reads (``ls``, ``show``, ``verify``, ``export``,
``gc --dry-run``...: a mistyped path is refused, never created) and created by one that writes
(``import``). Leases are taken in the root and renewed by a thread while a tool reads; conversions
run here, under a lease on their source, from a source the one checker passes.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from ckptd_schemas import InvalidRequest, Manifest, NotFound, OpenSession, RankIndex, parse_ref

from ..storage import Storage
from .backends import DEFAULT_WORKERS, Bar, ReshardOutcome, ReshardRequest

if TYPE_CHECKING:
    from ckptd_schemas import CheckpointSummary, RunSummary
    from ckptd_schemas.api import SkippedCheckpoint

    from ..interop.dcp_import import FileOut

__all__ = ["RootBackend", "open_checked_root"]


def open_checked_root(root: str, *, create: bool) -> Storage:
    """The storage root a command was given, opened by :func:`ckptd.store.tiers.open_root` once it is
    checked: with ``create=False`` a local directory must already exist; a bad root is a typed error
    naming it (``NotFound``, ``InvalidRequest``), never a traceback."""
    from ..store.tiers import TIERED, open_root, split_tiered

    if root.startswith(TIERED):  # a fast tier and its durable tier, as `ckptd serve --durable` sees them
        try:
            parts = split_tiered(root)
        except ValueError as e:
            raise InvalidRequest(str(e), root=root, field="root") from e
    else:
        parts = (root,)
    for part in parts:
        path = Path(part)
        if "://" not in part and not create and not path.is_dir():
            what = "is not a directory" if path.exists() else "does not exist"
            raise NotFound(f"no such root: {part} {what} (pass --root PATH or --server URL)", root=part)
    try:
        return open_root(root)
    except ImportError as e:
        scheme = root.split("://", 1)[0]
        raise InvalidRequest(f"no storage backend for {scheme}:// roots: {e} (install the fsspec package for "
                             f"{scheme!r}, e.g. pip install 's3fs' for s3://)", root=root, field="root") from e
    except ValueError as e:  # fsspec: "Protocol not known"
        raise InvalidRequest(f"cannot open root {root}: {e}", root=root, field="root") from e


class RootBackend:
    """A storage root read (and, for writes, created) directly."""

    def __init__(self, root: str, *, create: bool = False) -> None:
        from ..store import CheckpointReader

        self.where = root
        self.reader = CheckpointReader(open_checked_root(root, create=create))
        self.storage = self.reader.storage

    # -- reads ------------------------------------------------------------------------------------
    def list_runs(self) -> list[RunSummary]:
        return self.reader.list_runs()

    def list_checkpoints(self, run: str) -> list[CheckpointSummary]:
        return self.reader.list_checkpoints(run)

    def run_names(self) -> list[str]:
        return self.reader.visibility.runs()  # names only: no marker of any run is read

    def manifest(self, run: str, name: str) -> Manifest:
        return self.reader.manifest(run, name)

    def resolve(self, run: str, name: str) -> tuple[Manifest, list[SkippedCheckpoint]]:
        """:meth:`manifest`, and for ``latest`` the newer checkpoints skipped as known to be bad
        (``Visibility.resolve_ref``: the service's rule, applied to the root)."""
        from ckptd_schemas.api import SkippedCheckpoint

        vis = self.reader.visibility
        c, skipped = vis.resolve_ref(run, name)
        return vis.manifest(c), [SkippedCheckpoint(ref=s.ref, reason=s.reason) for s in skipped]

    def read(self, manifest: Manifest, file: str, start: int, end: int) -> bytes:
        return self.reader.read_range(manifest.run, manifest.name, file, start, end)

    def lease(self, manifest: Manifest, what: str) -> ContextManager[object]:
        """Keep ``manifest``'s checkpoint from retention while a tool reads it (``what``: verify,
        export...): a lease in the root, renewed by a thread, released at the end."""
        from ..store.leases import Leases

        return Leases(self.storage).hold(manifest.run, manifest.name, what)

    # -- checks -----------------------------------------------------------------------------------
    def check_source(self, manifest: Manifest) -> None:
        """The source's record while it vouches for the stored bytes (usually the commit's own: no
        second read), else a verification now, recorded; ``CorruptCheckpoint`` when it fails."""
        from ..store.verification import require_verified

        require_verified(self.storage, manifest.run, manifest.name)

    def load_tree_problem(self, manifest: Manifest) -> str | None:
        from ..store.verification import load_tree_problem

        vis = self.reader.visibility
        return load_tree_problem(vis, vis.resolve(manifest.run, manifest.name))

    def verify_in_service(self, ref: str) -> dict[str, Any]:
        raise InvalidRequest("ckptd verify --in-service needs --server URL (or $CKPTD_URL)", field="in_service")

    # -- writes -----------------------------------------------------------------------------------
    def import_target(self) -> _RootImport:
        from ..store import SessionStore

        return _RootImport(SessionStore(self.storage))

    def gc(self, run: str, *, keep_last: int, keep_every: int | None, dry_run: bool, drop_parents: bool,
           stale_ttl: float, dead_after: float) -> dict[str, Any]:
        from ..store import SessionStore
        from ..store.retention import collect

        plan = collect(self.storage, run, keep_last=keep_last, keep_every=keep_every, dry_run=dry_run,
                       drop_parents=drop_parents).as_json()
        if not dry_run:  # the service's gc does the same with its own settings
            plan["reclaimed_sessions"] = SessionStore(self.storage, dead_after=dead_after).reclaim_stale(stale_ttl)
        return plan

    def remove(self, run: str, name: str, *, dry_run: bool) -> dict[str, Any]:
        from ..store.retention import remove

        return remove(self.storage, run, name, dry_run=dry_run).as_json()

    # -- conversions ------------------------------------------------------------------------------
    def _outline(self, req: ReshardRequest) -> tuple[Any, Manifest, Any]:
        """The conversion cut into units (``outline_reshard``: no read planned yet), its source and spec."""
        from ..reshard.planner import outline_reshard
        from ..reshard.spec import parse_spec

        spec = parse_spec(req.to)  # refused before any I/O
        src = parse_ref(req.ref)
        manifest = self.reader.manifest(src.run, src.name)
        return outline_reshard(manifest, spec, dtype=req.dtype, min_units=req.jobs), manifest, spec

    def reshard_preview(self, req: ReshardRequest) -> Any:
        from ..reshard.preview import preview

        return preview(self._outline(req)[0].plan())

    def reshard_out(self, req: ReshardRequest, manifest: Manifest, spec: Any) -> str:
        """The output's name, refused before any work when it is taken (the service's rule:
        :func:`ckptd.reshard.jobs.output_ref`)."""
        from ..reshard.jobs import output_ref

        return output_ref(self.reader, req, manifest, spec)

    def write_plan(self, req: ReshardRequest, uri: str) -> dict[str, Any]:
        """``--write-plan``: the plan for ``ckptd reshard-worker`` pods, written to ``uri``; nothing converted."""
        from ..reshard.executor import plan_device, plan_engine
        from ..reshard.jobs import write_job
        from ..store import SessionStore

        outline, manifest, spec = self._outline(req)
        plan_engine(outline, plan_device(outline, req.device))  # refused before any write (cuda without a GPU)
        out, session = self.reshard_out(req, manifest, spec), uuid.uuid4().hex
        workers = max(1, min(req.workers or DEFAULT_WORKERS, len(outline.cuts)))
        write_job(uri, outline, workers, out, session, req.device, SessionStore(self.storage))
        return {"plan": uri, "workers": workers, "units": len(outline.cuts), "out": out, "session": session}

    def reshard(self, req: ReshardRequest, *, bar: Bar, announce: Callable[[str], None]) -> ReshardOutcome:
        """Plan, choose the engine (``plan_device``: refused before any write, announced with its reason),
        then convert and commit under a lease on the source (``run_plan``, which first has the one
        checker's verdict on it)."""
        from ..reshard.executor import plan_device, plan_engine, run_plan
        from ..reshard.preview import preview
        from ..store import SessionStore
        from .output import engine_line

        plan, manifest, spec = self._outline(req)
        choice = plan_device(plan, req.device)  # --device auto: the CPU unless a large cast pays for the GPU
        engine = plan_engine(plan, choice)  # refused before any write (cuda without a GPU)
        out = self.reshard_out(req, manifest, spec)
        announce(engine_line(choice.device, choice.reason, engine.name))
        progress = bar.start(plan.bytes_to_write)
        with self.lease(manifest, "reshard"):  # gc spares the source meanwhile
            res = run_plan(self.reader, SessionStore(self.storage), plan, out, uuid.uuid4().hex, engine=engine,
                           jobs=req.jobs, progress=progress)
        pv = preview(plan.plan(reads=False))
        result = {"ref": res.ref, "manifest_xxh3": res.manifest_xxh3, "units": res.units,
                  "bytes_read": res.bytes_read, "bytes_written": res.bytes_written, "seconds": round(res.seconds, 3),
                  "processes": res.processes}
        return ReshardOutcome(result=result, source=manifest.ref, spec=str(spec),
                              engine={"device": choice.device, "reason": choice.reason, "impl": engine.name},
                              per_rank_bytes=[sum(r.values()) for r in pv.per_rank], imbalance=pv.imbalance)

    def drill(self, ref: str, layouts: list[str], *, jobs: int, bar: Bar) -> dict[str, Any]:
        """Every layout planned before anything is read, then the drill here (``reshard.drill``)."""
        from ..reshard.drill import drill_checkpoint, plan_drill

        src = parse_ref(ref)
        manifest = self.reader.manifest(src.run, src.name)
        plans = plan_drill(manifest, layouts)
        total = sum(pc.nbytes for _, p in plans for u in p.units for pc in u.chunks)
        with self.lease(manifest, "drill"):
            return drill_checkpoint(self.storage, manifest.ref, layouts, jobs=jobs, progress=bar.start(total),
                                    plans=plans).model_dump(mode="json")

    def close(self) -> None:
        pass


class _SinkOut:
    """A file of the import, streamed into the store's write-once sink (hashed as written)."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink

    @property
    def size(self) -> int:
        return self._sink.size

    def write(self, data: bytes | memoryview) -> None:
        self._sink.write(data)

    def finish(self) -> None:
        self._sink.finish(None)

    def abort(self) -> None:
        self._sink.abort()


class _RootImport:
    """``interop.dcp_import.ImportTarget`` over the store's own session and commit code."""

    def __init__(self, sessions: Any) -> None:
        self.sessions = sessions
        self._at: tuple[str, str, str] | None = None

    def open(self, run: str, name: str, session: str, step: int | None) -> None:
        self.sessions.open(run, name, OpenSession(session=session, world_size=1, step=step))
        self._at = (run, name, session)
        self.sessions.activity.hold(run, name, session)  # a large import writes for minutes

    def begin_file(self, file: str) -> FileOut:
        assert self._at is not None
        return _SinkOut(self.sessions.begin_file(*self._at, file))

    def commit(self, index: RankIndex) -> str:
        assert self._at is not None
        try:
            return self.sessions.put_index(*self._at, index).manifest_xxh3 or ""
        finally:
            self.sessions.activity.release(*self._at)

    def abort(self) -> None:
        if self._at is not None:
            self.sessions.activity.release(*self._at)
            self.sessions.abort(*self._at)
