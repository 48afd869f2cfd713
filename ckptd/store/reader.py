"""Read side of the store: list, resolve ``RUN/latest``, manifests, byte ranges.

What is visible is decided by :mod:`.visibility` (the one rule: a marker that parses and names
the digest of a manifest that parses and agrees with it); this module only reads what that rule
lets through. Manifests are cached by digest, never by name, and served only as bytes that hash
to their marker's digest at the time they are served.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from ckptd_schemas import (
    LATEST, CheckpointNotFound, CheckpointSummary, ChecksumMismatch, Manifest, RunSummary, check_file,
)

from ..storage import Storage
from .paths import Committed, Marker, Paths
from .records import status_of
from .visibility import Visibility, order_key

__all__ = ["CheckpointReader", "naming_tensor", "page_of"]

MARKER_TTL = 2.0  # seconds a data read may reuse a concrete checkpoint's visibility check
MAX_CHECKED = 256  # concrete checkpoints whose last check data reads remember


def page_of(names: list[str], after: str | None, limit: int | None) -> tuple[list[str], str | None]:
    """One page of a listing in name order: at most ``limit`` of ``names`` (sorted) after ``after``, and
    the last of them when more follow (where the next page starts after), else None."""
    rest = names if after is None else [n for n in names if n > after]
    if limit is None or len(rest) <= limit:
        return rest, None
    return rest[:limit], rest[limit - 1]


@contextmanager
def naming_tensor(tensor: str, ref: str) -> Iterator[None]:
    """Re-raise damaged bytes (the :class:`ChecksumMismatch` family: a file absent, resized, or failing
    its digests) with the tensor they were read for, where the storage could name only the file."""
    try:
        yield
    except ChecksumMismatch as e:
        if "tensor" in e.details:
            raise
        raise type(e)(f"tensor {tensor!r} of {ref}: {e.message}", **{**e.details, "tensor": tensor}) from e


class CheckpointReader:
    def __init__(self, storage: Storage, *, visibility: Visibility | None = None,
                 on_invisible: Callable[[str, str, str], None] | None = None) -> None:
        self.storage = storage
        self.visibility = visibility or Visibility(storage, on_invisible=on_invisible)
        # (run, name) -> when its manifest was checked, and that manifest's digest (the parsed manifest
        # stays in the visibility's cache, which bounds its memory)
        self._checked: dict[tuple[str, str], tuple[float, str]] = {}
        self._lock = threading.Lock()

    # -- what is visible ----------------------------------------------------------------------
    def marker(self, run: str, name: str) -> Marker | None:
        """The marker of ``run/name`` when that checkpoint is visible, else None."""
        c = self.visibility.check(run, name)
        return c.marker if c is not None else None

    def runs_page(self, may_read: Callable[[str], bool] | None = None, *, after: str | None = None,
                  limit: int | None = None) -> tuple[list[RunSummary], str | None]:
        """At most ``limit`` summaries of the runs ``may_read`` lets through, by name after ``after``, and
        the name the next page follows (None: none follow). ``may_read`` chooses before any run's listing
        is read, and only the page's runs are listed (a token that reads one run costs one listing),
        each shared for a moment with every other summary (``Visibility.recent_listing``)."""
        runs = [r for r in self.visibility.runs() if may_read is None or may_read(r)]
        out = []
        for run in (window := page_of(runs, after, limit))[0]:
            visible = self.visibility.recent_listing(run)
            latest = self.visibility.latest(visible).checkpoint
            out.append(RunSummary(run=run, checkpoints=len(visible), latest=latest.name if latest else None))
        return out, window[1]

    def checkpoints_page(self, run: str, *, after: str | None = None,
                         limit: int | None = None) -> tuple[list[CheckpointSummary], str | None]:
        """The visible checkpoints among at most ``limit`` of the run's names after ``after`` (by name),
        oldest first (``order_key``), each with its status, and the name the next page follows (None:
        none follow). Only those names' markers and records are read: the run's names are one listing."""
        names, after_this = page_of(self.visibility.names(run), after, limit)
        visible = sorted((c for n in names if (c := self.visibility.check(run, n)) is not None), key=order_key)
        return [c.summary(status_of(self.storage, c)) for c in visible], after_this

    def committed(self, run: str, name: str) -> Committed:
        """The visible checkpoint ``run/name`` (``latest`` allowed), or :class:`CheckpointNotFound`."""
        return self.visibility.resolve(run, name)

    def resolve(self, run: str, name: str) -> tuple[str, Marker]:
        """The concrete name and marker for ``name`` (``latest``: the newest visible trainer checkpoint not known to be bad, ``Visibility.latest``)."""
        c = self.visibility.resolve(run, name)
        return c.name, c.marker

    def _manifest_for_data(self, run: str, name: str) -> Manifest:
        """:meth:`manifest`, with a concrete name's checked manifest reused for ``MARKER_TTL`` seconds.

        A load sends one request per byte range; checking the marker and manifest again for each
        is two more storage round trips per range. Only data reads use this: a manifest request
        always checks at once, and a data read just after a deletion fails when it reaches the
        deleted file.
        """
        if name == LATEST:
            return self.manifest(run, name)
        now = time.monotonic()
        with self._lock:
            hit = self._checked.get((run, name))
        if hit is not None and now - hit[0] < MARKER_TTL:
            manifest = self.visibility.cached(hit[1])
            if manifest is not None:
                return manifest
        c = self.committed(run, name)
        manifest = self.visibility.manifest(c)
        with self._lock:
            self._checked[(run, name)] = (now, c.digest)
            if len(self._checked) > MAX_CHECKED:
                self._checked.pop(next(iter(self._checked)))
        return manifest

    def manifest(self, run: str, name: str) -> Manifest:
        return self.visibility.manifest(self.committed(run, name))

    def manifest_bytes(self, run: str, name: str) -> bytes:
        """The stored manifest's bytes, only when they hash to the marker's digest now."""
        return self.visibility.manifest_bytes(self.committed(run, name))

    # -- data ------------------------------------------------------------------
    def file_key(self, run: str, name: str, file: str) -> tuple[str, int]:
        """Storage key and size of a data file of a committed checkpoint."""
        check_file(file)
        manifest = self._manifest_for_data(run, name)
        entry = manifest.files.get(file)
        if entry is None:
            raise CheckpointNotFound(f"checkpoint {manifest.ref} has no file {file!r}", ref=manifest.ref, file=file)
        return Paths.file(run, manifest.name, manifest.session, file), entry.size

    def read_range(self, run: str, name: str, file: str, start: int, end: int) -> bytes:
        key, size = self.file_key(run, name, file)
        if not 0 <= start <= end <= size:
            raise CheckpointNotFound(f"byte range [{start}, {end}) outside file {file!r} of {size} bytes",
                                     file=file)
        self.storage.check_committed(key, size, file=file)  # absent or resized: CorruptCheckpoint, at once
        return self.storage.read_committed(key, start, end, size, file=file)
