"""The load tree: a manifest's metadata in pieces a loading rank can check one by one against its marker.

A loading rank of a job of R ranks needs its own slice of every tensor, not the manifest of all
R x T chunks (134 MB at 10,000 ranks x 200 tensors). The load tree splits what a load acts on into

* a **head**: the checkpoint's identity (run, name, session, step, lineage), world size, mesh and
  layouts, each tensor's name, shape, dtype, group, digest and placement with the count and root of
  its chunk rows, the param groups, a directory of the objects, and the roots of the files' and the
  objects' trees: O(T), canonical JSON bytes;
* one **Merkle tree per tensor** over its chunk rows, in table order; one over the files (sorted by
  name); one over the objects (sorted by name, then rank, the global entry first).

The head's XXH3-128 is the **load tree's root**: the commit computes it (``LoadTree(m).root``) and
writes it into the ``COMMITTED`` marker beside the manifest's digest. The service answers a rank
with the head and, for the regions it asks, the chunk rows its tensors' interval indexes find, the
files they lie in and the objects it restores, each with the sibling digests that lead to a root in
the head (:meth:`LoadTree.answer`). The rank hashes the head against the marker's root, checks
every piece's path to the head (:func:`verify_answer`), plans its reads itself from the checked rows
(``ckptd_schemas.readplan.plan_reads``) and refuses an answer that misses a piece of a region:
nothing the service cached, computed or read is taken on its word. What a rank fetches and checks
is O(T + pieces x log R); the service builds the tree once per parsed manifest.

Leaves and nodes are XXH3-128 (seed 1 for leaves, 2 for nodes), 16 raw bytes; a level of a tree is
one ``bytes`` (16 bytes a node); an odd last node is carried up unchanged. A chunk row's leaf is the
UTF-8 of ``"|".join`` of its fields as Python writes them (tuples by ``repr``), a file's and an
object's the compact JSON of ``[name, entry]``. Pure: no I/O, no torch.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass
from functools import partial
from math import prod
from typing import Any, Iterable, Sequence

import xxhash

from .chunktable import ChunkColumns
from .errors import CorruptCheckpoint
from .manifest import FileEntry, Manifest, ObjectEntry, ParamGroup, TensorEntry, Topology
from .readplan import PlanBudget, ReadPlan, ReadRequest, wanted_region

__all__ = ["LoadHead", "LoadTree", "ROWS_COLUMNS", "check_covered", "verify_answer"]

TREE_FORMAT = "ckptd-load-tree-1"
_leaf = partial(xxhash.xxh3_128_digest, seed=1)
_node = partial(xxhash.xxh3_128_digest, seed=2)
D = 16  # bytes of a digest

#: The columns of a chunk row in an answer, in leaf order.
ROWS_COLUMNS = ("offsets", "sizes", "file", "offset", "length", "codec", "xxh3", "rank", "flat")


# -- trees -----------------------------------------------------------------------------------------

def _levels(leaves: Sequence[bytes]) -> list[bytes]:
    """Every level of the tree over ``leaves``, the leaves first, the root last."""
    level = b"".join(leaves) if leaves else _node(b"")
    levels = [level]
    while len(level) > D:
        n = len(level) // D
        pairs = [level[i:i + 2 * D] for i in range(0, (n - n % 2) * D, 2 * D)]
        nxt = b"".join(map(_node, pairs))
        if n % 2:
            nxt += level[-D:]
        level = nxt
        levels.append(level)
    return levels


def _proof(levels: list[bytes], i: int) -> list[str]:
    """The sibling digests from leaf ``i`` up to the root (hex), skipping the levels where the node
    has no sibling (an odd last node carried up)."""
    out = []
    for level in levels[:-1]:
        n = len(level) // D
        sib = i ^ 1
        if sib < n:
            out.append(level[sib * D:(sib + 1) * D].hex())
        i //= 2
    return out


def _root_from(leaf: bytes, i: int, n: int, proof: Sequence[str]) -> bytes:
    """The root a leaf at position ``i`` of ``n`` leads to through ``proof``."""
    h, k = leaf, 0
    while n > 1:
        if i ^ 1 < n:
            if k >= len(proof):
                raise ValueError("proof too short")
            sib = bytes.fromhex(proof[k])
            k += 1
            h = _node(h + sib) if i % 2 == 0 else _node(sib + h)
        i, n = i // 2, (n + 1) // 2
    if k != len(proof):
        raise ValueError("proof too long")
    return h


def _row_leaves(t: ChunkColumns) -> list[bytes]:
    """The leaves of a tensor's chunk rows (whole-column passes: about 1 us a row)."""
    n = len(t)
    flat = ["0"] * n if t.flat is None else ["1" if f else "0" for f in t.flat]
    codec = ["raw"] * n if t.codec is None else t.codec
    rank = ["0"] * n if t.rank is None else list(map(str, t.rank))
    cols = [list(map(repr, t.offsets)), list(map(repr, t.sizes)), t.file, list(map(str, t.offset)),
            list(map(str, t.length)), codec, t.xxh3, rank, flat]
    return list(map(_leaf, map(str.encode, map("|".join, zip(*cols)))))


