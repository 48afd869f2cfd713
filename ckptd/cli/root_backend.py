"""The :class:`~.backends.Backend` over a storage root: the use cases the service's routes call, run in this process.

A root is opened read-only by a command that only reads (``ls``, ``show``, ``verify``, ``export``,
``gc --dry-run``...: a mistyped path is refused, never created) and created by one that writes
(``import``). Leases are taken in the root and renewed by a thread while a tool reads; conversions
run here, under a lease on their source, from a source the one checker passes.
"""

from __future__ import annotations

import uuid
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from ckptd_schemas import InvalidRequest, Manifest, NotFound, OpenSession, RankIndex, parse_ref

from ..storage import Storage
from .backends import DEFAULT_WORKERS, Bar, ReshardOutcome

if TYPE_CHECKING:
    from ckptd_schemas import CheckpointSummary, RunSummary
    from ckptd_schemas.api import SkippedCheckpoint
    from ckptd_schemas.readplan import ReadFn

    from ..interop.dcp_import import FileOut
    from ..reshard.models import ReshardRequest

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
    from ..storage import check_scheme

    for part in parts:
        path = Path(part)
        if "://" not in part and not create and not path.is_dir():
            what = "is not a directory" if path.exists() else "does not exist"
            raise NotFound(f"no such root: {part} {what} (pass --root PATH or --server URL)", root=part)
        try:
            check_scheme(part)
        except ValueError as e:
            raise InvalidRequest(f"cannot open root {part}: {e}", root=part, field="root") from None
    try:
        return open_root(root)
    except ImportError as e:  # s3:// without boto3
        scheme = root.split("://", 1)[0]
        raise InvalidRequest(f"no storage backend for {scheme}:// roots: {e} (install the fsspec package for "
                             f"{scheme!r}, e.g. pip install 's3fs' for s3://)", root=root, field="root") from e
    except ValueError as e:
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
        return self.reader.runs_page()[0]

    def list_checkpoints(self, run: str) -> list[CheckpointSummary]:
        return self.reader.checkpoints_page(run)[0]

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

    def status(self, manifest: Manifest) -> tuple[str | None, str | None]:
        from ..store.records import status_of

        vis = self.reader.visibility
        c = vis.check(manifest.run, manifest.name)
        return status_of(vis.storage, c) if c is not None else (None, None)

    def byte_source(self, manifest: Manifest) -> ReadFn:
        return partial(self.reader.read_range, manifest.run, manifest.name)

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

    def verify(self, manifest: Manifest, progress: Callable[[int], None] | None) -> dict[str, Any]:
        """The service's verification (``verification.verify_unrecorded``: the one checker, the load
        tree, the store's stamps), here, unrecorded."""
        from ..store.verification import verify_unrecorded

        return verify_unrecorded(self.storage, manifest.run, manifest.name, progress,
                                 vis=self.reader.visibility).model_dump(mode="json")  # the manifest parsed once

    def verify_in_service(self, ref: str) -> dict[str, Any]:
        raise InvalidRequest("ckptd verify --in-service needs --server URL (or $CKPTD_URL)", field="in_service")

    # -- writes -----------------------------------------------------------------------------------
    def require_new(self, run: str, name: str) -> None:
        """The write side's own rule (``SessionStore.open``): any marker there, parsed or not, takes the name."""
        from ..store.session_reads import taken_error

        m = self.reader.visibility.marker(run, name)
        if m is not None:
            raise taken_error(run, name, m)

    def import_target(self) -> _RootImport:
        from ..store import SessionStore

        return _RootImport(SessionStore(self.storage))

    def gc(self, run: str, *, keep_last: int, keep_every: int | None, dry_run: bool, drop_parents: bool,
           stale_ttl: float, dead_after: float) -> dict[str, Any]:
        from ..store import SessionStore
        from ..store.retention import gc_run

        return gc_run(self.storage, run, keep_last=keep_last, keep_every=keep_every, dry_run=dry_run,
                      drop_parents=drop_parents,
                      sweep=lambda: SessionStore(self.storage, dead_after=dead_after).sweeper.reclaim_stale(stale_ttl))

    def remove(self, run: str, name: str, *, dry_run: bool) -> dict[str, Any]:
        from ..store.retention import remove

        return remove(self.storage, run, name, dry_run=dry_run).as_json()

    # -- conversions: the service job's steps (ckptd.reshard.jobs), in this process ---------------------
    def reshard_preview(self, req: ReshardRequest) -> Any:
        from ..reshard.jobs import outline_request
        from ..reshard.preview import preview

        return preview(outline_request(self.reader, req).plan())

    def write_plan(self, req: ReshardRequest, uri: str, workers: int | None) -> dict[str, Any]:
        """``--write-plan``: the plan for ``ckptd reshard-worker`` pods, written to ``uri``; nothing converted."""
        from ..reshard.executor import plan_engine
        from ..reshard.jobs import plan_conversion, write_job
        from ..store import SessionStore

        conv = plan_conversion(self.reader, req)
        plan_engine(conv.outline, req.device)  # refused before any write (cuda without a GPU)
        session = uuid.uuid4().hex
        n = max(1, min(workers or DEFAULT_WORKERS, len(conv.outline.cuts)))
        write_job(uri, conv.outline, n, conv.out, session, req.device, SessionStore(self.storage))
        return {"plan": uri, "workers": n, "units": len(conv.outline.cuts), "out": conv.out, "session": session}

    def reshard(self, req: ReshardRequest, *, bar: Bar) -> ReshardOutcome:
        """What a service job does (``plan_conversion``, then ``convert`` under a lease on the source),
        in this process; with the plan's per-rank preview."""
        from ..reshard.jobs import convert, plan_conversion
        from ..reshard.preview import plan_summary

        conv = plan_conversion(self.reader, req)
        progress = bar.start(conv.outline.bytes_to_write)
        with self.lease(conv.outline.manifest, "reshard"):  # gc spares the source meanwhile
            result = convert(self.reader, conv.outline, req, conv.out, uuid.uuid4().hex, progress=progress)
        summary = plan_summary(conv.outline)
        return ReshardOutcome(result=result, source=conv.outline.manifest.ref, spec=conv.spec,
                              per_rank_bytes=[sum(r.values()) for r in summary["per_rank"]],
                              imbalance=summary["imbalance"])

    def drill(self, ref: str, layouts: list[str], *, jobs: int, bar: Bar) -> dict[str, Any]:
        """What a service drill job does (``reshard.drill.drill_checkpoint``), here, under a lease."""
        from ..reshard.drill import drill_checkpoint

        src = parse_ref(ref)
        manifest = self.reader.manifest(src.run, src.name)
        with self.lease(manifest, "drill"):
            rec = drill_checkpoint(self.storage, manifest.ref, layouts, jobs=jobs, start=bar.start)
        return rec.model_dump(mode="json")

    def close(self) -> None:
        pass


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
        return self.sessions.intake.receive(*self._at, file)  # a file sink: hashed as written, no digest declared

    def commit(self, index: RankIndex) -> str:
        assert self._at is not None
        try:
            return self.sessions.put_index(*self._at, index).manifest_xxh3 or ""
        finally:
            self.sessions.activity.release(*self._at)

    def abort(self) -> None:
        if self._at is not None:
            self.sessions.activity.release(*self._at)
            self.sessions.sweeper.abort(*self._at)
