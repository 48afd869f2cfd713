"""What the CLI reads from: a storage root directly, or a running service over HTTP."""

from __future__ import annotations

from typing import Protocol

from ckptd_schemas import CheckpointSummary, Manifest, RunSummary

__all__ = ["Backend", "HttpBackend", "RootBackend", "open_backend"]


class Backend(Protocol):
    def list_runs(self) -> list[RunSummary]: ...
    def list_checkpoints(self, run: str) -> list[CheckpointSummary]: ...
    def manifest(self, run: str, name: str) -> Manifest: ...
    def read(self, manifest: Manifest, file: str, start: int, end: int) -> bytes: ...


class RootBackend:
    def __init__(self, root: str) -> None:
        from ..storage import open_storage
        from ..store import CheckpointReader

        self.reader = CheckpointReader(open_storage(root))

    def list_runs(self) -> list[RunSummary]:
        return self.reader.list_runs()

    def list_checkpoints(self, run: str) -> list[CheckpointSummary]:
        return self.reader.list_checkpoints(run)

    def manifest(self, run: str, name: str) -> Manifest:
        return self.reader.manifest(run, name)

    def read(self, manifest: Manifest, file: str, start: int, end: int) -> bytes:
        return self.reader.read_range(manifest.run, manifest.name, file, start, end)


class HttpBackend:
    def __init__(self, url: str) -> None:
        from ckptd_client import CheckpointClient

        self.client = CheckpointClient(url, retry_seconds=5.0)

    def list_runs(self) -> list[RunSummary]:
        return self.client.list_runs()

    def list_checkpoints(self, run: str) -> list[CheckpointSummary]:
        return self.client.list_checkpoints(run)

    def manifest(self, run: str, name: str) -> Manifest:
        return self.client.manifest(f"{run}/{name}")

    def read(self, manifest: Manifest, file: str, start: int, end: int) -> bytes:
        return self.client.read_range(manifest.ref, file, start, end)


def open_backend(root: str | None, server: str | None) -> Backend:
    if server:
        return HttpBackend(server)
    return RootBackend(root or "./ckptd-data")