def _row_leaf(row: Sequence[Any]) -> bytes:
    """One row's leaf, as :func:`_row_leaves` makes it for a whole table (the rank's side; the tests'
    answers, checked against the service's trees, hold the two to one encoding)."""
    offsets, sizes, file, offset, length, codec, xxh3, rank, flat = row
    return _leaf("|".join([repr(tuple(offsets)), repr(tuple(sizes)), file, str(offset), str(length), codec, xxh3,
                           str(rank), "1" if flat else "0"]).encode())


def _table(rows: Sequence[Sequence[Any]]) -> ChunkColumns:
    """The chunk table of answered rows (:data:`ROWS_COLUMNS`), validated as any table is."""
    return ChunkColumns(**{c: [r[k] for r in rows] for k, c in enumerate(ROWS_COLUMNS)})


def _json(x: Any) -> bytes:
    return json.dumps(x, separators=(",", ":"), sort_keys=True, ensure_ascii=True).encode()


def _object_order(objects: Sequence[ObjectEntry]) -> list[ObjectEntry]:
    return sorted(objects, key=lambda o: (o.name, -1 if o.rank is None else o.rank))


# -- the head --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadHead:
    """The head, parsed (what a loading rank matches its state dict against)."""

    raw: bytes
    doc: dict
    root: str  # what ``raw`` hashes to: the root the marker names

    @classmethod
    def parse(cls, raw: bytes, root: str) -> "LoadHead":
        """Parse the head's bytes after checking them against the marker's root."""
        got = xxhash.xxh3_128_hexdigest(raw)
        if got != root:
            raise CorruptCheckpoint(f"the load tree's head hashes to {got}, its COMMITTED marker names {root}",
                                    file="load tree")
        doc = json.loads(raw)
        if doc.get("format") != TREE_FORMAT:
            raise CorruptCheckpoint(f"unknown load tree format {doc.get('format')!r}", file="load tree")
        return cls(raw, doc, got)

    @property
    def ref(self) -> str:
        return f"{self.doc['run']}/{self.doc['name']}"

    def tensors(self) -> dict[str, dict]:
        """name -> {shape, dtype, group, digest, placement, rows, root}"""
        keys = ("shape", "dtype", "group", "digest", "placement", "rows", "root")
        return {t[0]: dict(zip(keys, t[1:])) for t in self.doc["tensors"]}

    def objects(self) -> dict[str, dict]:
        """name -> {first, count, global, uniform}: where its entries lie in the objects' tree."""
        keys = ("first", "count", "global", "uniform")
        return {o[0]: dict(zip(keys, o[1:])) for o in self.doc["objects"]["names"]}


