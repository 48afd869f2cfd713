"""Rank indexes, and the records of their files, kept from their making to the commit they feed.

A file received here (``Intake.receive``) leaves its digest record and arrival record here as they were
created in the store; every index is parsed and checked when it arrives (``SessionStore.put_index``),
against its files' records (these, else read from the store), and kept with them; the commit starts when
the last one arrives. Kept here, the commit folds each rank's index with its files' records without
reading any of them back: 1,024 ranks x 500 tensors take most of a second to parse again, and on an
object store each rank costs three GETs (index, digest record, arrival record) at the commit and two
more at its index's check, so the time from the last byte to the marker would grow with the world size
(BENCHMARKS.md, Commit lag).

What is kept is what this process checked or created for one incarnation of the session (its record's
``created_at``): a session opened again under the same id, after an abort, never meets an entry of
the one before. A record is kept only where this process created it, so it is the stored one (records
are created once, never replaced). Ranks another replica received, or entries evicted, are read from
the store as before: the cache changes the commit's speed, not what it checks (its data files are
still confirmed by their stored identity or read). Each entry is taken out as it is used (a file's
records into its rank's index, an index into the manifest), so no two copies are held in full.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ckptd_schemas import FileEntry, RankIndex

__all__ = ["Checked", "IndexCache", "Records"]

PARSED_PER_RAW = 3
"""Memory of a parsed index per byte of its JSON, rounded up from the measured ratio (BENCHMARKS.md,
Figures behind the code)."""
RECORD_BYTES = 512  # a file's digest and arrival records, parsed, besides their block digests
BLOCK_BYTES = 80  # one block digest, parsed

#: A file's digest record and arrival record (rows digest, stamp; None: none).
Records = tuple[FileEntry, "tuple[str, str] | None"]
#: A rank's index as checked, and each of its files' records.
Checked = tuple[RankIndex, dict[str, Records]]


class IndexCache:
    """A bounded map from a storage key (a rank index's, or a file's digest record's) to (the session's
    incarnation, what was checked or created there). ``max_bytes`` bounds the estimated memory
    (``PARSED_PER_RAW`` x an index's JSON size, and files' records): 512 MiB holds a 1,024 x 500 save's
    indexes (70 MB of JSON) with room; of a larger save, the last ones to arrive (the rest are read
    again at the commit).
    """

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[str, object, int]] = OrderedDict()
        self._bytes = 0
        self._stored: set[str] = set()  # kept rank indexes whose write was answered
        self._lock = threading.Lock()

    def put(self, key: str, incarnation: str, checked: Checked, raw_bytes: int) -> None:
        """Keep rank index ``key`` as ``put_index`` checked it (``raw_bytes``: its JSON's size)."""
        self._put(key, incarnation, checked, PARSED_PER_RAW * raw_bytes + sum(_cost(r) for r in checked[1].values()))

    def take(self, key: str, incarnation: str) -> Checked | None:
        """What was checked of rank index ``key`` for this incarnation of its session, else None; the
        entry is dropped either way (the commit folds each index once)."""
        return self._take(key, incarnation)  # type: ignore[return-value]

    def peek(self, key: str, incarnation: str) -> Checked | None:
        """What :meth:`take` would give, kept (an index sent again the same needs no second write)."""
        with self._lock:
            entry = self._items.get(key)
        return entry[1] if entry is not None and entry[0] == incarnation else None  # type: ignore[return-value]

    def put_records(self, key: str, incarnation: str, records: Records) -> None:
        """Keep the records of the file whose digest record is at ``key``, as this process created them."""
        self._put(key, incarnation, records, _cost(records))

    def take_records(self, key: str, incarnation: str) -> Records | None:
        """The records kept for the digest record at ``key`` in this incarnation, else None; dropped either way."""
        return self._take(key, incarnation)  # type: ignore[return-value]

    def _put(self, key: str, incarnation: str, value: object, cost: int) -> None:
        if cost > self.max_bytes:
            return
        with self._lock:
            self._drop(key)
            self._items[key] = (incarnation, value, cost)
            self._bytes += cost
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def _take(self, key: str, incarnation: str) -> object | None:
        with self._lock:
            entry = self._items.get(key)
            self._drop(key)
        return entry[1] if entry is not None and entry[0] == incarnation else None

    def note_stored(self, key: str) -> None:
        """Rank index ``key``, kept, is stored (its write was answered)."""
        with self._lock:
            self._stored.add(key)

    def state(self, key: str) -> str | None:
        """``"pending"`` (rank index ``key`` was checked here and is kept, its write not answered yet),
        ``"stored"``, or None (not kept here): the looks of :mod:`.completeness` need no HEAD for a rank
        kept here, and the commit reads none."""
        with self._lock:
            return None if key not in self._items else "stored" if key in self._stored else "pending"

    def drop_under(self, prefix: str) -> None:
        """Forget every entry kept under ``prefix`` (a session that committed or failed)."""
        with self._lock:
            for key in [k for k in self._items if k.startswith(prefix)]:
                self._drop(key)

    def _drop(self, key: str) -> None:
        self._stored.discard(key)
        entry = self._items.pop(key, None)
        if entry is not None:
            self._bytes -= entry[2]


def _cost(records: Records) -> int:
    return RECORD_BYTES + BLOCK_BYTES * len(records[0].blocks)
