"""Direct reads: a load reads the service's data files itself when this host can open them.

When the service's root is a local directory (and ``CKPTD_DIRECT_READS`` is on), a read plan
asked for with ``local_paths`` names each data file's path on the service's filesystem. A rank
on the same host, or on a shared filesystem mounted at the same path, then reads its ranges with
``preadv`` straight into the destination tensors: no HTTP hop, no server CPU, no copy through a
socket. Every block digest is checked exactly as on the HTTP path. The service stays in charge of
*what* is read (the ref, the read lease, the plan); only the bytes travel differently.

Reads go through the page cache, cold or warm, as the read floor's do: each fetch reads its range
through a descriptor of its own (the same open file reopened through ``/proc/self/fd``: the
kernel keeps read-ahead state per descriptor, which the fetch threads sharing one would scramble),
so the kernel reads ahead of each fetch while its piece before is hashed, and the bytes land in the
destination with the kernel's one copy. (Past the cache, ``O_DIRECT`` into an aligned buffer waited
for the device on every read with nothing queued behind it, then copied into place: 0.7-0.8x as
fast on the development VM, BENCHMARKS.md, Save and load.)

Fallbacks, so that a direct read never fails a load that HTTP would pass:

* a path that cannot be opened, or whose size differs from the manifest's, is not used;
* a fetch whose digests fail on the direct path is fetched again over HTTP; if that passes, the
  local file is not the service's (another file at the same path on this host) and direct reads
  stop for the rest of the load. If HTTP fails too, the checkpoint is corrupt: its error is raised.
"""

from __future__ import annotations

import os
import stat
import threading
from typing import Callable, Mapping, TypeVar

from ckptd_schemas import ChecksumMismatch, Fetch
from ckptd_schemas.readplan import BlockVerifier

from ._scatter import Fill

__all__ = ["LocalFiles", "READ_SIZE"]

#: Bytes per ``preadv``: no larger than the kernel's read-ahead window (so it keeps reading ahead
#: while a piece is hashed) and small enough that the block hash finds it in cache.
READ_SIZE = 4 << 20
T = TypeVar("T")


class LocalFiles:
    """The data files of one checkpoint, opened on first use and shared by the fetch threads."""

    def __init__(self, paths: Mapping[str, str], sizes: Mapping[str, int]) -> None:
        self._paths = dict(paths)
        self._sizes = dict(sizes)
        self._fds: dict[str, int | None] = {}
        self._lock = threading.Lock()
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
        try:  # without blocking: a FIFO put at the path opens at once, and is no regular file
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None  # not on this host, or no permission: HTTP serves it
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != self._sizes.get(file):
            os.close(fd)
            return None
        return fd

    def _read(self, fd: int, f: Fetch, at: int, view: memoryview, check: BlockVerifier) -> None:
        """Fill ``view`` from byte ``at`` of the fetch, hashing each piece as it lands."""
        got = 0
        while got < len(view):
            piece = view[got:got + READ_SIZE]
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
        read from the file straight into the views it is given, each piece hashed as it lands, through
        a descriptor of the fetch's own (the same open file where it cannot be reopened)."""
        shared = self._fd(f.file)
        assert shared is not None
        try:
            fd = os.open(f"/proc/self/fd/{shared}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            fd = shared
        at = 0

        def fill(view: memoryview, check: BlockVerifier) -> int:
            nonlocal at
            self._read(fd, f, at, view, check)  # fills the whole view or raises
            at += len(view)
            return len(view)

        try:
            return consume(fill)
        finally:
            if fd != shared:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                if fd is not None:
                    os.close(fd)
            self._fds.clear()
