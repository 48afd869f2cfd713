"""The :class:`~.backends.Backend` through a running service: ``CatalogClient``, the service's code in its process.

Reads go a range per request with read-ahead (:mod:`.readahead`), one per checkpoint read, under a
read lease the service renews; conversions and drills run as jobs in the service's workers and are
followed until they end (the bar advances with the job's ``bytes_done``); retention runs there with
the service's own settings. What the service checks itself (a conversion's source, each chunk an
export reads) is not checked twice here.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

import xxhash

from ckptd_schemas import AlreadyCommitted, CkptdError, InvalidRequest, Manifest, RankIndex, error_from_body

from .backends import Bar, ReshardOutcome
from .readahead import ReadAhead

if TYPE_CHECKING:
    from ckptd_client.catalog import Upload
    from ckptd_schemas import CheckpointSummary, RunSummary
    from ckptd_schemas.api import SkippedCheckpoint
    from ckptd_schemas.readplan import ReadFn

    from ..interop.dcp_import import FileOut
    from ..reshard.models import ReshardRequest

__all__ = ["HttpBackend"]


class HttpBackend:
    """Through a service: its data files are read a range per request, with read-ahead, one per checkpoint read."""

    def __init__(self, url: str) -> None:
        from ckptd_client import CatalogClient

        self.where = url
        self.client = CatalogClient(url, retry_seconds=5.0, retry_refused=False)
        self._ahead: dict[str, ReadAhead] = {}
        self._lock = threading.Lock()  # verify reads two files at once

    # -- reads ------------------------------------------------------------------------------------
    def list_runs(self) -> list[RunSummary]:
        return self.client.list_runs()

    def list_checkpoints(self, run: str) -> list[CheckpointSummary]:
        return self.client.list_checkpoints(run)

    def run_names(self) -> list[str]:
        return [r.run for r in self.client.list_runs()]

    def manifest(self, run: str, name: str) -> Manifest:
        return self.client.manifest(f"{run}/{name}")

    def resolve(self, run: str, name: str) -> tuple[Manifest, list[SkippedCheckpoint]]:
        """:meth:`manifest`, and for ``latest`` the newer checkpoints the service skipped as known to be
        bad (``X-Ckptd-Skipped`` of the same answer)."""
        return self.client.resolve(f"{run}/{name}")

    def status(self, manifest: Manifest) -> tuple[str | None, str | None]:
        """The service's listing row of the checkpoint (the service applies the rule to its store)."""
        row = next((r for r in self.client.list_checkpoints(manifest.run) if r.name == manifest.name), None)
        return (row.status, row.status_reason) if row is not None else (None, None)

    def byte_source(self, manifest: Manifest) -> ReadFn:
        """Ranges a request each, with read-ahead (one :class:`ReadAhead` per checkpoint read)."""
        ref = manifest.ref
        with self._lock:
            ahead = self._ahead.get(ref)
            if ahead is None:
                ahead = self._ahead[ref] = ReadAhead(lambda f, s, e: self.client.read_range(ref, f, s, e),
                                                     {name: f.size for name, f in manifest.files.items()})
        return ahead.read

    def lease(self, manifest: Manifest, what: str) -> ContextManager[object]:
        """A read lease held through the service for the block: the service renews a lease only on
        the reads it serves, and a tool may pause between two of them for longer than a lease."""
        return self.client.lease(manifest.ref)

    # -- checks -----------------------------------------------------------------------------------
    def check_source(self, manifest: Manifest) -> None:
        """Nothing here: each chunk read over HTTP is checked as it arrives, and the service's own
        conversions check their source (a full pre-check would read every byte twice over the network)."""

    def verify(self, manifest: Manifest, progress: Callable[[int], None] | None) -> dict[str, Any]:
        """The one checker in this process over the bytes the service serves (nothing is taken on the
        service's word), and the load tree: the service checks it against the marker, this process
        against the manifest it verified."""
        from ckptd_schemas import CorruptCheckpoint
        from ckptd_schemas.loadtree import LoadTree

        from ..store.checker import verify_manifest

        report = verify_manifest(manifest, self.byte_source(manifest), progress=progress)
        try:
            named = self.client.load_tree_root(manifest.ref)
        except CorruptCheckpoint as e:
            report.problems.append(e.message)
        else:
            mine = LoadTree(manifest).root
            if named is not None and named != mine:
                report.problems.append(f"checkpoint {manifest.ref}: its marker names load tree {named}, its "
                                       f"manifest's is {mine}")
        return {"ref": report.ref, "ok": report.ok, "files": report.files, "tensors": report.tensors,
                "chunks": report.chunks, "bytes_read": report.bytes_read, "problems": report.problems}

    def verify_in_service(self, ref: str) -> dict[str, Any]:
        return self.client.verify(ref)  # the service's worker reads and checks; this process only asks

    # -- writes -----------------------------------------------------------------------------------
    def require_new(self, run: str, name: str) -> None:
        """The run's listing (what the service says is committed); a name taken by a marker that does
        not parse is refused by the session's open, still before any data file is read."""
        if run not in self.run_names():
            return
        row = next((r for r in self.client.list_checkpoints(run) if r.name == name), None)
        if row is not None:
            raise AlreadyCommitted(f"checkpoint {run}/{name} is already committed (session {row.session}); "
                                   f"committed checkpoints are immutable (import under a new name)",
                                   ref=f"{run}/{name}", session=row.session)

    def import_target(self) -> _HttpImport:
        return _HttpImport(self.where)

    def gc(self, run: str, *, keep_last: int, keep_every: int | None, dry_run: bool, drop_parents: bool,
           stale_ttl: float, dead_after: float) -> dict[str, Any]:
        """The service's gc (admin scope); it reclaims stale staging with its own settings."""
        return self.client.gc(run, keep_last=keep_last, keep_every=keep_every, dry_run=dry_run,
                              drop_parents=drop_parents)

    def remove(self, run: str, name: str, *, dry_run: bool) -> dict[str, Any]:
        return self.client.remove(f"{run}/{name}", dry_run=dry_run)

    # -- conversions: jobs in the service's workers ----------------------------------------------------
    def reshard_preview(self, req: ReshardRequest) -> Any:
        from ..reshard.preview import Preview

        return Preview(**self.client.reshard(req.source, req.to, preview=True, **self._options(req)))

    def write_plan(self, req: ReshardRequest, uri: str, workers: int | None) -> dict[str, Any]:
        raise InvalidRequest("--write-plan writes a plan for reshard-worker pods from a storage root: pass --root",
                             field="write_plan")

    def reshard(self, req: ReshardRequest, *, bar: Bar) -> ReshardOutcome:
        job = self.client.reshard(req.source, req.to, **self._options(req))  # a taken --out: says to name another
        job = _follow(job, self.client.job, bar)
        return ReshardOutcome(result=job["result"], source=job["source"], spec=job["spec"])

    @staticmethod
    def _options(req: ReshardRequest) -> dict[str, Any]:
        return req.model_dump(include={"out", "dtype", "device", "jobs"})

    def drill(self, ref: str, layouts: list[str], *, jobs: int, bar: Bar) -> dict[str, Any]:
        job = self.client.drill(ref, layouts, jobs=jobs)
        if not bar.quiet and sys.stderr.isatty():
            print(f"drill job {job['id']} of {job['source']} queued", file=sys.stderr)
        return _follow(job, self.client.job, bar)["result"]

    def close(self) -> None:
        for ahead in self._ahead.values():
            ahead.close()
        self.client.close()


