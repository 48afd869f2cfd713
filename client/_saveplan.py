"""The save plan: which chunks a rank writes, in which order, which it may reuse, and where they go.

Call order inside a save (``ckptd_client._save``):

1. ``flatten`` the state dict once (``ckptd_client._flatten``) and describe each tensor leaf
   (``ckptd_client._placement.local_piece``: the box or flat range this rank holds);
2. :func:`plan_save` (this module): the index's tensor entries, the chunks this rank writes (a
   replica by one rank: ``writers``, else ``assign_replicated``), the reuse candidates (chunks
   unchanged at the rank's last save to the run, ``stall_keys``, that can be hashed in place), the
   objects, and the raw layout of the data files;
3. ``build_snapshot``: reuse (the candidates found unchanged and linked), then copy the rest;
4. ``_pack``: compress, hash and place the pieces by the same :class:`Packer`.

Pure: reads names, shapes, dtypes, devices and strides, never a tensor's bytes, and makes no
request; so a test builds and compares a plan with no service and no processes, as load does with
``ckptd_schemas.readplan.plan_reads``. The layout is the one the upload writes when every chunk is
stored raw and none is linked: a compressed frame's length is known only once compressed, and a
chunk linked or found unchanged (laid out apart) only at the save, so the upload runs the same
:class:`Packer` over the lengths it stores, and the files match the plan's whenever those match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Container, Iterable, Mapping, Sequence, TypeVar

import torch

from ckptd_schemas import ParamGroup, TensorEntry
from ckptd_schemas.format.encoding import FRAME_BYTES, split_frames

from ._flatten import Flattened
from ._incremental import ChunkKey, chunk_key
from ._placement import LocalPiece, assign_replicated, dtype_name, mesh_of

__all__ = ["ALIGN", "FILE_BYTES", "Packer", "Placement", "PlannedChunk", "PlannedFile", "PlannedObject", "SavePlan",
           "file_prefix", "plan_save", "write_order"]

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
class PlannedFile:
    name: str
    size: int = 0  # bytes, alignment padding included


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
    files: list[PlannedFile]            # the raw layout: every chunk stored raw, none linked
    placements: dict[ChunkKey, Placement]
    param_groups: list[ParamGroup] = field(default_factory=list)
    mesh: dict[str, int] = field(default_factory=dict)
    coords: dict[str, int] = field(default_factory=dict)
    layouts: dict[str, str] = field(default_factory=dict)


def file_prefix(rank: int) -> str:
    return f"r{rank:06d}"


class Packer:
    """The layout rule of a rank's data files: pieces in order, each at a 64-byte aligned offset,
    in files named ``<prefix>-<n:04d>.bin``; a new file starts when the piece would take the current
    one past ``file_bytes`` (a larger piece fills a file alone), and between pieces laid out
    ``apart`` and the others, which never share a file."""

    def __init__(self, prefix: str, file_bytes: int) -> None:
        self.prefix, self.file_bytes = prefix, file_bytes
        self.files: list[PlannedFile] = []
        self._apart = False  # whether the current file holds pieces laid out apart

    def place(self, length: int, apart: bool = False) -> tuple[Placement, bool]:
        """Where the next piece of ``length`` bytes goes, and whether it opened a new file (the
        previous one, if any, is then complete)."""
        last = self.files[-1] if self.files else None
        opened = last is None or bool(last.size and (last.size + length > self.file_bytes or self._apart != apart))
        if opened:
            last = PlannedFile(f"{self.prefix}-{len(self.files):04d}.bin")
            self.files.append(last)
            self._apart = apart
        assert last is not None
        at = Placement(last.name, last.size, length)
        last.size += length + (-length) % ALIGN
        return at, opened


T = TypeVar("T")


def write_order(chunks: Iterable[T], apart: Container[ChunkKey]) -> list[T]:
    """The order the upload lays chunks out in: those unchanged yet written (``apart``: their
    earlier file was not linked) first, in files of their own that the next save may link whole;
    each group in the plan's order."""
    chunks = list(chunks)
    return sorted(chunks, key=lambda c: c.key not in apart) if apart else chunks


def plan_save(flat: Flattened, pieces: Mapping[str, LocalPiece], rank: int, world: int, *,
              writers: Mapping[str, int] | None = None, stall_keys: Container[ChunkKey] = (),
              file_bytes: int = FILE_BYTES) -> SavePlan:
    """The plan of one rank's save from one flattening (``flat``) and its tensor leaves' pieces.

    ``writers`` names the rank that writes each plain tensor (agreed among the ranks that hold it);
    without it they are balanced over all ranks from names and sizes (``assign_replicated``). A chunk
    in ``stall_keys`` whose source is a contiguous CPU tensor is a reuse candidate."""
    owners = writers if writers is not None else assign_replicated(
        [(n, p.numel * p.local.element_size()) for n, p in pieces.items() if p.replicated], world)
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
    packer = Packer(file_prefix(rank), file_bytes)
    placements = {c.key: packer.place(c.nbytes)[0] for c in chunks}
    mesh, coords = mesh_of([leaf.value for leaf in flat.leaves], world)
    return SavePlan(rank, world, tensors, chunks, objects, frozenset(c.key for c in chunks if c.candidate),
                    packer.files, placements, param_groups=_param_groups(flat.param_groups),
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
