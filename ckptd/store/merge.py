"""Merge the ranks' indexes into one validated manifest (pure, no I/O).

Called once every expected rank has finished. :class:`ManifestFold` takes the
indexes one at a time, in rank order, and appends each one's chunk rows to the
manifest's per-tensor columns (``ckptd_schemas.chunktable``), so the commit
holds the growing manifest and one parsed index, never all of them
(the commit, :class:`~.commit.Committer`, reads, folds and drops them rank by rank);
:func:`merge_indexes` is the same fold over indexes already in memory.

The result is deterministic (sorted, timestamps taken from the session), so two
replicas committing the same session concurrently write byte-identical
manifests. The first problem is reported as if every index had been read before
any check: a missing rank, then a mesh that differs, a file claimed twice,
tensors (per rank as read, then per tensor: bounds and tiling), param groups.
"""

from __future__ import annotations

from collections import defaultdict, deque
from operator import itemgetter, le, lt
from datetime import datetime
from typing import Sequence

from pydantic import ValidationError

from ckptd_schemas import (
    ChunkColumns, CkptdError, FileEntry, InvalidIndex, Manifest, ObjectEntry, ParamGroup, RankIndex, RankInfo,
    TensorColumns, TensorEntry, Topology, itemsize,
)
from ckptd_schemas.chunktable import check_columns, check_columns_tiling

__all__ = ["ManifestFold", "merge_indexes"]

_COLS = ("rank", "flat", "offsets", "sizes", "file", "offset", "length", "codec", "xxh3")


def merge_indexes(
    *,
    run: str,
    name: str,
    session: str,
    step: int | None,
    created_at: datetime,
    world_size: int,
    indexes: Sequence[RankIndex],
    files: dict[str, FileEntry],
    derived_from: str | None = None,
    parent: str | None = None,
) -> Manifest:
    """Validate and merge; raise a typed error naming the tensor and ranks at fault. An index given
    twice for one rank counts once (the last one given)."""
    by_rank = {ix.rank: ix for ix in indexes}
    missing = sorted(set(range(world_size)) - set(by_rank))
    if missing:
        raise InvalidIndex(f"{run}/{name}: no index from ranks {missing[:16]}", ranks=missing[:64])
    fold = ManifestFold(run=run, name=name, session=session, step=step, created_at=created_at,
                        world_size=world_size, derived_from=derived_from, parent=parent)
    for r in range(world_size):
        fold.add(by_rank[r])
    return fold.manifest(files)


