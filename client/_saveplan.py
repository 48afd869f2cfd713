"""The save plan: which chunks a rank writes, in which order, which it may reuse, and where they go.

Call order inside a save (``ckptd_client._save``):

1. ``flatten`` the state dict once (``ckptd_client._flatten``) and describe each tensor leaf
   (``ckptd_client._placement.local_piece``: the box or flat range this rank holds);
2. the save's one global step (DCP's ``create_global_plan``): who writes each plain (replicated)
   tensor, one of the ranks that hold it (:func:`plain_tensors`, then :meth:`ReplicaWriters.owners`);
3. :func:`plan_save` from those owners: the index's tensor entries, the chunks this rank writes,
   the reuse candidates (chunks unchanged at the rank's last save to the run, ``stall_keys``, that
   can be hashed in place), and the objects;
4. ``build_snapshot``: reuse (the candidates found unchanged and linked), then copy the rest;
5. the upload: :func:`write_order` (with what the save linked and lays apart), which ``_pack``
   lays out by :func:`lay_out` as it stores each piece.

Pure but for the global step's collective: reads names, shapes, dtypes, devices and strides, never a
tensor's bytes, and makes no request; so a test builds and compares a plan with no service and no
processes, as load does with ``ckptd_schemas.readplan.plan_reads``. One layout rule, :func:`lay_out`,
runs in the upload over the stored lengths (a compressed frame's is known once compressed); run over
the plan's raw lengths it gives the files a raw save writes.

The global step. A plain ``torch.Tensor`` is a replica (DCP's rule too): every rank that holds its
key holds the same bytes, and one of them writes it, largest first onto the holder with the fewest
bytes so far (``lpt_assign``). Whether any rank's plain tensors changed rides on the save's first
all-reduce; after a change one fixed-size all-reduce (``_dist.check``) says whether every rank holds
the same ones: then each computes the same balance, and no rank's cost grows with the world size.
Otherwise (pipeline stages) rank 0 gathers each rank's ``{key: nbytes}``, balances each key among
its holders and scatters to each rank the writers of its own keys, as DCP's coordinator plans.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Container, Iterable, Iterator, Mapping, NamedTuple, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ckptd_schemas import ParamGroup, TensorEntry
from ckptd_schemas.balance import lpt_assign
from ckptd_schemas.format.encoding import FRAME_BYTES, split_frames

from ._dist import check, cpu_group
from ._flatten import Flattened
from ._incremental import ChunkKey, chunk_key
from ._placement import LocalPiece, check_savable, dtype_name, mesh_of

__all__ = ["ALIGN", "FILE_BYTES", "Placement", "PlannedChunk", "PlannedObject", "ReplicaWriters",
           "SavePlan", "Write", "file_prefix", "lay_out", "plain_tensors", "plan_save", "write_order"]

ALIGN = 64
FILE_BYTES = 256 << 20  # the client's default ``file_bytes``


@dataclass(slots=True)
class PlannedChunk:
    """One chunk this rank writes: its whole piece of one tensor (a box, or a flat range)."""

    fqn: str
    dtype: str
    itemsize: int
    shape: tuple[int, ...]                    # the piece's own shape (what the copy takes)
    box: tuple[list[int], list[int]] | None   # (offsets, sizes) in the tensor
    flat: tuple[int, int] | None              # (start, length) of the tensor's row-major flattening
    key: ChunkKey
    candidate: bool = False                   # reuse candidate: hashed in place in the stall

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def frames(self) -> list[tuple[int, int, Any, Any]]:
        """Where a compressed chunk is cut (``split_frames``): ``(first, count, box, flat)`` per frame,
        each independently decodable, so that a ranged read decodes only the frames it overlaps."""
        return list(split_frames(self.itemsize, self.box, self.flat, FRAME_BYTES))


@dataclass(slots=True)
class PlannedObject:
    fqn: str
    value: Any = field(repr=False, compare=False)  # encoded in the stall (``encode_object``)


@dataclass(slots=True)
class Placement:
    file: str
    offset: int
    length: int


@dataclass
class SavePlan:
    rank: int
    world: int
    tensors: list[TensorEntry]          # every tensor leaf, in the state dict's order; chunks filled by the upload
    chunks: list[PlannedChunk]          # what this rank writes, in the order it copies and lays them out
    objects: list[PlannedObject]
    reuse: frozenset[ChunkKey]          # the reuse candidates' keys
    param_groups: list[ParamGroup] = field(default_factory=list)
    mesh: dict[str, int] = field(default_factory=dict)
    coords: dict[str, int] = field(default_factory=dict)
    layouts: dict[str, str] = field(default_factory=dict)


def file_prefix(rank: int) -> str:
    return f"r{rank:06d}"


T = TypeVar("T")


def lay_out(pieces: Iterable[tuple[T, int, bool]], prefix: str, file_bytes: int) -> Iterator[tuple[T, Placement]]:
    """The layout rule of a rank's data files: ``pieces`` (item, length, apart) in order, each at a
    64-byte aligned offset, in files named ``<prefix>-<n:04d>.bin``; a new file starts when the piece
    would take the current one past ``file_bytes`` (a larger piece fills a file alone), and between
    pieces laid out ``apart`` and the others, which never share a file. Lazy: a piece is placed once
    drawn (the upload draws each once stored), and one in a new file completes the file before."""
    n, size, together = 0, 0, False
    for item, length, apart in pieces:
        if n == 0 or (size and (size + length > file_bytes or apart != together)):
            n, size, together = n + 1, 0, apart
        yield item, Placement(f"{prefix}-{n - 1:04d}.bin", size, length)
        size += length + (-length) % ALIGN


class Write(NamedTuple):
    """A chunk of the upload's order: ``linked`` (its pieces in linked files: not written), else stored."""

    chunk: Any
    linked: list | None = None
    apart: bool = False  # in files of its own


