"""Direct writes: a saving rank writes its data files into the service's staging directory itself.

When the service's root is a local directory (and ``CKPTD_DIRECT_WRITES`` is on), opening a session
with ``direct_writes`` answers with the session's data directory and a probe (:class:`DirectWrites`).
A rank that reads the probe's token back shares the service's filesystem (same host, or a shared
filesystem mounted at the same path). For each data file it then:

1. writes the file into that directory under a staging name (``.<file>.direct-<nonce>``) with
   ``writev`` from the snapshot, handing every 32 MiB to write-back as it goes (no fsync: the
   service makes the file durable when it adopts it);
2. asks the service to adopt it (``POST .../files/<file>/adopt`` with the size and XXH3). The
   service hashes every byte, as it hashes an upload, refuses and deletes the file on a mismatch,
   and otherwise makes it durable and renames it into place.

The commit protocol is unchanged: the service accepts no byte it has not hashed itself, and a
file exists for the session only once adopted. What is saved is the loopback HTTP hop (the socket
copies on both sides and the service's receive loop): the service's CPU per saved byte falls about
fourfold, and the page-cache writes happen in the rank, as they do for ``dcp.save``.

Fallbacks, so that a direct write never fails a save that an upload would pass: a probe that does
not read back, a staged file that cannot be written, or an adopt refused for the staged file itself
(missing, resized, wrong digest) sends that file over HTTP and turns direct writes off for the rest
of the save. Errors about the session (committed, aborted, refused) are raised as they are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Iterable

from ckptd_schemas import ChecksumMismatch, DirectWrites, InvalidName, InvalidRequest, staged_name

__all__ = ["StagingDir", "probe"]

log = logging.getLogger("ckptd_client")

_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024
#: Every this many bytes, the range just written is handed to write-back (as the service does for
#: an upload, ``ckptd.storage.local``): dirty pages stay few, so the kernel does not throttle the
#: writer, and the service's fsync after adopting waits for the last window only.
WRITEBACK_BYTES = 32 << 20
_FADVISE = hasattr(os, "posix_fadvise")

#: Refusals of a staged file (not of the session): the file goes over HTTP instead.
FALL_BACK = (ChecksumMismatch, InvalidRequest, InvalidName)


def probe(info: DirectWrites | None) -> "StagingDir | None":
    """The session's staging directory if this process sees the service's filesystem, else None."""
    if info is None:
        return None
    try:
        with open(info.probe, "rb") as f:
            if f.read(256).decode(errors="replace") != info.token:
                return None
    except OSError:
        return None
    return StagingDir(info.dir)


class StagingDir:
    """Writes staged files; shared by a rank's upload threads. ``enabled`` turns False on the first
    fallback, so the rest of the save goes over HTTP."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.enabled = True
        self.bytes_written = 0

    def write(self, file: str, size: int, pieces: Iterable[bytes | memoryview]) -> str | None:
        """Write ``file``'s bytes under a fresh staging name; return the name, or None (and disable
        direct writes) when this host cannot write there."""
        staged = staged_name(file, uuid.uuid4().hex)
        path = os.path.join(self.path, staged)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self.disable(f"cannot create {path}: {e.strerror or e}")
            return None
        try:
            written = flushed = 0
            batch: list[bytes | memoryview] = []
            held = 0
            for piece in _windows(pieces, WRITEBACK_BYTES):
                batch.append(piece)
                held += len(piece)
                if len(batch) == _IOV_MAX or held >= WRITEBACK_BYTES:
                    written += _writev_all(fd, batch)
                    batch, held = [], 0
                    if _FADVISE and written - flushed >= WRITEBACK_BYTES:
                        # starts write-back of the dirty range; the pages stay cached for the service's hash
                        os.posix_fadvise(fd, flushed, written - flushed, os.POSIX_FADV_DONTNEED)
                        flushed = written
            if batch:
                written += _writev_all(fd, batch)
            if written != size:
                raise OSError(f"wrote {written} bytes, the file has {size}")
        except OSError as e:
            self.discard(staged)
            self.disable(f"writing {path} failed: {e.strerror or e}")
            return None
        finally:
            os.close(fd)
        self.bytes_written += size
        return staged

    def discard(self, staged: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.path, staged))

    def disable(self, why: str) -> None:
        if self.enabled:
            log.warning("direct writes off for this save (%s); uploading over HTTP", why)
        self.enabled = False


def _windows(pieces: Iterable[bytes | memoryview], size: int) -> Iterable[bytes | memoryview]:
    """The pieces, the long ones cut at ``size``: each write-back window is handed on as soon as it is written."""
    for p in pieces:
        if len(p) <= size:
            yield p
            continue
        view = memoryview(p)
        for i in range(0, len(view), size):
            yield view[i:i + size]


def _writev_all(fd: int, pieces: list[bytes | memoryview]) -> int:
    """``os.writev`` of every piece, finishing short writes; returns the bytes written."""
    total = sum(len(p) for p in pieces)
    n = os.writev(fd, pieces)
    if n == total:
        return n
    done = n
    for p in pieces:  # a short write (rare on regular files): the rest piece by piece
        view = memoryview(p)
        if n >= len(view):
            n -= len(view)
            continue
        view = view[n:]
        n = 0
        while view:
            k = os.write(fd, view)
            view = view[k:]
            done += k
    return done