class ManifestFold:
    """The merge, one index at a time: ``add`` each rank's index in rank order (0, 1, ...), then
    ``manifest(files)`` once.

    ``add`` keeps from an index only what the manifest holds (its chunk rows, appended to
    per-tensor columns; its coordinates, objects, param groups, files) and records the first
    problem of each kind instead of raising, so that ``manifest`` raises the one a merge of
    all indexes at once reports (see the module's docstring). After a problem, rows are no
    longer kept.
    """

    def __init__(self, *, run: str, name: str, session: str, step: int | None, created_at: datetime,
                 world_size: int, derived_from: str | None = None, parent: str | None = None) -> None:
        self._head = dict(run=run, name=name, step=step, session=session, created_at=created_at,
                          derived_from=derived_from, parent=parent)
        self.run, self.name, self.world_size = run, name, world_size
        self._next = 0
        self._missing: list[int] = []
        self._errors: dict[str, CkptdError] = {}  # kind -> first problem: "mesh", "owner", "tensor", "group"
        self._mesh: dict[str, int] | None = None
        self._owners: dict[str, int] = {}
        self._rank_infos: list[RankInfo] = []
        self._layouts: dict[str, str] = {}
        self._groups: dict[tuple[str, int], tuple[int, ParamGroup]] = {}
        self._global_objects: dict[str, ObjectEntry] = {}
        self._rank_objects: dict[str, list[ObjectEntry]] = defaultdict(list)
        self._tensors = _TensorColumns()

    def add(self, ix: RankIndex) -> None:
        """Fold the index of the next rank; an index for another rank than the next counts that one as
        missing (``manifest`` refuses it) and is not folded."""
        r = self._next
        self._next += 1
        if ix.rank != r:
            self._missing.append(r)
            return
        self._check_mesh(ix)
        self._claim_files(ix)
        if not self._errors.keys() & {"mesh", "owner", "tensor"}:
            try:
                self._tensors.add(ix, self._owners)
            except InvalidIndex as e:
                self._errors["tensor"] = e
                self._tensors.drop()
        if not self._errors:
            self._fold_groups(ix)
        self._rank_infos.append(RankInfo(rank=r, coords=ix.coords))
        for k, v in ix.layouts.items():
            self._layouts.setdefault(k, v)
        self._fold_objects(ix)

    def manifest(self, files: dict[str, FileEntry]) -> Manifest:
        """The merged manifest (``files``: the digest record of every file the indexes name), or the
        first problem found, as a typed error."""
        missing = self._missing + list(range(self._next, self.world_size))
        if missing:
            raise InvalidIndex(f"{self.run}/{self.name}: no index from ranks {missing[:16]}", ranks=missing[:64])
        for kind in ("mesh", "owner", "tensor"):
            if kind in self._errors:
                raise self._errors[kind]
        tensors = self._tensors.entries()
        if "group" in self._errors:
            raise self._errors["group"]
        try:
            topology = Topology(world_size=self.world_size, mesh=self._mesh or {}, ranks=self._rank_infos,
                                layouts=self._layouts)
            return Manifest(
                **self._head, topology=topology, tensors=tensors, objects=self._objects(),
                param_groups=[self._groups[k][1] for k in sorted(self._groups)],
                files={f: files[f] for f in sorted(self._owners)},
            )
        except ValidationError as e:
            raise InvalidIndex(f"{self.run}/{self.name}: merged manifest is invalid: {e.errors()[0]['msg']}") from e

    def _check_mesh(self, ix: RankIndex) -> None:
        if self._mesh is None:
            self._mesh = ix.mesh
        elif ix.mesh != self._mesh and "mesh" not in self._errors:
            self._errors["mesh"] = InvalidIndex(
                f"{self.run}/{self.name}: rank {ix.rank} reports mesh {ix.mesh}, rank 0 reports {self._mesh}",
                ranks=[0, ix.rank])

    def _claim_files(self, ix: RankIndex) -> None:
        owners = self._owners
        for f in ix.files:
            if f not in owners:
                owners[f] = ix.rank
            elif "owner" not in self._errors:
                self._errors["owner"] = InvalidIndex(
                    f"{self.run}/{self.name}: file {f!r} claimed by ranks {owners[f]} and {ix.rank}",
                    file=f, ranks=[owners[f], ix.rank])

    def _fold_groups(self, ix: RankIndex) -> None:
        """One description per (optimizer, group index). Ranks that hold different parameters of one
        group (pipeline stages) describe it with the union of their parameters, in rank order; the
        hyper-parameters must agree."""
        for g in ix.param_groups:
            key = (g.optimizer, g.index)
            prev = self._groups.get(key)
            if prev is None:
                self._groups[key] = (ix.rank, g)
            elif prev[1].hyperparams != g.hyperparams:
                self._errors["group"] = InvalidIndex(
                    f"{self.run}/{self.name}: param group {g.index} of {g.optimizer!r} has different hyper-parameters "
                    f"on ranks {prev[0]} and {ix.rank}", ranks=[prev[0], ix.rank])
                return
            elif prev[1].params != g.params:
                have = set(prev[1].params)
                params = prev[1].params + [p for p in g.params if p not in have]
                self._groups[key] = (prev[0], prev[1].model_copy(update={"params": params}))

    def _fold_objects(self, ix: RankIndex) -> None:
        for o in ix.objects:
            if o.rank is None:
                self._global_objects.setdefault(o.name, o)
            else:
                self._rank_objects[o.name].append(o.model_copy(update={"rank": ix.rank}))

    def _objects(self) -> list[ObjectEntry]:
        """Objects a rank sends with ``rank=None`` are global (kept once). Per-rank objects that
        every rank saved with identical content become one global entry; others stay per rank."""
        out: list[ObjectEntry] = list(self._global_objects.values())
        for oname, entries in self._rank_objects.items():
            if oname in self._global_objects:
                continue
            same = len({_object_identity(o) for o in entries}) == 1
            if same and len(entries) == self.world_size:
                out.append(entries[0].model_copy(update={"rank": None}))
            else:
                out.extend(entries)
        return sorted(out, key=lambda o: (o.name, -1 if o.rank is None else o.rank))


