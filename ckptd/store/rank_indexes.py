"""A session's stored rank indexes: one form, written here and read here (docs/design.md §2 item 3).

Each rank's index, checked against its files' records (``SessionStore.put_index``), is stored before
its call is answered. Indexes arriving together at a replica are stored together: one write per
window of ranks of a session runs at a time here, and the indexes that arrive while it runs wait for
the next one (a group commit, :class:`~.inflight.SharedCalls`), which stores all of them in one object
(:data:`BATCH_BYTES` of indexes at most; more make more objects). One object per rank put 49 of
64 PUTs between the last byte and the marker of a save on S3 (BENCHMARKS.md, Commit lag), and at
10,000 ranks it would be 10,000 requests, past an object store's rate for one prefix.

An object holds its ranks' indexes with their files' records as checked here, and the session's
incarnation (its record's ``created_at``): the commit at another replica reads one object for its ranks
instead of an index, a digest record and an arrival record per rank. Its name says what it holds
(:meth:`Paths.rank_batch`, :func:`~.paths.rank_batch`): its window (:data:`RankBatch.WINDOW` ranks),
when it was written (the writer's clock in ms, never twice the same here), a nonce, the incarnation's
tag and the set of its ranks. So, without reading an object:

* a listing of one window says which of its ranks are stored (:func:`in_window`: the probe of a look
  at the session, :mod:`.completeness`);
* a walk of ``ranks/`` says every rank stored, and in which object (:func:`stored`: the listing that
  decides the session is complete; the commit's map of what to read);
* only names of this incarnation count: a session aborted and opened again under its id never meets
  the objects of the one before;
* a rank in several objects (its index sent again) is the one in the latest (by stamp, then name): the
  index sent last is the one committed.

Call order: ``put_index`` keeps the checked index (``IndexCache.put``), then :meth:`BatchWriter.store`
returns once an object holding it is stored; the commit takes the indexes kept here and reads the
objects holding the others (:func:`read_batch`); an index sent again after the marker is compared with
the committed one (:func:`stored_index`). An object that does not parse, is of another incarnation or
does not hold the ranks its name says is refused at the commit (``InvalidIndex``, naming it), as an
index edited in the root always was; so is one larger than any written here (:data:`MAX_OBJECT_BYTES`),
without reading more of it than that.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

from pydantic import BaseModel, TypeAdapter, ValidationError

from ckptd_schemas import InvalidIndex, RankIndex, StorageError
from ckptd_schemas.filedigest import xxh3_hex

from ..storage import Storage
from .index_cache import Checked, Records
from .inflight import SharedCalls, ordered_map, requests_in_flight
from .paths import Paths, RankBatch, rank_batch, read_small

__all__ = ["BATCH_BYTES", "MAX_OBJECT_BYTES", "BatchWriter", "in_window", "kept_key", "ranks_done", "read_batch",
           "stored", "stored_index"]

log = logging.getLogger("ckptd.store")

BATCH_BYTES = 16 << 20
"""The most bytes of indexes (their JSON, with their files' records) one object holds; one index larger
is stored alone."""
MAX_OBJECT_BYTES = 256 << 20
"""The largest object of rank indexes written or read here (an index of ``CKPTD_MAX_INDEX_BYTES``, 64 MiB
by default, with its records fits): a commit reads no more of one (:func:`~.paths.read_small`), so one
planted larger in the root, or a FIFO, is refused as found, never read whole; an index whose object would
be larger is refused when sent (``InvalidIndex`` naming its rank)."""


class _Rank(BaseModel):
    index: RankIndex
    files: dict[str, Records]


class _Batch(BaseModel):
    incarnation: str
    ranks: list[_Rank]


def kept_key(run: str, name: str, sid: str, rank: int) -> str:
    """The key rank ``rank``'s index is kept under here (``IndexCache``); no object is stored there."""
    return f"{Paths.ranks(run, name, sid)}/{rank:07d}"


def _tag(incarnation: str) -> str:
    return xxh3_hex(incarnation.encode())[:8]


_FILES: TypeAdapter[dict[str, Records]] = TypeAdapter(dict[str, Records])


class _Pending:
    __slots__ = ("rank", "json", "done")

    def __init__(self, rank: int, raw: bytes, records: dict[str, Records]) -> None:
        # a _Rank's JSON, with the index's as it was made for its charge: not made again
        self.rank, self.done = rank, Future()
        self.json = b'{"index":' + raw + b',"files":' + _FILES.dump_json(records) + b"}"


class BatchWriter:
    """Stores the rank indexes of this process, those arriving together in one object (module docstring)."""

    def __init__(self, storage: Storage, max_sessions: int = 256) -> None:
        self.storage = storage
        self._writes: SharedCalls[None] = SharedCalls()
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str, str, str, int], dict[int, _Pending]] = {}
        self._last_stamp = 0
        # per session until it commits or fails (:meth:`forget`; the last max_sessions written to), the object
        # written here holding each rank's index sent last, and the ranks each such object still holds so
        self.max_sessions = max_sessions
        self._written: OrderedDict[tuple[str, str, str, str], tuple[dict[int, str], dict[str, set[int]]]] = OrderedDict()

    def store(self, run: str, name: str, sid: str, incarnation: str, rank: int, raw: bytes,
              records: dict[str, Records]) -> None:
        """Store rank ``rank``'s index (``raw``: its JSON), checked, with its files' ``records``; return once
        an object holding it is stored, or raise why not."""
        group = (run, name, sid, incarnation, rank // RankBatch.WINDOW)
        mine = _Pending(rank, raw, records)
        if len(mine.json) > MAX_OBJECT_BYTES:
            raise InvalidIndex(f"rank {rank}: its index with its files' records takes {len(mine.json)} bytes, "
                               f"more than an object of rank indexes holds ({MAX_OBJECT_BYTES})", rank=rank)
        with self._lock:
            before = self._pending.setdefault(group, {}).get(rank)
            self._pending[group][rank] = mine
        if before is not None:  # sent again before its write: answered with the index that replaced it
            mine.done.add_done_callback(lambda f: _follow(before.done, f))
        self._writes.call(group, lambda: self._write(group))  # begun after mine came: it, or one running, takes it
        mine.done.result()

    def _write(self, group: tuple[str, str, str, str, int]) -> None:
        with self._lock:
            taken = self._pending.pop(group, {})
        run, name, sid, incarnation, window = group
        batches: list[list[_Pending]] = []
        size = BATCH_BYTES
        for rank in sorted(taken):
            if size + len(taken[rank].json) > BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(taken[rank])
            size += len(taken[rank].json)

        def put(batch: list[_Pending]) -> None:
            try:
                body = b'{"incarnation":' + json.dumps(incarnation).encode() + b',"ranks":[' + \
                    b",".join(p.json for p in batch) + b"]}"
                key = Paths.rank_batch(run, name, sid, RankBatch(
                    window, self._stamp(), secrets.token_hex(4), _tag(incarnation), tuple(p.rank for p in batch)))
                self.storage.put(key, body)
            except BaseException as e:
                for p in batch:
                    p.done.set_exception(e)
                return
            for p in batch:
                p.done.set_result(None)
            self._drop_replaced((run, name, sid, incarnation), key, [p.rank for p in batch])

        for _ in ordered_map(put, batches, requests_in_flight(self.storage, Paths.ranks(run, name, sid))):
            pass

    def _drop_replaced(self, session: tuple[str, str, str, str], key: str, ranks: list[int]) -> None:
        """``key`` now holds ``ranks``' indexes: delete each object written here before whose ranks all
        went to later ones, so an index sent again and again keeps one object here, not one per sending
        (the root's reserve takes indexes: one per rank). A commit that listed the object before it was
        replaced and reads it now meets a storage error and the session stays open for the retry. Best
        effort: one left behind is a copy nobody reads (a rank's latest object is the one read)."""
        with self._lock:
            if session not in self._written:
                self._written[session] = ({}, {})
                while len(self._written) > self.max_sessions:
                    self._written.popitem(last=False)
            self._written.move_to_end(session)
            holder, holds = self._written[session]
            replaced = []
            for r in ranks:
                before = holder.get(r)
                holder[r] = key
                if before is not None and before != key:
                    holds[before].discard(r)
                    if not holds[before]:
                        del holds[before]
                        replaced.append(before)
            holds[key] = set(ranks)
        for old in replaced:
            try:
                self.storage.delete(old)
            except StorageError as e:
                log.warning("%s: holds no index sent last, and was not deleted: %s", old, e.message)

    def forget(self, run: str, name: str, sid: str) -> None:
        """A session that committed or failed: what was written here for it is no longer replaced."""
        with self._lock:
            for session in [s for s in self._written if s[:3] == (run, name, sid)]:
                del self._written[session]

    def _stamp(self) -> int:
        with self._lock:  # the writer's clock in ms, never twice the same here: sent last is written last
            self._last_stamp = max(self._last_stamp + 1, time.time_ns() // 1_000_000)
            return self._last_stamp


def _follow(target: Future, source: Future) -> None:
    e = source.exception()
    target.set_exception(e) if e is not None else target.set_result(None)


def _latest(run: str, name: str, sid: str, incarnation: str, rels: list[str]) -> dict[int, str]:
    tag, best = _tag(incarnation), {}  # type: dict[int, tuple[int, str]]  # rank: (stamp, name) of the latest
    for rel in rels:
        b = rank_batch(rel)
        if b is None or b.tag != tag:
            continue
        for r in b.ranks:
            if r not in best or (b.stamp, rel) > best[r]:
                best[r] = (b.stamp, rel)
    base = Paths.ranks(run, name, sid)
    return {r: f"{base}/{rel}" for r, (_, rel) in best.items()}


def stored(storage: Storage, run: str, name: str, sid: str, incarnation: str) -> dict[int, str]:
    """Every rank whose index this incarnation of session ``sid`` holds, and the key of the object that
    holds it last (one walk of ``ranks/``: a request per 1,000 objects on an object store)."""
    base = Paths.ranks(run, name, sid) + "/"
    rels = [key[len(base):] for key, _ in storage.walk(Paths.ranks(run, name, sid))]
    return _latest(run, name, sid, incarnation, rels)


def ranks_done(storage: Storage, run: str, name: str, sid: str, incarnation: str) -> list[int]:
    """The ranks whose index this incarnation of session ``sid`` holds, listed."""
    return sorted(stored(storage, run, name, sid, incarnation))


def in_window(storage: Storage, run: str, name: str, sid: str, incarnation: str, rank: int) -> dict[int, str]:
    """The ranks of ``rank``'s window whose index is stored, as :func:`stored` (one listing)."""
    window = rank // RankBatch.WINDOW
    rels = [f"{window:05d}/{n}" for n in storage.list(Paths.rank_window(run, name, sid, window))]
    return _latest(run, name, sid, incarnation, rels)


def read_batch(storage: Storage, key: str, incarnation: str) -> dict[int, Checked]:
    """The indexes and files' records in the object at ``key``, by rank; ``InvalidIndex`` naming it where
    it is not what its name says (``StorageError`` where it cannot be read)."""
    b = rank_batch("/".join(key.rsplit("/", 2)[-2:]))
    raw, why = read_small(storage, key, MAX_OBJECT_BYTES)  # one GET on an object store; never a huge one whole
    if why is not None:
        raise InvalidIndex(f"rank indexes {key}: {why}, not an object of rank indexes written by ckptd")
    if raw is None:
        raise StorageError(f"rank indexes {key}: no longer stored", key=key)
    try:
        batch = _Batch.model_validate_json(raw)
    except ValidationError as e:
        raise InvalidIndex(f"rank indexes {key}: not readable ({e.error_count()} errors)") from None
    ranks = [r.index.rank for r in batch.ranks]
    if b is None or batch.incarnation != incarnation or tuple(ranks) != b.ranks:
        raise InvalidIndex(f"rank indexes {key}: not those of ranks {b.ranks if b else '?'} of this session")
    for r in batch.ranks:
        for f in r.index.files:
            if f not in r.files:
                raise InvalidIndex(f"rank {r.index.rank}: file {f!r} has no verified upload ({key} holds no "
                                   f"record of it)", rank=r.index.rank, file=f)
    return {r.index.rank: (r.index, r.files) for r in batch.ranks}


def stored_index(storage: Storage, run: str, name: str, sid: str, incarnation: str, rank: int) -> RankIndex | None:
    """Rank ``rank``'s index as stored last, or None (not stored, or an object that cannot serve)."""
    key = in_window(storage, run, name, sid, incarnation, rank).get(rank)
    if key is None:
        return None
    try:
        return read_batch(storage, key, incarnation)[rank][0]
    except InvalidIndex:
        return None
