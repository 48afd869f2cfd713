"""The reshard planner: (source manifest, target layout) -> plan. Pure, no I/O.

A plan is a list of independent work units. Each unit produces one target
file for one target rank: an ordered list of target chunks, each with its
place in the file and the read plan (source byte ranges, block digests,
copies) that fills it. Units share nothing, so they run in any order, in
threads, processes or Kubernetes pods (``ckptd reshard-worker``).

Call order: :func:`outline_reshard` cuts the units from the target layout
alone (O(target chunks)); :meth:`ReshardOutline.unit` plans one unit's reads
(O(log R + hits) per target chunk), by whoever runs it, as it starts it; so a
job's reads are planned once, split over its workers, and never held whole.
:func:`plan_reshard` plans every unit at once (a dry run, a drill, a test).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ckptd_schemas import DType, Manifest, ReadPlan, ReadRequest, itemsize, plan_reads
from ckptd_schemas.dtypes import FLOATING as FLOATS, ITEMSIZE

from .layouts import TargetChunk, TargetLayout, build_layout, rank_bytes
from .spec import LayoutSpec

__all__ = ["ReshardChunk", "ReshardOutline", "ReshardPlan", "UnitCut", "WorkUnit", "already_read", "cast_dtype",
           "kept_block", "outline_reshard", "plan_reshard"]

ALIGN = 64


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReshardChunk(_M):
    """One target chunk (a :class:`~.layouts.TargetChunk`) as its work unit writes it: where it lands in
    the unit's file (``file_offset``, ``nbytes``), its dtype before and after a cast, and the reads of
    source bytes that fill it (``reads``)."""

    tensor: str
    src_dtype: str
    dtype: str
    offsets: list[int] | None = None
    sizes: list[int] | None = None
    flat_start: int | None = None
    flat_length: int | None = None
    file_offset: int
    nbytes: int
    reads: ReadPlan

    @property
    def numel(self) -> int:
        return prod(self.sizes) if self.sizes is not None else self.flat_length or 0


def kept_block(start: int, end: int, block_size: int) -> tuple[int, int]:
    """The byte range of fetch ``[start, end)`` that a work unit keeps for the next fetch of the same
    file: its last verification block, which neighbouring target chunks share."""
    return end - min(end - start, block_size), end


def already_read(kept: tuple[int, int] | None, start: int, end: int) -> int:
    """How many leading bytes of fetch ``[start, end)`` the kept range holds (read once, not twice)."""
    if kept is None or not kept[0] <= start < kept[1]:
        return 0
    return min(kept[1], end) - start


class WorkUnit(_M):
    index: int
    rank: int
    file: str
    size: int
    chunks: list[ReshardChunk]

    @property
    def bytes_to_read(self) -> int:
        """The bytes the executor reads from storage for this unit: every fetch, less what the previous
        fetch of the same file kept (:func:`kept_block`, :func:`already_read`)."""
        kept: dict[str, tuple[int, int]] = {}
        total = 0
        for c in self.chunks:
            for f in c.reads.fetches:
                total += f.end - f.start - already_read(kept.get(f.file), f.start, f.end)
                kept[f.file] = kept_block(f.start, f.end, f.block_size)
        return total


class ReshardPlan(_M):
    source: str
    source_session: str
    source_step: int | None
    target_spec: str
    world_size: int
    mesh: dict[str, int]
    coords: list[dict[str, int]]
    group_layouts: dict[str, str]
    placements: dict[str, str]
    dtype: DType | None = Field(None, description="cast floating tensors to this dtype")
    units: list[WorkUnit]
    units_total: int = Field(0, description="units of the whole conversion (a share's plan holds some of them)")
    rank_bytes: list[dict[str, int]]

    @property
    def bytes_to_read(self) -> int:
        return sum(u.bytes_to_read for u in self.units)

    @property
    def bytes_to_write(self) -> int:
        return sum(u.size for u in self.units)


def cast_dtype(src: str, cast: str | None) -> str:
    """The dtype a tensor stored as ``src`` converts to under ``--dtype cast``: only floating tensors are cast."""
    return cast if cast is not None and src in FLOATS else src


@dataclass(frozen=True)
class UnitCut:
    """A work unit before its reads are planned: which target chunks it writes, where in its file, at what
    dtype. Cut from the layout alone (no source chunk is looked at), so cutting every unit of a job is
    cheap, and planning the reads (:meth:`ReshardOutline.unit`) is left to the worker that runs it."""

    index: int
    rank: int
    file: str
    size: int
    chunks: tuple[tuple[TargetChunk, str, str, int, int], ...]  # (chunk, source dtype, dtype, file offset, nbytes)


@dataclass
class ReshardOutline:
    """A conversion cut into work units, reads not planned: what the service cuts for a job (it records its
    summary) and each worker cuts again from the same source. :meth:`plan` plans the reads of one share of
    the units (``share`` of ``shares``:
    units ``i`` with ``i % shares == share``, so every share holds large and small target ranks alike);
    :meth:`unit` plans one unit, as its worker reaches it, so a worker holds one unit's reads at a time."""

    manifest: Manifest
    header: dict[str, Any]  # ReshardPlan's fields but its units
    cuts: list[UnitCut]
    file_bytes: int = 1 << 30  # as given to outline_reshard: with the header, what cuts the same units again
    min_units: int = 1

    @property
    def chunks(self) -> int:
        """Target chunks in all (what planning the reads costs, at about 85 us each)."""
        return sum(len(c.chunks) for c in self.cuts)

    @property
    def bytes_to_write(self) -> int:
        return sum(c.size for c in self.cuts)

    def share_of(self, share: int, shares: int) -> list[UnitCut]:
        return [c for c in self.cuts if c.index % shares == share]

    def unit(self, cut: UnitCut) -> WorkUnit:
        """``cut`` with its reads planned: O(log R + hits) per target chunk through the source's interval
        indexes."""
        chunks = []
        for tc, src_dtype, dtype, file_offset, nbytes in cut.chunks:
            region = tc.region
            if region.box is not None:
                req = ReadRequest(name=tc.tensor, offsets=list(region.box.offsets), sizes=list(region.box.sizes))
                geo: dict[str, Any] = dict(offsets=list(region.box.offsets), sizes=list(region.box.sizes))
            else:
                assert region.flat is not None
                req = ReadRequest(name=tc.tensor, flat_start=region.flat[0], flat_length=region.flat[1])
                geo = dict(flat_start=region.flat[0], flat_length=region.flat[1])
            reads = plan_reads(self.manifest, [req], coalesce_gap=0)
            chunks.append(ReshardChunk(tensor=tc.tensor, src_dtype=src_dtype, dtype=dtype, file_offset=file_offset,
                                       nbytes=nbytes, reads=reads, **geo))
        return WorkUnit(index=cut.index, rank=cut.rank, file=cut.file, size=cut.size, chunks=chunks)

    def plan(self, share: int = 0, shares: int = 1, *, reads: bool = True) -> ReshardPlan:
        """The plan of one share (every unit by default); ``reads=False``: its header alone (no units)."""
        units = [self.unit(c) for c in self.share_of(share, shares)] if reads else []
        return ReshardPlan(**self.header, units=units, units_total=len(self.cuts))