def _head(m: Manifest, tensor_roots: list[tuple[int, bytes]], files: tuple[int, bytes],
          objects: tuple[list, int, bytes]) -> bytes:
    ident = m.model_dump(mode="json", include={"run", "name", "step", "session", "created_at", "derived_from",
                                                "parent"})
    doc = {
        "format": TREE_FORMAT, **ident,
        "topology": m.topology.model_dump(mode="json", exclude={"ranks"}),
        "tensors": [[t.name, t.shape, t.dtype, t.group, t.digest, t.placement, n, root.hex()]
                    for t, (n, root) in zip(m.tensors, tensor_roots)],
        "param_groups": [g.model_dump(mode="json") for g in m.param_groups],
        "files": {"count": files[0], "root": files[1].hex()},
        "objects": {"names": objects[0], "count": objects[1], "root": objects[2].hex()},
    }
    return _json(doc)


# -- the tree, on the service's side ------------------------------------------------------------------

class LoadTree:
    """A manifest's load tree (the service builds it once per parsed manifest and keeps it with it:
    ``ckptd.store.visibility.Visibility.load_tree``)."""

    def __init__(self, m: Manifest) -> None:
        self.manifest = m
        self.tensor_levels = [_levels(_row_leaves(t.table)) for t in m.tensors]
        self.file_names = sorted(m.files)
        self.file_levels = _levels([_leaf(_json([f, m.files[f].model_dump(mode="json")])) for f in self.file_names])
        self.objects = _object_order(m.objects)
        self.object_levels = _levels([_leaf(_json([o.name, o.model_dump(mode="json")])) for o in self.objects])
        names: list[list] = []
        for i, o in enumerate(self.objects):
            if not names or names[-1][0] != o.name:
                names.append([o.name, i, 0, o.rank is None, True])
            entry = names[-1]
            entry[2] += 1
            entry[4] = entry[4] and o.value_key() == self.objects[entry[1]].value_key()
        self.head = _head(m, [(len(t.table), lv[-1]) for t, lv in zip(m.tensors, self.tensor_levels)],
                          (len(self.file_names), self.file_levels[-1]),
                          (names, len(self.objects), self.object_levels[-1]))
        self.root = xxhash.xxh3_128_hexdigest(self.head)
        self._object_names = {e[0]: e for e in names}
        # per object name saved per rank, its ranks in order (a rank's entry found by bisection)
        self._object_ranks = {e[0]: [o.rank for o in self.objects[e[1]:e[1] + e[2]]] for e in names if not e[3]}
        self._tensor_pos = {t.name: i for i, t in enumerate(m.tensors)}

    def answer(self, requests: Sequence[ReadRequest], objects: Iterable[str], rank: int,
               budget: PlanBudget | None = None) -> dict:
        """The pieces a rank needs for ``requests`` and the objects named, each with its proof:
        the chunk rows each region's interval index finds, the files they lie in, and per object name
        the entries :func:`verify_answer` needs to choose the rank's (the global one; else its own,
        or the neighbours that show it has none, and the first when every rank saved the same)."""
        m = self.manifest
        wanted = [wanted_region(m, req) for req in requests]  # a tensor not in it, a region outside: typed errors
        if budget is not None:
            budget.check_visits(wanted)
        tensors: dict[str, dict] = {}
        files: set[str] = set()
        for t, want in wanted:
            rows = tensors.setdefault(t.name, {})
            tab = t.table
            for i in t.index.candidates(want):
                if i not in rows:
                    rows[i] = [list(tab.offsets[i]), list(tab.sizes[i]), tab.file[i], tab.offset[i], tab.length[i],
                               tab.codec_of(i), tab.xxh3[i], tab.rank[i] if tab.rank is not None else 0,
                               tab.is_flat(i)]
                    files.add(tab.file[i])
        out_tensors = {name: {"rows": {str(i): row for i, row in rows.items()},
                              "proofs": {str(i): _proof(self.tensor_levels[self._tensor_pos[name]], i) for i in rows}}
                       for name, rows in tensors.items()}
        out_objects: dict[str, dict] = {}
        for name in objects:
            e = self._object_names.get(name)
            if e is None:
                continue
            picks = set(_object_picks(self._object_ranks.get(name, []), e[1], e[3], e[4], rank))
            for i in picks:
                o = self.objects[i]
                if o.location is not None:
                    files.add(o.location.file)
            out_objects[name] = {str(i): {"entry": self.objects[i].model_dump(mode="json"),
                                          "proof": _proof(self.object_levels, i)} for i in sorted(picks)}
        out_files = {}
        for f in sorted(files):
            i = bisect_left(self.file_names, f)
            out_files[f] = {"index": i, "entry": m.files[f].model_dump(mode="json"),
                            "proof": _proof(self.file_levels, i)}
        return {"root": self.root, "tensors": out_tensors, "files": out_files, "objects": out_objects}


