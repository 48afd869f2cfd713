"""Direct reads: a load reads the service's data files itself when this host can open them.

When the service's root is a local directory (and ``CKPTD_DIRECT_READS`` is on), a read plan
asked for with ``local_paths`` names each data file's path on the service's filesystem. A rank
on the same host, or on a shared filesystem mounted at the same path, then reads its ranges with
``preadv`` straight into the destination tensors: no HTTP hop, no server CPU, no copy through a
socket. Every block digest is checked exactly as on the HTTP path. The service stays in charge of
*what* is read (the ref, the read lease, the plan); only the bytes travel differently.

A file that is not in this host's page cache (a cold load: the service writes checkpoints past the
cache) is read with ``O_DIRECT`` into an aligned buffer and copied into place: the device fills the
buffer, and no cache page is allocated, filled and reclaimed for bytes read once (measured on the
development VM: 512 MiB cold for 0.02 CPU-s instead of ~0.5, in less wall time). A file the cache
holds (a warm load) is read through it. Whether it does is asked once per file (a ``RWF_NOWAIT``
read of its first page fails when the page is not cached).

Fallbacks, so that a direct read never fails a load that HTTP would pass:

* a path that cannot be opened, or whose size differs from the manifest's, is not used;
* a fetch whose digests fail on the direct path is fetched again over HTTP; if that passes, the
  local file is not the service's (another file at the same path on this host) and direct reads
  stop for the rest of the load. If HTTP fails too, the checkpoint is corrupt: its error is raised.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Callable, Mapping, TypeVar

from ckptd_schemas import ChecksumMismatch, Fetch
from ckptd_schemas.readplan import BlockVerifier

from ._scatter import Fill

__all__ = ["LocalFiles", "READ_SIZE"]

#: Bytes per ``preadv``: no larger than a typical read-ahead window (so the kernel keeps reading
#: ahead while a piece is hashed) and small enough that the block hash finds it in cache.
READ_SIZE = 4 << 20
ALIGN = 4096  # what O_DIRECT asks of the offset, the length and the buffer
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
T = TypeVar("T")


def _cached(fd: int) -> bool:
    """True unless a read of the file's first page would have to wait for the device."""
    if not _RWF_NOWAIT:
        return True
    try:
        os.preadv(fd, [bytearray(1)], 0, _RWF_NOWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


class LocalFiles:
    """The data files of one checkpoint, opened on first use and shared by the fetch threads."""

    def __init__(self, paths: Mapping[str, str], sizes: Mapping[str, int]) -> None:
        self._paths = dict(paths)
        self._sizes = dict(sizes)
        self._fds: dict[str, int | None] = {}
        self._uncached: dict[str, int] = {}  # file -> an O_DIRECT descriptor, for files the cache does not hold
        self._retired: list[int] = []  # O_DIRECT descriptors the device refused, closed with the rest
        self._lock = threading.Lock()
        self._scratch = threading.local()
        self.enabled = True  # False once the local files turned out not to be the service's
        self.bytes_read = 0

    def usable(self, file: str) -> bool:
        return self.enabled and self._fd(file) is not None

    def _fd(self, file: str) -> int | None:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = self._open(file)
            return self._fds[file]

    def _open(self, file: str) -> int | None:
        path = self._paths.get(file)
        if not path or not os.path.isabs(path):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None  # not on this host, or no permission: HTTP serves it
        if os.fstat(fd).st_size != self._sizes.get(file):
            os.close(fd)
            return None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead window
        if _O_DIRECT and not _cached(fd):
            try:
                direct = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_DIRECT)
            except OSError:
                pass  # the filesystem refuses O_DIRECT: through the cache
            else:
                if os.fstat(direct).st_ino == os.fstat(fd).st_ino:
                    self._uncached[file] = direct
                else:
                    os.close(direct)
        return fd

    def _pread_uncached(self, f: Fetch, pos: int, piece: memoryview) -> int:
        """Read ``piece`` from byte ``pos`` of the file past the page cache, through the aligned
        buffer; -1 when the device refuses (the caller reads it through the cache from then on)."""
        dfd = self._uncached.get(f.file)
        if dfd is None:
            return -1
        lo = pos - pos % ALIGN
        hi = -(-(pos + len(piece)) // ALIGN) * ALIGN
        bounce = getattr(self._scratch, "bounce", None)  # this thread's page-aligned buffer: a piece, aligned ends
        if bounce is None:
            bounce = self._scratch.bounce = memoryview(mmap.mmap(-1, READ_SIZE + 2 * ALIGN))
        bounce = bounce[:hi - lo]
        got = 0
        try:
            while got < len(bounce):
                n = os.preadv(dfd, [bounce[got:]], lo + got)
                if n <= 0:
                    break
                got += n
                if n % ALIGN:
                    break  # the end of the file
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            with self._lock:  # closed with the others (another thread may be reading with it now)
                if self._uncached.pop(f.file, None) is not None:
                    self._retired.append(dfd)
            return -1
        n = max(0, min(len(piece), got - (pos - lo)))
        piece[:n] = bounce[pos - lo:pos - lo + n]
        return n

    def _read(self, fd: int, f: Fetch, at: int, view: memoryview, check: BlockVerifier) -> None:
        """Fill ``view`` from byte ``at`` of the fetch, hashing each piece as it lands."""
        got = 0
        while got < len(view):
            piece = view[got:got + READ_SIZE]
            n = -1
            if f.file in self._uncached and len(piece) >= ALIGN:
                n = self._pread_uncached(f, f.start + at + got, piece)
            if n < 0:
                n = os.preadv(fd, [piece], f.start + at + got)
            if n <= 0:
                raise ChecksumMismatch(f"file {f.file!r}: ends before byte {f.start + at + got} "
                                       f"(the read plan asks for [{f.start}, {f.end}))", file=f.file)
            check.update(piece[:n])
            got += n
        with self._lock:
            self.bytes_read += got

    def read(self, f: Fetch, consume: Callable[[Fill], T]) -> T:
        """The range source of this host's files: ``consume`` gets a :data:`Fill` of the fetch's bytes,
        read from the file straight into the views it is given, each piece hashed as it lands.
        No WILLNEED for the whole range: with several fetch threads per rank and several ranks, the
        queued ranges compete with the reads waited on; the kernel's sequential read-ahead (the file
        was opened SEQUENTIAL) keeps the disk busy while a piece is hashed. A cold load at another
        world size is faster without it (BENCHMARKS.md, Figures behind the code)."""
        fd = self._fd(f.file)
        assert fd is not None
        at = 0

        def fill(view: memoryview, check: BlockVerifier) -> int:
            nonlocal at
            self._read(fd, f, at, view, check)  # fills the whole view or raises
            at += len(view)
            return len(view)

        return consume(fill)

    def close(self) -> None:
        with self._lock:
            for fd in [*self._fds.values(), *self._uncached.values(), *self._retired]:
                if fd is not None:
                    os.close(fd)
            self._fds.clear()
            self._uncached.clear()
            self._retired.clear()