def outline_reshard(manifest: Manifest, spec: LayoutSpec, *, dtype: str | None = None, file_bytes: int = 1 << 30,
                    min_units: int = 1, layout: TargetLayout | None = None) -> ReshardOutline:
    """Cut the conversion of ``manifest`` to ``spec`` (optionally casting floats to ``dtype``) into work units.

    Each target rank's output is cut into files of at most ``file_bytes``, and into at least
    ``min_units`` work units in all where chunks allow (pass the number of parallel workers: a
    one-rank target such as ``full`` would otherwise be a single unit). A chunk is never split.
    O(target chunks): no source chunk is looked at.
    """
    if dtype is not None and dtype not in ITEMSIZE:
        from ckptd_schemas import InvalidRequest

        raise InvalidRequest(f"unknown dtype {dtype!r}; one of {sorted(ITEMSIZE)}", dtype=dtype)
    layout = layout or build_layout(spec, manifest.tensors)
    entries = {t.name: t for t in manifest.tensors}
    by_rank = layout.by_rank()
    given = file_bytes
    per_rank = -(-max(1, min_units) // max(1, len(by_rank)))
    if per_rank > 1:
        biggest = max((sum(tc.numel * itemsize(cast_dtype(entries[tc.tensor].dtype, dtype)) for tc in chunks)
                       for chunks in by_rank.values()), default=0)
        file_bytes = max(ALIGN, min(file_bytes, -(-biggest // per_rank)))
    cuts: list[UnitCut] = []
    for rank, chunks in by_rank.items():
        current: list[tuple[TargetChunk, str, str, int, int]] = []
        size = 0
        for tc in chunks:
            src_dtype = entries[tc.tensor].dtype
            out_dtype = cast_dtype(src_dtype, dtype)
            nbytes = tc.numel * itemsize(out_dtype)
            if current and size and size + nbytes > file_bytes:
                cuts.append(UnitCut(len(cuts), rank, f"r{rank:06d}-{len(cuts):05d}.bin", size, tuple(current)))
                current, size = [], 0
            current.append((tc, src_dtype, out_dtype, size, nbytes))
            size += nbytes + (-nbytes) % ALIGN
        if current:
            cuts.append(UnitCut(len(cuts), rank, f"r{rank:06d}-{len(cuts):05d}.bin", size, tuple(current)))
    header = dict(
        source=manifest.ref, source_session=manifest.session, source_step=manifest.step, target_spec=str(spec),
        world_size=layout.world_size, mesh=layout.mesh, coords=layout.coords, group_layouts=layout.group_layouts,
        placements=layout.placements, dtype=dtype, rank_bytes=rank_bytes(layout, manifest.tensors))
    return ReshardOutline(manifest, header, cuts, given, min_units)


def plan_reshard(manifest: Manifest, spec: LayoutSpec, *, dtype: str | None = None,
                 file_bytes: int = 1 << 30, min_units: int = 1, layout: TargetLayout | None = None) -> ReshardPlan:
    """Every unit of :func:`outline_reshard` with its reads planned (a preview, a drill, a test)."""
    return outline_reshard(manifest, spec, dtype=dtype, file_bytes=file_bytes, min_units=min_units,
                           layout=layout).plan()
