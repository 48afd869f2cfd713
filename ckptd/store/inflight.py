"""How many requests the store layer keeps in flight against a storage, and an ordered map that keeps them.

One rule: on a local root a read or a ``stat`` costs microseconds, so one at a time; on a remote
store (no local path: S3, a network filesystem through fsspec) each costs a round trip, so
:data:`REMOTE_REQUESTS` at a time. A commit of a thousand ranks reads a thousand indexes, a digest
record and two stamps per file: one by one on S3 that is minutes of round trips (BENCHMARKS.md,
Figures behind the code).

Call order: ``n = requests_in_flight(storage, key)`` with any key of the objects to be read, then
``for result in ordered_map(fn, items, n)``: the results come in the items' order, at most ``n``
calls run at once and at most ``n`` results wait ahead of the consumer (memory stays bounded
however many items there are).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import TypeVar

from ..storage import Storage

__all__ = ["REMOTE_REQUESTS", "is_remote", "ordered_map", "requests_in_flight"]

REMOTE_REQUESTS = 16

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
