"""Upload sessions staged on a real local root, for the unit tests of the store's modules.

Each rank of a save writes one band of tensor ``model.x`` (250 float32 values) to its own data file
``r<rank>-0000.bin``; :func:`stage` opens the session and uploads the ranks' files through the session
store (as the service's routes do), :func:`put_indexes` stores their indexes. :class:`Parts` wires the
store's pieces over a storage as :class:`~ckptd.store.SessionStore` does, so a test can call one
module's class directly (a second process over the same root, with what its observers heard).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash

from ckptd.storage import Storage
from ckptd.store import SessionStore
from ckptd.store.activity import SessionActivity
from ckptd.store.commit import Committer
from ckptd.store.events import CommitEvent, Observers, SessionEvents
from ckptd.store.index_cache import IndexCache
from ckptd.store.intake import Intake
from ckptd.store.rank_indexes import BatchWriter
from support import store_index  # noqa: F401  (the tests of this package import it from here)
from ckptd.store.sweep import Sweeper
from ckptd.store.visibility import Visibility
from ckptd_schemas import CkptdError, OpenSession, RankIndex
from ckptd_schemas.filedigest import BLOCK_SIZE



def data(rank: int) -> bytes:
    """Rank ``rank``'s band: 1,000 bytes, different for every rank."""
    return bytes((i + 7 * rank) % 251 for i in range(1000))


def file_of(rank: int) -> str:
    return f"r{rank:06d}-0000.bin"


def index(rank: int, world: int, payload: bytes | None = None) -> RankIndex:
    """Rank ``rank``'s part of ``model.x`` (250 float32 per rank), in its file."""
    payload = data(rank) if payload is None else payload
    return RankIndex.model_validate({"rank": rank, "world_size": world, "files": [file_of(rank)], "tensors": [{
        "name": "model.x", "shape": [250 * world], "dtype": "float32", "group": "model", "chunks": [{
            "kind": "box", "rank": rank, "offsets": [250 * rank], "sizes": [250], "location": {
                "file": file_of(rank), "offset": 0, "length": len(payload), "raw_length": len(payload),
                "xxh3": xxhash.xxh3_64_hexdigest(payload)}}]}]})


def stage(store: SessionStore, run: str, name: str, sid: str, world: int = 1, ranks=None, step: int | None = 1,
          ) -> None:
    """Open the session and upload the files of ``ranks`` (all by default)."""
    store.open(run, name, OpenSession(session=sid, world_size=world, step=step))
    for r in range(world) if ranks is None else ranks:
        sink = store.intake.receive(run, name, sid, file_of(r))
        sink.write(data(r))
        sink.finish(xxhash.xxh3_64_hexdigest(data(r)))


def put_indexes(store: SessionStore, run: str, name: str, sid: str, world: int = 1, ranks=None) -> None:
    for r in range(world) if ranks is None else ranks:
        store.put_index(run, name, sid, index(r, world))


@dataclass
class Heard(SessionEvents):
    """What the observers were told."""

    commits: list[CommitEvent] = field(default_factory=list)
    refusals: list[tuple[str, str, str, CkptdError]] = field(default_factory=list)
    reclaims: list[list[str]] = field(default_factory=list)

    def committed(self, event: CommitEvent, seconds: float) -> None:
        self.commits.append(event)

    def refused(self, run: str, name: str, sid: str, error: CkptdError) -> None:
        self.refusals.append((run, name, sid, error))

    def reclaimed(self, keys: list[str]) -> None:
        self.reclaims.append(keys)


class Parts:
    """The store's pieces over ``storage``, wired as the session store wires them."""

    def __init__(self, storage: Storage, *, dead_after: float = 300.0, block_size: int = BLOCK_SIZE) -> None:
        self.storage = storage
        self.heard = Heard()
        self.visibility = Visibility(storage)
        self.activity = SessionActivity(storage)
        self.observers = Observers([self.heard])
        self.indexes = IndexCache()
        self.committer = Committer(storage, self.visibility, self.indexes, self.activity, self.observers,
                                   BatchWriter(storage))
        self.intake = Intake(storage, self.visibility, self.activity, block_size, self.indexes)
        self.sweeper = Sweeper(storage, self.visibility, self.activity, self.committer, self.observers, dead_after)