def _object_picks(ranks: Sequence[int | None], first: int, is_global: bool, uniform: bool, rank: int) -> list[int]:
    """Positions of the entries that decide which one ``rank`` restores (see :meth:`LoadTree.answer`):
    ``ranks`` are the ranks of the name's entries, in order, from position ``first`` (O(log R))."""
    if is_global:
        return [first]
    count = len(ranks)
    j = bisect_left(ranks, rank)  # type: ignore[arg-type]
    if j < count and ranks[j] == rank:
        return [first + j]
    out = [first + k for k in (j - 1, j) if 0 <= k < count]
    return out + ([first] if uniform else [])


# -- the rank's side -------------------------------------------------------------------------------------

def verify_answer(head: LoadHead, answer: dict, requests: Sequence[ReadRequest], rank: int,
                  ) -> tuple[Manifest, dict[str, ObjectEntry | None]]:
    """Check every piece of ``answer`` against ``head`` and return what it proves: a manifest that
    holds the requested tensors' rows found, the files they lie in (sizes, block digests), and per
    object name asked the entry ``rank`` restores (None: it has none). Raises
    :class:`CorruptCheckpoint` for a piece whose path does not lead to the head's root, or an answer
    that leaves part of a region without a chunk (checked again when the plan is made)."""
    if answer.get("root") != head.root:
        raise CorruptCheckpoint(f"the service answered from load tree {answer.get('root')}, the head is "
                                f"{head.root}: the checkpoint changed during the load", file="load tree")
    meta = head.tensors()
    doc = head.doc
    tensors: list[TensorEntry] = []
    wanted = {r.name for r in requests}
    for name, got in answer["tensors"].items():
        t = meta.get(name)
        if t is None or name not in wanted:
            raise CorruptCheckpoint(f"the service answered rows of tensor {name!r}, which was not asked or is "
                                    f"not in the checkpoint", tensor=name)
        rows: list = []
        for key, row in got["rows"].items():
            i = int(key)
            if not 0 <= i < t["rows"] or len(row) != len(ROWS_COLUMNS):
                raise CorruptCheckpoint(f"tensor {name!r}: chunk row {i} is not one of its {t['rows']}", tensor=name)
            _check_path(_row_leaf(row), i, t["rows"], got["proofs"].get(key), t["root"], f"tensor {name!r}: chunk row {i}")
            rows.append(row)
        tensors.append(TensorEntry(name=name, shape=t["shape"], dtype=t["dtype"], group=t["group"],
                                   digest=t["digest"], placement=t["placement"], table=_table(rows)))
    for name in wanted - set(answer["tensors"]):
        t = meta.get(name)
        if t is not None and t["rows"]:
            tensors.append(TensorEntry(name=name, shape=t["shape"], dtype=t["dtype"], group=t["group"],
                                       table=_table([])))
    files: dict[str, FileEntry] = {}
    nfiles, froot = doc["files"]["count"], doc["files"]["root"]
    for f, got in answer["files"].items():
        _check_path(_leaf(_json([f, got["entry"]])), got["index"], nfiles, got["proof"], froot, f"file {f!r}")
        files[f] = FileEntry.model_validate(got["entry"])
    objects = _verify_objects(head, answer.get("objects", {}), rank)
    try:
        manifest = Manifest(run=doc["run"], name=doc["name"], step=doc["step"], session=doc["session"],
                            created_at=doc["created_at"], derived_from=doc["derived_from"], parent=doc["parent"],
                            topology=Topology.model_validate(doc["topology"]), tensors=tensors,
                            objects=[o for o in objects.values() if o is not None],
                            param_groups=[ParamGroup.model_validate(g) for g in doc["param_groups"]], files=files)
    except ValueError as e:  # pydantic's ValidationError: e.g. a row in a file the answer does not prove
        raise CorruptCheckpoint(f"the service's answer for {head.ref} does not hold together: {e}"[:600],
                                file="load tree") from None
    return manifest, objects


