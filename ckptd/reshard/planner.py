"""The reshard planner: (source manifest, target layout) -> plan. Pure, no I/O.

A plan is a list of independent work units. Each unit produces one target
file for one target rank: an ordered list of target chunks, each with its
place in the file and the read plan (source byte ranges, block digests,
copies) that fills it. Units share nothing, so they run in any order, in
threads, processes or one Kubernetes pod each (``ckptd reshard-worker``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ckptd_schemas import DType, Manifest, ReadPlan, ReadRequest, itemsize, plan_reads
from ckptd_schemas.dtypes import FLOATING as FLOATS, ITEMSIZE

from .layouts import TargetLayout, build_layout, rank_bytes
from .spec import LayoutSpec

__all__ = ["PlannedChunk", "ReshardPlan", "WorkUnit", "already_read", "kept_block", "plan_reshard"]

ALIGN = 64


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlannedChunk(_M):
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
        if self.sizes is not None:
            n = 1
            for s in self.sizes:
                n *= s
            return n
        return self.flat_length or 0


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
    chunks: list[PlannedChunk]

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
    rank_bytes: list[dict[str, int]]

    @property
    def bytes_to_read(self) -> int:
        return sum(u.bytes_to_read for u in self.units)

    @property
    def bytes_to_write(self) -> int:
        return sum(u.size for u in self.units)


def _out_dtype(src: str, cast: str | None) -> str:
    return cast if cast is not None and src in FLOATS else src


def plan_reshard(manifest: Manifest, spec: LayoutSpec, *, dtype: str | None = None,
                 file_bytes: int = 1 << 30, min_units: int = 1, layout: TargetLayout | None = None) -> ReshardPlan:
    """Plan the conversion of ``manifest`` to ``spec`` (optionally casting floats to ``dtype``).

    Each target rank's output is cut into files of at most ``file_bytes``, and into at least
    ``min_units`` work units in all where chunks allow (pass the number of parallel workers: a
    one-rank target such as ``full`` would otherwise be a single unit). A chunk is never split.
    """
    if dtype is not None and dtype not in ITEMSIZE:
        from ckptd_schemas import InvalidRequest

        raise InvalidRequest(f"unknown dtype {dtype!r}; one of {sorted(ITEMSIZE)}", dtype=dtype)
    layout = layout or build_layout(spec, manifest.tensors)
    entries = {t.name: t for t in manifest.tensors}
    by_rank = layout.by_rank()
    per_rank = -(-max(1, min_units) // max(1, len(by_rank)))
    if per_rank > 1:
        biggest = max((sum(tc.numel * itemsize(_out_dtype(entries[tc.tensor].dtype, dtype)) for tc in chunks)
                       for chunks in by_rank.values()), default=0)
        file_bytes = max(ALIGN, min(file_bytes, -(-biggest // per_rank)))
    units: list[WorkUnit] = []
    for rank, chunks in by_rank.items():
        current: WorkUnit | None = None
        for tc in chunks:
            t = entries[tc.tensor]
            out_dtype = _out_dtype(t.dtype, dtype)
            nbytes = tc.numel * itemsize(out_dtype)
            if current is None or (current.size and current.size + nbytes > file_bytes):
                current = WorkUnit(index=len(units), rank=rank, file=f"r{rank:06d}-{len(units):05d}.bin",
                                   size=0, chunks=[])
                units.append(current)
            region = tc.region
            if region.box is not None:
                req = ReadRequest(name=t.name, offsets=list(region.box.offsets), sizes=list(region.box.sizes))
                geo = dict(offsets=list(region.box.offsets), sizes=list(region.box.sizes))
            else:
                assert region.flat is not None
                req = ReadRequest(name=t.name, flat_start=region.flat[0], flat_length=region.flat[1])
                geo = dict(flat_start=region.flat[0], flat_length=region.flat[1])
            reads = plan_reads(manifest, [req], coalesce_gap=0)
            current.chunks.append(PlannedChunk(tensor=t.name, src_dtype=t.dtype, dtype=out_dtype,
                                               file_offset=current.size, nbytes=nbytes, reads=reads, **geo))
            current.size += nbytes + (-nbytes) % ALIGN
    return ReshardPlan(
        source=manifest.ref, source_session=manifest.session, source_step=manifest.step, target_spec=str(spec),
        world_size=layout.world_size, mesh=layout.mesh, coords=layout.coords, group_layouts=layout.group_layouts,
        placements=layout.placements, dtype=dtype, units=units, rank_bytes=rank_bytes(layout, manifest.tensors))
