"""Rank indexes kept parsed between their upload and the commit they feed.

Every index is parsed and checked when it arrives (``SessionStore.put_index``);
the commit, which starts when the last one arrives, reads all of them back
from storage. For 1,024 ranks x 500 tensors parsing them again costs most of a
second on the commit's critical path, so the parsed objects are kept here and
reused when the stored bytes are still the ones that were parsed (same XXH3).
Indexes that another replica received, or that were evicted, are parsed from
storage as before: the cache changes the commit's speed, never its result. The
commit takes each index out as it folds it into the manifest, so the two are
not both held in full.

The cache also remembers, per session, below which rank every index was found
stored (``stored_below``): ``put_index`` then probes from there for the first
missing one instead of listing every rank at every call. A hint, never a
verdict: the commit only starts after a listing shows every rank.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ckptd_schemas import RankIndex

from ckptd_schemas.filedigest import xxh3_hex

__all__ = ["IndexCache"]


PARSED_PER_RAW = 3
"""Memory of a parsed index per byte of its JSON, rounded up from the measured ratio (BENCHMARKS.md,
Figures behind the code)."""


class IndexCache:
    """A bounded map from an index's storage key to (digest of its bytes, parsed index).

    ``max_bytes`` bounds the estimated memory of the parsed indexes (``PARSED_PER_RAW`` x
    their JSON size): 512 MiB holds a 1,024 x 500 save's indexes (70 MB of JSON) with room;
    of a larger save, the last ones to arrive (the rest are parsed again at the commit).
    """

    def __init__(self, max_bytes: int = 512 << 20, max_sessions: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.max_sessions = max_sessions
        self._items: OrderedDict[str, tuple[str, RankIndex, int]] = OrderedDict()
        self._bytes = 0
        self._below: OrderedDict[str, int] = OrderedDict()  # session prefix -> ranks below it stored
        self._lock = threading.Lock()

    def put(self, key: str, raw: bytes, index: RankIndex) -> None:
        cost = PARSED_PER_RAW * len(raw)
        if cost > self.max_bytes:
            return
        entry = (xxh3_hex(raw), index, cost)
        with self._lock:
            self._drop(key)
            self._items[key] = entry
            self._bytes += cost
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def take(self, key: str, raw: bytes) -> RankIndex | None:
        """The parsed index if ``raw`` is exactly what was parsed, else None; the entry is dropped either
        way (the commit folds each index once)."""
        with self._lock:
            entry = self._items.get(key)
            self._drop(key)
        if entry is None or entry[2] != PARSED_PER_RAW * len(raw) or entry[0] != xxh3_hex(raw):
            return None
        return entry[1]

    def stored_below(self, prefix: str) -> int | None:
        """The rank below which every index of the session ``prefix`` was found stored (None: unknown)."""
        with self._lock:
            return self._below.get(prefix)

    def note_stored_below(self, prefix: str, rank: int) -> None:
        with self._lock:
            self._below[prefix] = rank
            self._below.move_to_end(prefix)
            while len(self._below) > self.max_sessions:
                self._below.popitem(last=False)

    def drop_under(self, prefix: str) -> None:
        """Forget every index stored under ``prefix`` (a session that committed or failed)."""
        with self._lock:
            for key in [k for k in self._items if k.startswith(prefix)]:
                self._drop(key)
            for key in [k for k in self._below if k.startswith(prefix)]:
                del self._below[key]

    def _drop(self, key: str) -> None:
        entry = self._items.pop(key, None)
        if entry is not None:
            self._bytes -= entry[2]
