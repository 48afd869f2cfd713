"""Durable local writes that bypass the page cache (``O_DIRECT``), one write in flight behind the caller.

Off unless ``CKPTD_DIRECT_IO=1``: measure before switching it on (BENCHMARKS.md, "Writes around the
page cache"). Why it exists: a buffered write costs far more CPU than the bytes' copy. The kernel
copies into the page cache, allocates and later reclaims those pages and writes them back; measured
on one 2-core VM (AMD EPYC), writing 1 GiB and fsyncing it took 1.6-1.8 s of CPU buffered against
0.1 s with ``O_DIRECT`` plus a 0.27 s user-space copy into an aligned buffer, and ``ckptd reshard`` used
a quarter less CPU in the same wall time. Why it is off: on another 2-core VM (Intel Xeon) it saved
2-13 % of the CPU, left ``ckptd reshard``'s time where it was and made ``ckptd export``, one file
written front to back, 10-15 % slower: one write in flight per file keeps fewer writes at the disk
than the page cache's early write-back (``LocalStorage``) does.

How, for one file (:class:`DirectWrites`, owned by ``LocalStorage``'s writer):

1. ``write`` copies the caller's bytes into a page-aligned buffer of :data:`BUFFER_BYTES`. A full
   buffer goes to a shared I/O thread as one ``pwrite`` at an aligned offset, and the caller goes on
   filling the file's second buffer: the disk writes block *k* while block *k+1* is copied.
2. The first full buffer switches the descriptor to ``O_DIRECT`` (``fcntl``). Where the filesystem
   refuses it, that buffer and every later one is written through the page cache instead, so a file
   never fails for want of direct I/O; files smaller than one buffer never switch.
3. ``finish`` waits for the write in flight, clears ``O_DIRECT`` and writes the unaligned tail
   through the page cache; the caller then ``fsync``s (needed either way: the device's write cache
   and the file's size) and renames, exactly as for a buffered file.

Memory is bounded across the process: buffers come from one pool of :data:`POOL_BUFFERS`; a writer
that finds the pool empty at its first write stays buffered (the old path) for its whole life. An
I/O error is raised at the next ``write`` or at ``finish``, never lost.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["BUFFER_BYTES", "POOL_BUFFERS", "DirectWrites", "enabled"]

#: Bytes per aligned buffer, and so per direct ``pwrite``.
BUFFER_BYTES = 8 << 20
#: Aligned buffers in the process (two per file being written directly): 64 MiB at most.
POOL_BUFFERS = 8
_ALIGN = 4096  # covers every logical block size Linux supports for O_DIRECT
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def enabled() -> bool:
    """Whether durable local writes try ``O_DIRECT`` (``CKPTD_DIRECT_IO=1``; default off; Linux only)."""
    return bool(_O_DIRECT) and os.environ.get("CKPTD_DIRECT_IO", "0").lower() in ("1", "true", "yes", "on")


class _Pool:
    def __init__(self, size: int) -> None:
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        self._left = size  # buffers not yet allocated
        self._io: ThreadPoolExecutor | None = None

    def take(self, n: int) -> list[mmap.mmap] | None:
        """``n`` page-aligned buffers, or None when the pool cannot give them all now."""
        with self._lock:
            if len(self._free) + self._left < n:
                return None
            got = [self._free.pop() for _ in range(min(n, len(self._free)))]
            while len(got) < n:
                got.append(mmap.mmap(-1, BUFFER_BYTES))  # anonymous maps are page-aligned
                self._left -= 1
            return got

    def give(self, bufs: list[mmap.mmap]) -> None:
        with self._lock:
            self._free.extend(bufs)

    def submit(self, fn, *args) -> Future:  # type: ignore[no-untyped-def]
        with self._lock:
            if self._io is None:
                self._io = ThreadPoolExecutor(max_workers=max(1, POOL_BUFFERS // 2),
                                              thread_name_prefix="ckptd-direct-io")
            io = self._io
        return io.submit(fn, *args)


_pool = _Pool(POOL_BUFFERS)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        try:
            n = os.pwrite(fd, data, offset)
        except OSError as e:
            # fcntl took O_DIRECT but this write was refused (alignment the filesystem wants larger
            # than 4 KiB, or no direct I/O after all): write it, and the rest, through the page cache
            if e.errno != errno.EINVAL or not fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT:
                raise
            _set_direct(fd, False)
            n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class DirectWrites:
    """The bytes of one file, written at increasing offsets from 0 (see the module docstring).

    ``open`` returns None when the pool has no buffers to spare; the caller then writes buffered.
    """

    def __init__(self, fd: int, bufs: list[mmap.mmap]) -> None:
        self._fd = fd
        self._bufs = bufs
        self._views = [memoryview(b) for b in bufs]
        self._cur = 0            # the buffer being filled
        self._fill = 0           # bytes in it
        self._offset = 0         # file offset of its first byte
        self._direct: bool | None = None  # unknown until the first full buffer
        self._pending: Future | None = None
        self.written = 0

    @classmethod
    def open(cls, fd: int) -> DirectWrites | None:
        bufs = _pool.take(2)
        return cls(fd, bufs) if bufs is not None else None

    @property
    def direct(self) -> bool:
        """Whether the filesystem took ``O_DIRECT`` (False until a full buffer was written)."""
        return bool(self._direct)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            buf = self._views[self._cur]
            n = min(len(view), BUFFER_BYTES - self._fill)
            buf[self._fill:self._fill + n] = view[:n]
            self._fill += n
            self.written += n
            view = view[n:]
            if self._fill == BUFFER_BYTES:
                self._submit()

    def _submit(self) -> None:
        if self._direct is None:
            self._direct = _set_direct(self._fd, True)
        self._wait()  # the other buffer's write is done: it is free to fill next
        self._pending = _pool.submit(_pwrite_all, self._fd, self._views[self._cur], self._offset)
        self._offset += BUFFER_BYTES
        self._cur ^= 1
        self._fill = 0

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def finish(self) -> None:
        """Every byte written (the tail through the page cache); the caller fsyncs next.

        The buffers go back to the pool whether or not it raises.
        """
        try:
            self._wait()
            if self._fill:
                if self._direct:
                    _set_direct(self._fd, False)
                _pwrite_all(self._fd, self._views[self._cur][:self._fill], self._offset)
                self._offset += self._fill
                self._fill = 0
        finally:
            self.release()

    def release(self) -> None:
        """Give the buffers back (after waiting for the write in flight); idempotent."""
        if not self._bufs:
            return
        try:
            if self._pending is not None:
                self._pending.exception()  # wait; an error is the caller's to raise or drop
        finally:
            self._pending = None
            bufs, self._bufs, self._views = self._bufs, [], []
            _pool.give(bufs)


def _set_direct(fd: int, on: bool) -> bool:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
    except OSError:
        return False
    return on
