"""Read side of the store: list, resolve ``RUN/latest``, manifests, byte ranges.

Only committed checkpoints are visible: a checkpoint exists for readers iff
its ``COMMITTED`` marker exists and the manifest it names has the digest it
names. Committed checkpoints are immutable, so manifests are cached by
(ref, session, digest).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from pydantic import ValidationError

from ckptd_schemas import (
    LATEST, CheckpointNotFound, CheckpointSummary, IntegrityError, Manifest, RunSummary, StorageError,
    check_file, check_name, check_run,
)

from ..storage import Storage
from .gcpause import gc_paused
from .hashing import xxh3_hex
from .layout import Marker, Paths

__all__ = ["CheckpointReader"]

MARKER_TTL = 2.0  # seconds a data read may reuse a concrete checkpoint's marker


def _step_key(s: CheckpointSummary) -> tuple:
    return (s.step if s.step is not None else -1, s.name)


class CheckpointReader:
    def __init__(self, storage: Storage, *, cache_size: int = 64) -> None:
        self.storage = storage
        self._cache: OrderedDict[tuple, Manifest] = OrderedDict()
        self._cache_size = cache_size
        self._markers: dict[tuple[str, str], tuple[float, Marker]] = {}
        self._lock = threading.Lock()

    # -- markers --------------------------------------------------------------
    def marker(self, run: str, name: str) -> Marker | None:
        data = self.storage.read_json_or_none(Paths.marker(run, name))
        if data is None:
            return None
        try:
            return Marker.model_validate(data)
        except ValidationError as e:
            raise IntegrityError(f"COMMITTED marker of {run}/{name} is malformed: {e.errors()[0]['msg']}",
                                 ref=f"{run}/{name}") from e

    def list_runs(self) -> list[RunSummary]:
        out = []
        for run in self.storage.list(Paths.runs()):
            ckpts = self.list_checkpoints(run)
            latest = self._latest(ckpts)
            out.append(RunSummary(run=run, checkpoints=len(ckpts), latest=latest.name if latest else None))
        return out

    def list_checkpoints(self, run: str) -> list[CheckpointSummary]:
        check_run(run)
        out = []
        for name in self.storage.list(Paths.run(run)):
            try:
                m = self.marker(run, name)
            except IntegrityError:
                continue
            if m is None:
                continue
            out.append(CheckpointSummary(run=run, name=name, step=m.step, derived_from=m.derived_from,
                                         session=m.session, committed_at=m.committed_at,
                                         manifest_xxh3=m.manifest_xxh3))
        return sorted(out, key=_step_key)

    @staticmethod
    def _latest(ckpts: list[CheckpointSummary]) -> CheckpointSummary | None:
        trainer = [c for c in ckpts if c.derived_from is None and c.step is not None]
        return max(trainer, key=_step_key) if trainer else None

    def resolve(self, run: str, name: str) -> tuple[str, Marker]:
        """The concrete name and marker for ``name`` (``latest`` = highest committed trainer step)."""
        check_run(run)
        if name == LATEST:
            latest = self._latest(self.list_checkpoints(run))
            if latest is None:
                raise CheckpointNotFound(f"run {run!r} has no committed trainer checkpoint", ref=f"{run}/latest")
            name = latest.name
        check_name(name)
        m = self.marker(run, name)
        if m is None:
            raise CheckpointNotFound(f"checkpoint {run}/{name} does not exist or is not committed",
                                     ref=f"{run}/{name}")
        return name, m

    def _resolve_for_data(self, run: str, name: str) -> tuple[str, Marker]:
        """``resolve`` with the marker of a concrete name cached for ``MARKER_TTL`` seconds.

        A load sends one request per byte range; reading ``COMMITTED`` again for each is one
        more storage round trip per range (a GET on S3). Only data reads use this: a manifest
        request always sees a deletion at once, and a data read just after one fails with
        not-found when it reaches the deleted file.
        """
        if name == LATEST:
            return self.resolve(run, name)
        now = time.monotonic()
        with self._lock:
            hit = self._markers.get((run, name))
        if hit is not None and now - hit[0] < MARKER_TTL:
            return name, hit[1]
        name, m = self.resolve(run, name)
        with self._lock:
            self._markers[(run, name)] = (now, m)
            if len(self._markers) > 4 * self._cache_size:
                self._markers.pop(next(iter(self._markers)))
        return name, m

    def manifest(self, run: str, name: str) -> Manifest:
        return self._manifest_of(run, *self.resolve(run, name))

    def _manifest_of(self, run: str, name: str, m: Marker) -> Manifest:
        key = (run, name, m.session, m.manifest_xxh3)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        path = f"{Paths.session(run, name, m.session)}/{m.manifest}"
        try:
            raw = self.storage.read(path)
        except StorageError as e:
            raise IntegrityError(f"manifest of {run}/{name} named by its marker is unreadable: {e.message}",
                                 ref=f"{run}/{name}", file=m.manifest) from e
        if xxh3_hex(raw) != m.manifest_xxh3:
            raise IntegrityError(f"manifest of {run}/{name} does not match the digest in its COMMITTED marker",
                                 ref=f"{run}/{name}", file=m.manifest)
        with gc_paused():  # a 1,024-rank manifest is a million small objects
            manifest = Manifest.model_validate_json(raw)
        with self._lock:
            self._cache[key] = manifest
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return manifest

    def manifest_bytes(self, run: str, name: str) -> bytes:
        name, m = self.resolve(run, name)
        return self.storage.read(f"{Paths.session(run, name, m.session)}/{m.manifest}")

    # -- data ------------------------------------------------------------------
    def file_key(self, run: str, name: str, file: str) -> tuple[str, int]:
        """Storage key and size of a data file of a committed checkpoint."""
        check_file(file)
        manifest = self._manifest_of(run, *self._resolve_for_data(run, name))
        entry = manifest.files.get(file)
        if entry is None:
            raise CheckpointNotFound(f"checkpoint {manifest.ref} has no file {file!r}", ref=manifest.ref, file=file)
        return Paths.file(run, manifest.name, manifest.session, file), entry.size

    def read_range(self, run: str, name: str, file: str, start: int, end: int) -> bytes:
        key, size = self.file_key(run, name, file)
        if not 0 <= start <= end <= size:
            raise CheckpointNotFound(f"byte range [{start}, {end}) outside file {file!r} of {size} bytes",
                                     file=file)
        return self.storage.read(key, start, end)
