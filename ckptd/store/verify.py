"""Independent verification of a committed checkpoint (docs/design.md §2 item 5).

``ckptd verify`` (``--root`` and ``--server``), the service's verification after a commit or on
request, gc's newest-verified rule and the benches all call :func:`verify_manifest`, which runs the
one checker (:func:`ckptd.store.checker.judge`, the commit's own) over the bytes a
:class:`ByteSource` returns, with the tiling of every tensor checked too, and reports every
problem instead of raising the first. The bytes come from storage directly (``--root``) or from
the service over HTTP (``--server``), so ``ckptd verify`` never trusts the process that wrote them;
the verdict is the commit's by construction, since it is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from ckptd_schemas import Manifest

from .checker import READ_SIZE, judge

__all__ = ["ByteSource", "VerifyReport", "verify_manifest"]


class ByteSource(Protocol):
    def read(self, file: str, start: int, end: int) -> bytes: ...


@dataclass
class VerifyReport:
    ref: str
    files: int = 0
    tensors: int = 0
    chunks: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class _Windows:
    """A :class:`ByteSource` as the checker reads: into its buffer, window by window."""

    def __init__(self, source: ByteSource) -> None:
        self.source = source

    def read_into(self, file: str, start: int, view: memoryview) -> int:
        data = self.source.read(file, start, start + len(view))
        view[:len(data)] = data
        return len(data)


def verify_manifest(
    manifest: Manifest, source: ByteSource, *, progress: Callable[[int], None] | None = None, jobs: int = 2,
    storage_errors_are_problems: bool = True,
) -> VerifyReport:
    """Check every file, chunk and tensor of ``manifest`` against the bytes ``source`` returns, ``jobs``
    files at a time (a read waits on the device or the network without the GIL, so a second file's
    reads keep it busy while the first one's windows are hashed). Problems in file order. A store that
    fails a read (``StorageError``) is a problem of that file, or, with ``storage_errors_are_problems``
    False, raised: a verification whose outcome is recorded must not call a checkpoint bad because
    its store was briefly unreachable."""
    verdict = judge(manifest, _Windows(source), jobs=jobs, read_size=READ_SIZE, tiling=True, progress=progress,
                    storage_errors_are_problems=storage_errors_are_problems)
    chunks = sum(len(t.table) for t in manifest.tensors) + sum(1 for o in manifest.objects if o.location is not None)
    return VerifyReport(ref=manifest.ref, files=len(manifest.files), tensors=len(manifest.tensors), chunks=chunks,
                        bytes_read=verdict.bytes_read, problems=[p.message for p in verdict.problems])
