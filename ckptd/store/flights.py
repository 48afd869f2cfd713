"""One caller per key at a time: the others wait for it, then find what it left.

Concurrent requests for the same expensive thing (the first look at a checkpoint, the commit of a
session whose last indexes arrive together) each do it once for all: the first runs the body, the
others wait on the same lock and, once in, find the result in the caller's cache or store instead
of computing it again. Keys are dropped when their last caller leaves, so the map holds only keys
in use.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Hashable, Iterator

__all__ = ["OneAtATime"]


class OneAtATime:
    """``with flights(key):`` runs its body for one caller per ``key`` at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Hashable, list] = {}  # key -> [lock, callers]

    @contextlib.contextmanager
    def __call__(self, key: Hashable) -> Iterator[None]:
        with self._lock:
            entry = self._flights.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._lock:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._flights[key]
