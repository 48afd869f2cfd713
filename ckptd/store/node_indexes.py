"""A node's rank indexes as one object, for the commit at another replica (the node-local form).

Where every training node saves through its own replica (``deploy/k8s/node-local/``), the replica
that stores the last index commits, and every other rank's index and its files' records are in the
store alone: a read for each index and two for each file (digest record, arrival record), 30,000 at
10,000 ranks of one file each, all between the last byte and the marker. With ``CKPTD_NODE_RANKS`` = N
(the ranks of one node), a replica that has checked the indexes of all N ranks of a node (ranks
``[k*N, (k+1)*N)``, as torchrun numbers them) stores them with their files' records as they were
checked (:class:`~.index_cache.IndexCache`), in one object, before the last of them: the commit reads
one object a node instead of those three reads a rank.

Call order: ``SessionStore.put_index`` keeps the rank's index checked (``IndexCache.put``), then
:func:`store_node` (stores the node's object when every rank of it is kept here, else nothing), then
the index. Whenever every index of a node is stored, its object is too, if one replica checked them
all: the two last ranks of a node, arriving together, each keep theirs before they look for the
other. :meth:`.commit.Committer.merged` lists the session's node objects once (:func:`node_objects`)
where some rank is not kept here, and reads each needed one (:func:`read_node`). A look at the session
that finds a rank's index stored asks whether its node's object is (:func:`stored_node`): one HEAD that
answers for the node's ranks, where the other replica's ranks would cost one each.

A node object is a copy of what the store holds besides it, made by the replica that checked it: it
changes how many reads the commit makes, not what it checks. The commit folds its indexes and
confirms their files (stored identity or read back) as for indexes read one by one; an object that is
unreadable, of another incarnation of the session, or short of a rank is passed over, and those ranks
are read one by one.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel, ValidationError

from ckptd_schemas import FileEntry, RankIndex, StorageError

from ..storage import Storage
from .index_cache import Checked, IndexCache
from .paths import Paths, node_span

__all__ = ["node_objects", "read_node", "store_node", "stored_node"]

log = logging.getLogger("ckptd.store")


class _Rank(BaseModel):
    index: RankIndex
    files: dict[str, tuple[FileEntry, tuple[str, str] | None]]


class _Node(BaseModel):
    incarnation: str  # the session record's created_at: an object of the session before is passed over
    ranks: list[_Rank]


def store_node(storage: Storage, kept: IndexCache, run: str, name: str, sid: str, incarnation: str,
               rank: int, world_size: int, node_ranks: int) -> None:
    """Store the object of ``rank``'s node when every rank of it is kept here."""
    ranks = _node(rank, world_size, node_ranks)
    checked = [kept.peek(Paths.rank_index(run, name, sid, r), incarnation) for r in ranks]
    if len(ranks) > 1 and all(c is not None for c in checked):
        body = _Node(incarnation=incarnation, ranks=[_Rank(index=ix, files=files) for ix, files in checked])
        storage.put(Paths.node_indexes(run, name, sid, ranks[0], ranks[-1]), body.model_dump_json().encode())


def stored_node(storage: Storage, run: str, name: str, sid: str, rank: int, world_size: int, node_ranks: int
                ) -> range:
    """The ranks of ``rank``'s node where its object is stored (one HEAD), else an empty range: a hint
    for a look at the session (:mod:`.completeness`) that those ranks' indexes are stored, or about to
    be (the object is stored before the last of them). No request without node objects (``node_ranks`` < 2)."""
    ranks = _node(rank, world_size, node_ranks) if node_ranks > 1 else range(0)
    if len(ranks) > 1 and storage.exists(Paths.node_indexes(run, name, sid, ranks[0], ranks[-1])):
        return ranks
    return range(0)


def _node(rank: int, world_size: int, node_ranks: int) -> range:
    first = rank - rank % node_ranks
    return range(first, min(first + node_ranks, world_size))


def node_objects(storage: Storage, run: str, name: str, sid: str) -> list[tuple[int, int]]:
    """The (first, last) ranks of each node object stored in the session (one listing)."""
    spans = (node_span(key.rsplit("/", 1)[-1]) for key in storage.list(Paths.node_indexes_dir(run, name, sid)))
    return sorted(s for s in spans if s is not None)


def read_node(storage: Storage, run: str, name: str, sid: str, incarnation: str, first: int, last: int
              ) -> dict[int, Checked]:
    """The ranks' indexes and records in node object ``(first, last)``, by rank; {} where it cannot serve."""
    key = Paths.node_indexes(run, name, sid, first, last)
    try:
        node = _Node.model_validate_json(storage.read(key))
    except (StorageError, ValidationError) as e:
        log.warning("%s: not read (%s); its ranks are read one by one", key, e)
        return {}
    if node.incarnation != incarnation:
        return {}
    return {r.index.rank: (r.index, r.files) for r in node.ranks
            if first <= r.index.rank <= last and set(r.index.files) <= r.files.keys()}
