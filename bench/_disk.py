"""Page-cache eviction for cold-cache measurements (every suite that reads checkpoints cold)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

__all__ = ["evict"]


def _files(paths: list[Path]):
    for p in paths:
        if os.path.isdir(p):
            for dirpath, _, names in os.walk(p):
                yield from (os.path.join(dirpath, n) for n in names)
        else:
            yield p


def evict(paths: list[Path]) -> int:
    """Write back, then drop the page-cache pages of ``paths`` (files, or every file under a
    directory) with ``posix_fadvise(DONTNEED)``: no root needed. Returns the bytes evicted."""
    n = 0
    for p in _files(paths):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return n


def parallel(fn: Callable[[int], None], n: int) -> float:
    """Seconds for ``fn(0) ... fn(n - 1)`` run on ``n`` threads at once (a floor measured ``n``-wide)."""
    t0 = time.perf_counter()
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def read_span(path: str | Path, a: int, b: int, buf: memoryview) -> int:
    """Bytes ``[a, b)`` of ``path`` read with ``preadv`` into ``buf``, piece by piece, nothing kept: the
    read floor's one loop. Returns the bytes read (fewer at the end of the file)."""
    got = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while a < b:
            n = os.preadv(fd, [buf[:min(len(buf), b - a)]], a)
            if n <= 0:
                break
            a += n
            got += n
    finally:
        os.close(fd)
    return got