def write_order(chunks: Iterable[Any], linked: Mapping[ChunkKey, list] | None = None,
                apart: Container[ChunkKey] = ()) -> list[Write]:
    """The upload's order of ``chunks`` (each with a ``key``): those unchanged yet written (``apart``:
    their earlier file was not linked) first, in files of their own that the next save may link whole;
    each group in the plan's order. ``linked``: the chunks the save linked, with their pieces."""
    chunks = sorted(chunks, key=lambda c: c.key not in apart) if apart else list(chunks)
    return [Write(c, (linked or {}).get(c.key), c.key in apart) for c in chunks]


def plain_tensors(flat: Flattened, rank: int, world: int) -> tuple[dict[str, int], str]:
    """This rank's plain (replicated) tensors as ``{key: nbytes}``, and a digest of their keys,
    shapes and dtypes with ``rank`` and ``world`` (the cache key of :class:`ReplicaWriters`).

    Every tensor leaf is checked first (``check_savable``): one that cannot be saved raises
    ``InvalidRequest`` naming its key here, where ``save`` makes every rank raise together."""
    sizes: dict[str, int] = {}
    h = hashlib.blake2b(f"{rank}/{world}".encode(), digest_size=16)
    for leaf in flat.leaves:
        v = leaf.value
        if leaf.kind == "tensor":
            check_savable(leaf.fqn, v)
        if leaf.kind == "tensor" and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
            sizes[leaf.fqn] = v.numel() * v.element_size()
            h.update(f"\0{leaf.fqn}\0{tuple(v.shape)}\0{v.dtype}".encode())
    return sizes, h.hexdigest()


class ReplicaWriters:
    """The writers of plain tensors, cached while no rank's plain tensors change (one per client)."""

    def __init__(self) -> None:
        self._signature: str | None = None
        self._owners: dict[str, int] = {}

    def stale(self, signature: str) -> bool:
        """True when the cached assignment was made for another signature (or none was made)."""
        return signature != self._signature

    def owners(self, sizes: Mapping[str, int], signature: str, *, refresh: bool, rank: int,
               world: int) -> dict[str, int]:
        """Collective when ``refresh`` (which must be the same on every rank): ``{key: writer}``."""
        if refresh or self._signature is None:
            self._owners, self._signature = self._assign(sizes, rank, world), signature
        return self._owners

    @staticmethod
    def _assign(sizes: Mapping[str, int], rank: int, world: int) -> dict[str, int]:
        if world == 1:
            return {k: 0 for k in sizes}
        if check(False, repr(sorted(sizes.items())).encode())[1]:  # the same on every rank: balanced alike
            return lpt_assign(list(sizes.items()), world)
        held: list | None = [None] * world if rank == 0 else None  # rank 0 plans, as DCP's coordinator
        dist.gather_object(dict(sizes), held, dst=0, group=cpu_group())
        plans: list | None = None
        if held is not None:
            holders: dict[str, list[int]] = {}
            nbytes: dict[str, int] = {}
            for r, their in enumerate(held):
                for k, n in their.items():
                    holders.setdefault(k, []).append(r)
                    nbytes[k] = max(nbytes.get(k, 0), n)
            owners = lpt_assign(sorted(nbytes.items()), world, holders=holders)
            plans = [{k: owners[k] for k in their} for their in held]
        mine: list = [None]
        dist.scatter_object_list(mine, plans, src=0, group=cpu_group())
        return mine[0]