def _object_identity(o: ObjectEntry) -> tuple:
    return (o.encoding, repr(o.value)) if o.location is None else (o.encoding, o.location.xxh3)


class _TensorColumns:
    """The tensors of the manifest being merged: per tensor (numbered in order of first appearance,
    rank by rank), its description and one list per chunk column.

    ``add`` appends a rank's rows with whole-column C-speed passes (``itemgetter`` gathers of the
    destination lists, ``map(list.append, ...)``), not a Python loop per chunk (the merge's cost per chunk:
    BENCHMARKS.md, Figures behind the code). Rows keep
    rank order, and within a rank their index's order; ``entries`` sorts each tensor's rows by
    (rank, flat, offsets), which they usually already are.
    """

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.first: list[tuple[int, str, str, str | None]] = []  # tensor id -> (rank, name, group, placement)
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[str] = []
        self.digests: list[str | None] = []  # first declared
        self.cols: dict[str, list[list]] = {k: [] for k in _COLS}  # column -> tensor id -> rows
        self._tuples: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._names: list[str] = []  # the last rank's tensor names, and their tensor ids
        self._tids: list[int] = []

    def drop(self) -> None:
        """Forget the rows: a problem was found, no manifest will be built."""
        self.cols = {k: [[] for _ in v] for k, v in self.cols.items()}

    def add(self, ix: RankIndex, owners: dict[str, int]) -> None:
        """Check the rank's tensors against those seen before and append its rows; raise
        ``InvalidIndex`` on a shape, dtype or digest that differs, or a row in a file the rank did
        not upload."""
        r, tt, ct = ix.rank, ix.tensor_table, ix.chunk_table
        tids = self._tensor_ids(r, tt)
        self._check_like_first(r, tt, tids)
        n = len(ct)
        if not n:
            return
        stray = set(ct.file) - {f for f in ix.files if owners.get(f) == r}
        if stray:
            f = sorted(stray)[0]
            tname = tt.name[ct.tensor[ct.file.index(f)]]  # type: ignore[index]
            raise InvalidIndex(f"tensor {tname!r}: rank {r} points at file {f!r}, which it did not upload",
                               tensor=tname, ranks=[r], file=f)
        rows = _gather(ct.tensor, tids)  # type: ignore[arg-type]
        shared = self._tuples.setdefault  # equal offsets and sizes as one tuple: row bands take 45% less memory
        values = {"rank": [r] * n, "flat": ct.flat or [False] * n, "codec": ct.codec or ["raw"] * n,
                  "offsets": list(map(shared, ct.offsets, ct.offsets)), "sizes": list(map(shared, ct.sizes, ct.sizes))}
        for k in _COLS:
            col = values[k] if k in values else getattr(ct, k)
            deque(map(list.append, _gather(rows, self.cols[k]), col), maxlen=0)

    def _tensor_ids(self, r: int, tt: TensorColumns) -> list[int]:
        """The tensor id of each of the rank's tensors, registering the new ones."""
        if tt.name == self._names:  # usually every rank lists the same tensors in the same order
            return self._tids
        self._names, self._tids = tt.name, []
        for p, tname in enumerate(tt.name):
            tid = self.ids.setdefault(tname, len(self.ids))
            if tid == len(self.first):
                self.first.append((r, tname, tt.group[p], tt.placement[p] if tt.placement else None))
                self.shapes.append(tt.shape[p])
                self.dtypes.append(tt.dtype[p])
                self.digests.append(None)
                for lists in self.cols.values():
                    lists.append([])
            self._tids.append(tid)
        return self._tids

    def _check_like_first(self, r: int, tt: TensorColumns, tids: list[int]) -> None:
        """Shapes and dtypes as the first rank that saved each tensor; one declared digest per tensor."""
        shapes, dtypes, digests = self.shapes, self.dtypes, self.digests
        if _gather(tids, shapes) != tt.shape or _gather(tids, dtypes) != tt.dtype:
            q = next(q for q, t in enumerate(tids) if shapes[t] != tt.shape[q] or dtypes[t] != tt.dtype[q])
            r0 = self.first[tids[q]][0]
            raise InvalidIndex(f"tensor {tt.name[q]!r}: rank {r0} saved shape {list(shapes[tids[q]])} "
                               f"{dtypes[tids[q]]}, rank {r} saved shape {list(tt.shape[q])} {tt.dtype[q]}",
                               tensor=tt.name[q], ranks=[r0, r])
        for q, (tid, d) in enumerate(zip(tids, tt.digest or ())):
            if d is not None and digests[tid] is None:
                digests[tid] = d
            elif d is not None and d != digests[tid]:
                r0 = self.first[tid][0]
                raise InvalidIndex(f"tensor {tt.name[q]!r}: ranks {r0} and {r} declare different digests",
                                   tensor=tt.name[q], ranks=[r0, r])

    def entries(self) -> list[TensorEntry]:
        """One checked entry per tensor (bounds, stored lengths, tiling), in tensor id order; each
        tensor's lists become its table (no copy unless its rows need sorting)."""
        out = []
        for tid, (_, tname, group, placement) in enumerate(self.first):
            table = {k: lists[tid] for k, lists in self.cols.items()}
            for lists in self.cols.values():
                lists[tid] = None  # the table owns them now
            out.append(self._entry(tid, tname, group, placement, table))
        self._tuples = {}
        return out

    def _entry(self, tid: int, tname: str, group: str, placement: str | None, table: dict) -> TensorEntry:
        shape, dtype = self.shapes[tid], self.dtypes[tid]
        order = _order(table["rank"], table["flat"], table["offsets"])
        if order is not None:
            table = {k: _gather(order, v) for k, v in table.items()}
        n = len(table["xxh3"])
        if not any(table["flat"]):
            table["flat"] = None
        if table["codec"].count("raw") == n:
            table["codec"] = None
        chunks = ChunkColumns.model_construct(tensor=None, **table)
        try:
            dims = check_columns(tname, shape, dtype, itemsize(dtype), chunks)
        except ValueError as e:
            raise InvalidIndex(str(e), tensor=tname, ranks=sorted(set(table["rank"]))[:64]) from e
        check_columns_tiling(tname, shape, chunks, dims)
        # Columns were type-checked when each index was parsed, bounds and tiling just now.
        return TensorEntry.model_construct(name=tname, shape=list(shape), dtype=dtype, group=group, table=chunks,
                                           digest=self.digests[tid], placement=placement)


def _gather(rows: Sequence[int], col: Sequence) -> list:
    """``[col[i] for i in rows]`` at C speed."""
    if len(rows) > 1:
        return list(itemgetter(*rows)(col))
    return [col[i] for i in rows]


def _order(rank: list[int], flat: list[bool], offsets: list[tuple[int, ...]]) -> list[int] | None:
    """The rows' order by (rank, flat, offsets), ties kept in arrival order; None when they already
    are in that order (rows arrive in rank order, so usually)."""
    if len(rank) < 2 or all(map(lt, rank, rank[1:])):  # one chunk per rank
        return None
    keys = list(zip(rank, flat, offsets))
    if all(map(le, keys, keys[1:])):
        return None
    return [i for _, i in sorted(zip(keys, range(len(keys))))]