def _follow(job: dict[str, Any], poll: Callable[[str], dict[str, Any]], bar: Bar | None) -> dict[str, Any]:
    """Poll a job until it ends (fast first: short jobs end quickly, then every 0.3 s); the job, or its
    error raised as the typed error it carries."""
    advance = bar.start(job.get("bytes_total") or 1) if bar is not None else None
    done, pause = 0, 0.02
    while job["state"] in ("queued", "running"):
        time.sleep(pause)
        pause = min(pause * 2, 0.3)
        job = poll(job["id"])
        if advance is not None and job.get("bytes_done", 0) > done:
            advance(job["bytes_done"] - done)
            done = job["bytes_done"]
    if job["state"] == "failed":
        err = error_from_body({"error": job["error"]}, 422)
        raise err if isinstance(err, CkptdError) else CkptdError(str(job["error"]))
    return job


class _SpoolOut:
    """A data file of the import, spooled to a temporary file (hashed while written), then streamed."""

    PIECE = 4 << 20

    def __init__(self, upload: Upload, file: str) -> None:
        self._upload, self.file = upload, file
        self._tmp = tempfile.NamedTemporaryFile(prefix="ckptd-import-", suffix=".bin", delete=False)
        self._h = xxhash.xxh3_64()
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self._tmp.write(data)
        self._h.update(data)
        self.size += len(data)

    def _pieces(self) -> Iterator[bytes]:
        with open(self._tmp.name, "rb") as f:
            while piece := f.read(self.PIECE):
                yield piece

    def finish(self) -> None:
        self._tmp.close()
        try:
            self._upload.put_file(self.file, self._pieces, size=self.size, xxh3=self._h.hexdigest())
        finally:
            os.unlink(self._tmp.name)

    def abort(self) -> None:
        self._tmp.close()
        if os.path.exists(self._tmp.name):
            os.unlink(self._tmp.name)


class _HttpImport:
    """``interop.dcp_import.ImportTarget`` through the service: the protocol a trainer's save speaks
    (one rank), through ``CatalogClient.upload``."""

    def __init__(self, url: str) -> None:
        from ckptd_client import CatalogClient

        self.client = CatalogClient(url, retry_seconds=30.0, retry_refused=False)  # a long write rides out a blip
        self._upload: Upload | None = None

    def open(self, run: str, name: str, session: str, step: int | None) -> None:
        self._upload = self.client.upload(f"{run}/{name}", session=session, step=step)

    def begin_file(self, file: str) -> FileOut:
        assert self._upload is not None
        return _SpoolOut(self._upload, file)

    def commit(self, index: RankIndex) -> str:
        assert self._upload is not None
        try:
            return self._upload.commit(index, timeout=600.0).manifest_xxh3 or ""
        finally:
            self.client.close()

    def abort(self) -> None:
        try:
            if self._upload is not None:
                self._upload.abort()
        finally:
            self.client.close()