def plan_save(flat: Flattened, pieces: Mapping[str, LocalPiece], rank: int, world: int,
              owners: Mapping[str, int] | None = None, *, stall_keys: Container[ChunkKey] = ()) -> SavePlan:
    """The plan of one rank's save from one flattening (``flat``) and its tensor leaves' pieces.

    ``owners`` names the rank that writes each replicated tensor (:class:`ReplicaWriters`; without
    them, balanced over all ranks by ``lpt_assign``, the same on each). A chunk in ``stall_keys`` whose source is a contiguous CPU tensor is a reuse candidate."""
    if owners is None:
        owners = lpt_assign([(n, p.numel * p.local.element_size()) for n, p in pieces.items() if p.replicated], world)
    tensors: list[TensorEntry] = []
    chunks: list[PlannedChunk] = []
    objects: list[PlannedObject] = []
    kinds: dict[str, set[str]] = {}
    for leaf in flat.leaves:
        if leaf.kind != "tensor":
            objects.append(PlannedObject(leaf.fqn, leaf.value))
            continue
        p = pieces[leaf.fqn]
        dtype = dtype_name(p.dtype)
        kinds.setdefault(leaf.group, set()).add(p.placement or "")
        tensors.append(TensorEntry(name=leaf.fqn, shape=list(p.shape), dtype=dtype, group=leaf.group, chunks=[],
                                   placement=p.placement))
        if not (owners.get(leaf.fqn) == rank if p.replicated else p.writes) or p.numel == 0:
            continue
        box = (list(p.box.offsets), list(p.box.sizes)) if p.box is not None else None
        key = chunk_key(leaf.fqn, dtype, box, p.flat)
        src = p.local
        chunks.append(PlannedChunk(leaf.fqn, dtype, src.element_size(), tuple(src.shape), box, p.flat, key,
                                   candidate=key in stall_keys and src.device.type == "cpu" and src.is_contiguous()))
    mesh, coords = mesh_of([leaf.value for leaf in flat.leaves], world)
    return SavePlan(rank, world, tensors, chunks, objects, frozenset(c.key for c in chunks if c.candidate),
                    param_groups=_param_groups(flat.param_groups),
                    mesh=mesh, coords=coords, layouts={g: _layout_name(k, mesh, world) for g, k in kinds.items()})


def _param_groups(found: Sequence[tuple[str, list[dict]]]) -> list[ParamGroup]:
    return [ParamGroup(optimizer=owner, index=i, params=[p if isinstance(p, (int, str)) else repr(p)
                                                         for p in g.get("params", [])],
                       hyperparams={k: _describe(v) for k, v in sorted(g.items()) if k != "params"})
            for owner, groups in found for i, g in enumerate(groups)]


def _describe(v: Any) -> Any:
    """A JSON description of a hyper-parameter for the manifest (the exact value is stored as an object);
    a one-element tensor is read as its number."""
    if isinstance(v, (list, tuple)):
        return [_describe(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return repr(v)


def _layout_name(kinds: set[str], mesh: dict[str, int], world: int) -> str:
    if kinds == {"replicate"}:
        return "replicate"
    if kinds <= {"flat", "replicate"}:
        return f"flat:dp={world}"
    if kinds <= {"(Shard(dim=0),)", "replicate"} and len(mesh) == 1:
        return f"fsdp2:dp={world}"
    return "dtensor:" + ",".join(f"{k}={v}" for k, v in mesh.items()) if mesh else "mixed"
