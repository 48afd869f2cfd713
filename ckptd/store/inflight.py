"""How many requests the store layer keeps in flight against a storage, an ordered map that keeps them,
and reads or writes shared by the calls that arrived before them.

One rule: on a local root a read or a ``stat`` costs microseconds, so one at a time; on a remote
store (no local path: S3, a network filesystem through fsspec) each costs a round trip, so
:data:`REMOTE_REQUESTS` at a time. A commit of a thousand ranks reads a thousand indexes, a digest
record and two stamps per file: one by one on S3 that is minutes of round trips (BENCHMARKS.md,
Figures behind the code).

Call order: ``n = requests_in_flight(storage, key)`` with any key of the objects to be read, then
``for result in ordered_map(fn, items, n)``: the results come in the items' order, at most ``n``
calls run at once and at most ``n`` results wait ahead of the consumer (memory stays bounded
however many items there are).

Where many calls ask the same question of a remote store at once (the write gate, before each of the
files and indexes of a thousand ranks arriving together), ``SharedCalls().call(key, fn)`` answers each
call with a read of ``key`` begun after the call arrived: as good as its own read, since it sees the
store as it was at some moment after the call came. One read of a key runs at a time; the calls that
arrive while it runs wait for the next one and share it (a group commit of reads): two reads' latency
at most, and a handful of requests instead of one per call. A read that stalls (a request the store
does not answer) holds the next one back :data:`WAIT_AHEAD` seconds at most, then the next begins beside
it: one slow request never stalls every write of a session. Writes are shared the same way: where ``fn``
stores what the calls queued before it began (the rank indexes arriving together, :mod:`.rank_indexes`), one
write stores them all.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from itertools import islice
from typing import Any, Generic, TypeVar

from ..storage import Storage

__all__ = ["REMOTE_REQUESTS", "SharedCalls", "is_remote", "ordered_map", "requests_in_flight"]

REMOTE_REQUESTS = 16
WAIT_AHEAD = 0.5
"""Seconds a shared read waits for the one before it to end before it begins anyway."""

T = TypeVar("T")
R = TypeVar("R")


def is_remote(storage: Storage, key: str) -> bool:
    """Whether ``key`` is reached over the network (no local path), each request a round trip."""
    return storage.local_path(key) is None


def requests_in_flight(storage: Storage, key: str) -> int:
    """1 for a local root, :data:`REMOTE_REQUESTS` for a store reached over the network."""
    return REMOTE_REQUESTS if is_remote(storage, key) else 1


def ordered_map(fn: Callable[[T], R], items: Iterable[T], n: int) -> Iterator[R]:
    """``fn`` over ``items`` with up to ``n`` calls at once, the results in order; ``n`` <= 1: plain
    ``map``, in this thread. An exception is raised where its item's result would have come."""
    if n <= 1:
        yield from map(fn, items)
        return
    it = iter(items)
    with ThreadPoolExecutor(n, thread_name_prefix="ckptd-store-read") as pool:
        ahead: deque[Future[R]] = deque(pool.submit(fn, x) for x in islice(it, n))
        while ahead:
            fut = ahead.popleft()
            ahead.extend(pool.submit(fn, x) for x in islice(it, 1))
            yield fut.result()


class SharedCalls(Generic[R]):
    """Calls of ``fn`` for a key (reads, or writes of what was queued), each shared by the calls that arrived
    before it began (module docstring)."""

    def __init__(self, wait_ahead: float = WAIT_AHEAD) -> None:
        self.wait_ahead = wait_ahead
        self._lock = threading.Lock()
        self._running: dict[Any, Future[R]] = {}  # began: answers only the calls that came before it
        self._next: dict[Any, Future[R]] = {}  # not begun: any call may join it

    def call(self, key: Any, fn: Callable[[], R]) -> R:
        """``fn()``'s result (or exception) from a call of ``key`` begun after this call arrived."""
        with self._lock:
            joined = self._next.get(key)
            if joined is None:
                ahead, mine = self._running.get(key), Future()
                (self._next if ahead is not None else self._running)[key] = mine
        if joined is not None:
            return joined.result()
        if ahead is not None:  # lead the next read, once the one running ends or has run too long
            wait((ahead,), timeout=self.wait_ahead)
            with self._lock:
                self._running[key] = self._next.pop(key)
        try:
            mine.set_result(fn())
        except BaseException as e:  # every caller of this read gets it
            mine.set_exception(e)
        finally:
            with self._lock:
                if self._running.get(key) is mine:  # not where a later read began beside a stalled one
                    del self._running[key]
        return mine.result()
