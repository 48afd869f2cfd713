"""Read-ahead for byte ranges fetched over a latency-bound link (the service's HTTP range reads).

Why: ``ckptd verify --server`` and ``ckptd export --server`` read each data file front to back,
one range at a time, and a range read over HTTP waits a round trip (and the service's own read)
before its first byte: four requests in flight read about twice as fast as one (BENCHMARKS.md,
Verify). The page cache's read-ahead does this for local files.

Call order: ``ahead = ReadAhead(fetch, sizes)``; ``ahead.read(file, start, end)`` any number of
times, from any threads; ``ahead.close()``. A read that starts where the previous read of the same
file ended (or at byte 0) is sequential: the next ``depth`` ranges of the same length are fetched
in the background, and a later read of exactly such a range takes its result. A read elsewhere
fetches only itself, and every prefetched range of that file not in the new run ahead is
dropped, so at most ``depth`` ranges per file are held however the reads jump.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping

__all__ = ["ReadAhead"]

Fetch = Callable[[str, int, int], bytes]


class ReadAhead:
    """Sequential reads of several files through ``fetch``, ``depth`` ranges ahead per file, on
    ``workers`` threads shared by all files."""

    def __init__(self, fetch: Fetch, sizes: Mapping[str, int], *, depth: int = 3, workers: int = 4) -> None:
        self._fetch, self._sizes, self._depth = fetch, sizes, depth
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptd-read-ahead")
        self._pending: dict[tuple[str, int, int], Future[bytes]] = {}
        self._next: dict[str, int] = {}  # per file: where the last read ended
        self._lock = threading.Lock()

    def read(self, file: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``file``, as ``fetch`` returns them (its errors raised here)."""
        with self._lock:
            fut = self._pending.pop((file, start, end), None)
            if fut is None:
                fut = self._pool.submit(self._fetch, file, start, end)
            chain: list[tuple[str, int, int]] = []
            if self._next.get(file, 0) == start and end > start:  # sequential: the next ranges ahead
                pos, size = end, self._sizes.get(file, end)
                while len(chain) < self._depth and pos < size:
                    chain.append((file, pos, min(pos + end - start, size)))
                    pos = chain[-1][2]
            self._next[file] = end
            for key in [k for k in self._pending if k[0] == file and k not in chain]:
                self._pending.pop(key).cancel()  # this file's reads went elsewhere
            for key in chain:
                if key not in self._pending:
                    self._pending[key] = self._pool.submit(self._fetch, *key)
        return fut.result()

    def close(self) -> None:
        """Drop what was fetched ahead and not read; wait for the fetches already running."""
        with self._lock:
            for fut in self._pending.values():
                fut.cancel()
            self._pending.clear()
        self._pool.shutdown(wait=True)