def check_covered(plan: ReadPlan, requests: Sequence[ReadRequest], manifest: Manifest) -> None:
    """Raise :class:`CorruptCheckpoint` unless the plan fills every element of every request: the rows
    an answer proves are the checkpoint's, but only this shows none was left out (the chunks of a
    committed tensor tile it exactly, so the copies of a region add up to its size exactly when it
    is whole)."""
    covered = [0] * len(requests)
    for c in plan.copies:
        covered[c.request] += sum(prod(sizes) for _, sizes in c.regions)
    for req, got in zip(requests, covered):
        t = manifest.tensor(req.name)
        want = req.region(t.shape).numel if t is not None else 0
        if got != want:
            raise CorruptCheckpoint(f"tensor {req.name!r}: the chunks the service answered hold {got} of the "
                                    f"{want} elements asked", tensor=req.name)


def _check_path(leaf: bytes, i: int, n: int, proof: Any, root: str, what: str) -> None:
    try:
        ok = isinstance(proof, list) and _root_from(leaf, i, n, proof).hex() == root
    except ValueError:
        ok = False
    if not ok:
        raise CorruptCheckpoint(f"{what} does not lead to the load tree's root its COMMITTED marker names",
                                file="load tree")


def _verify_objects(head: LoadHead, got: dict, rank: int) -> dict[str, ObjectEntry | None]:
    """Per object name answered: the entry ``rank`` restores, chosen as ``_load._pick_object`` does,
    from entries whose paths were checked (and, for "none of its own", the neighbours that show it)."""
    directory = head.objects()
    count, root = head.doc["objects"]["count"], head.doc["objects"]["root"]
    out: dict[str, ObjectEntry | None] = {}
    for name, entries in got.items():
        d = directory.get(name)
        if d is None:
            raise CorruptCheckpoint(f"the service answered object {name!r}, which is not in the checkpoint",
                                    object=name)
        checked: dict[int, ObjectEntry] = {}
        for key, e in entries.items():
            i = int(key)
            if not d["first"] <= i < d["first"] + d["count"]:
                raise CorruptCheckpoint(f"object {name!r}: entry {i} is not one of its own", object=name)
            _check_path(_leaf(_json([name, e["entry"]])), i, count, e["proof"], root, f"object {name!r}")
            o = ObjectEntry.model_validate(e["entry"])
            if o.name != name:
                raise CorruptCheckpoint(f"object {name!r}: entry {i} is of object {o.name!r}", object=name)
            checked[i] = o
        want = _object_picks_of(d, checked, rank, name)
        out[name] = checked[want] if want is not None else None
    return out


def _object_picks_of(d: dict, checked: dict[int, ObjectEntry], rank: int, name: str) -> int | None:
    first, count = d["first"], d["count"]
    if d["global"]:
        if first not in checked:
            raise CorruptCheckpoint(f"object {name!r}: the answer lacks its global entry", object=name)
        return first
    own = [i for i, o in checked.items() if o.rank == rank]
    if own:
        return own[0]
    # no entry of its own: the answer must show the neighbours around where it would be
    below = [i for i, o in checked.items() if o.rank is not None and o.rank < rank]
    above = [i for i, o in checked.items() if o.rank is not None and o.rank > rank]
    lo = max(below, default=first - 1)
    hi = min(above, default=first + count)
    if hi != lo + 1:
        raise CorruptCheckpoint(f"object {name!r}: the answer does not show whether rank {rank} saved it",
                                object=name)
    if d["uniform"]:
        if first not in checked:
            raise CorruptCheckpoint(f"object {name!r}: the answer lacks the entry every rank saved", object=name)
        return first
    return None
