"""What the CLI reads from: a storage root directly, or a running service over HTTP."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, ContextManager, Protocol

from ckptd_schemas import Manifest, NotFound

if TYPE_CHECKING:  # annotations only: the API bodies are not built for commands that never list
    from ckptd_schemas import CheckpointSummary, RunSummary
    from ckptd_schemas.api import SkippedCheckpoint

from .readahead import ReadAhead
from .target import DEFAULT_ROOT, Target, open_root

__all__ = ["Backend", "HttpBackend", "RootBackend", "open_backend", "require_run"]


class Backend(Protocol):
    where: str  # the root or URL, for messages
    def list_runs(self) -> list[RunSummary]: ...
    def list_checkpoints(self, run: str) -> list[CheckpointSummary]: ...
    def run_names(self) -> list[str]: ...
    def manifest(self, run: str, name: str) -> Manifest: ...
    def resolve(self, run: str, name: str) -> tuple[Manifest, list[SkippedCheckpoint]]: ...
    def read(self, manifest: Manifest, file: str, start: int, end: int) -> bytes: ...
    def lease(self, manifest: Manifest, what: str) -> ContextManager[object]: ...
    def close(self) -> None: ...


class RootBackend:
    """A storage root read directly; it must exist (read-only commands never create one)."""

    def __init__(self, root: str) -> None:
        from ..store import CheckpointReader

        self.where = root
        self.reader = CheckpointReader(open_root(root, create=False))

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

        return Leases(self.reader.storage).hold(manifest.run, manifest.name, what)

    def close(self) -> None:
        pass


class HttpBackend:
    """Through a service: its data files are read a range per request, with read-ahead (see
    :mod:`ckptd.cli.readahead`), one per checkpoint read."""

    def __init__(self, url: str) -> None:
        from ckptd_client import CatalogClient

        self.where = url
        self.client = CatalogClient(url, retry_seconds=5.0, retry_refused=False)
        self._ahead: dict[str, ReadAhead] = {}
        self._lock = threading.Lock()  # verify reads two files at once

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

    def read(self, manifest: Manifest, file: str, start: int, end: int) -> bytes:
        ref = manifest.ref
        with self._lock:
            ahead = self._ahead.get(ref)
            if ahead is None:
                ahead = self._ahead[ref] = ReadAhead(lambda f, s, e: self.client.read_range(ref, f, s, e),
                                                     {name: f.size for name, f in manifest.files.items()})
        return ahead.read(file, start, end)

    def lease(self, manifest: Manifest, what: str) -> ContextManager[object]:
        """A read lease held through the service for the block: the service renews a lease only on
        the reads it serves, and a tool may pause between two of them for longer than a lease."""
        return self.client.lease(manifest.ref)

    def close(self) -> None:
        for ahead in self._ahead.values():
            ahead.close()
        self.client.close()


def open_backend(target: Target) -> Backend:
    """The backend for ``target`` (:func:`ckptd.cli.target.resolve_target` decides which)."""
    if target.server:
        return HttpBackend(target.server)
    return RootBackend(target.root or DEFAULT_ROOT)


def require_run(b: Backend, run: str) -> None:
    """A command about RUN (``ls RUN``, ``gc RUN``) that found nothing of it says so (exit 1) when
    the run is not there, instead of printing nothing. Called only once the command found nothing."""
    if run not in b.run_names():
        raise NotFound(f"no such run {run!r} in {b.where}", run=run)
