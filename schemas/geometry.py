"""Pure geometry of chunks: boxes, flat ranges, intersection and tiling.

No I/O and no torch: the planner, the service's read plans, the commit
validation and the client's copies all reduce to these few functions, which
are property-tested against brute force (``tests/schemas/test_geometry.py``).

Two kinds of region exist (docs/design.md §1): a *box* (per-dimension offsets and
sizes, like DCP's ChunkStorageMetadata) and a *flat range* (start and length
in the row-major flattening, ZeRO/FSDP1 style). A flat range decomposes into a
few boxes that are each contiguous in row-major order
(:func:`flat_range_to_boxes`), so everything else is box arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterable, Sequence

from .errors import TilingError

__all__ = [
    "Box",
    "Region",
    "box_flat_span",
    "check_tiling",
    "flat_range_to_boxes",
    "intersect_regions",
    "is_row_major_contiguous",
    "row_major_strides",
]


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


@dataclass(frozen=True, slots=True)
class Box:
    """A hyper-rectangle ``[offsets, offsets + sizes)`` in global coordinates."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        return cls(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    def intersect(self, other: "Box") -> "Box | None":
        """The common box, or None when it is empty."""
        offs, sizes = [], []
        for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(a, b), min(a + sa, b + sb)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def contains(self, other: "Box") -> bool:
        return all(
            a <= b and b + sb <= a + sa
            for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )


def is_row_major_contiguous(box: Box, shape: Sequence[int]) -> bool:
    """True when the box's elements are one run of the row-major flattening."""
    n = len(shape)
    k = 0
    while k < n and box.sizes[k] == 1:
        k += 1
    return all(box.offsets[i] == 0 and box.sizes[i] == shape[i] for i in range(k + 1, n))


def box_flat_span(box: Box, strides: Sequence[int], base: int = 0) -> tuple[int, int]:
    """``[first, last + 1)`` positions of a non-empty box under affine ``strides``."""
    first = sum(o * s for o, s in zip(box.offsets, strides)) - base
    last = sum((o + z - 1) * s for o, z, s in zip(box.offsets, box.sizes, strides)) - base
    return first, last + 1


def flat_range_to_boxes(shape: Sequence[int], start: int, length: int) -> list[Box]:
    """Split ``[start, start + length)`` of the row-major flattening into boxes.

    Each box is contiguous in row-major order, boxes are returned in flat order
    and together cover the range exactly; at most ``2 * ndim - 1`` boxes.
    """
    shape = tuple(shape)
    total = prod(shape)
    if start < 0 or length < 0 or start + length > total:
        raise ValueError(f"flat range [{start}, {start + length}) outside {total} elements")
    if length == 0:
        return []
    if not shape:
        return [Box((), ())]
    strides = row_major_strides(shape)
    out: list[Box] = []

    def rec(prefix: tuple[int, ...], dim: int, a: int, b: int) -> None:
        # [a, b) is relative to the sub-tensor shape[dim:] at index `prefix`.
        if a >= b:
            return
        st = strides[dim]
        rest = shape[dim + 1:]
        ones = (1,) * len(prefix)
        if a % st == 0 and (b % st == 0):
            out.append(Box(prefix + (a // st,) + (0,) * len(rest), ones + ((b - a) // st,) + rest))
            return
        i0, i1 = a // st, (b - 1) // st
        if i0 == i1:
            rec(prefix + (i0,), dim + 1, a - i0 * st, b - i0 * st)
            return
        head_end = (i0 + 1) * st if a % st else a
        if a % st:
            rec(prefix + (i0,), dim + 1, a - i0 * st, st)
        tail_start = (b // st) * st
        if tail_start > head_end:
            out.append(
                Box(prefix + (head_end // st,) + (0,) * len(rest), ones + ((tail_start - head_end) // st,) + rest)
            )
        if b % st:
            rec(prefix + (b // st,), dim + 1, 0, b - tail_start)

    rec((), 0, start, start + length)
    return out


@dataclass(frozen=True, slots=True)
class Region:
    """What one chunk covers: a box, or a flat range (``flat`` = (start, length))."""

    box: Box | None = None
    flat: tuple[int, int] | None = None

    def boxes(self, shape: Sequence[int]) -> list[Box]:
        if self.box is not None:
            return [self.box] if self.box.numel > 0 else []
        assert self.flat is not None
        return flat_range_to_boxes(shape, self.flat[0], self.flat[1])

    @property
    def numel(self) -> int:
        return self.box.numel if self.box is not None else self.flat[1]  # type: ignore[index]

    def inside(self, shape: Sequence[int]) -> bool:
        """Whether the region lies in a tensor of ``shape``: a box of its rank within it, or a flat range
        within its elements."""
        if self.box is not None:
            return len(self.box.offsets) == len(shape) and Box.full(shape).contains(self.box)
        start, length = self.flat  # type: ignore[misc]
        return start >= 0 and length >= 0 and start + length <= prod(shape)


def intersect_regions(shape: Sequence[int], a: Region, b: Region) -> list[Box]:
    """Boxes covering exactly the elements both regions hold."""
    if a.flat is not None and b.flat is not None:
        lo = max(a.flat[0], b.flat[0])
        hi = min(a.flat[0] + a.flat[1], b.flat[0] + b.flat[1])
        return flat_range_to_boxes(shape, lo, hi - lo) if hi > lo else []
    out = []
    for x in a.boxes(shape):
        for y in b.boxes(shape):
            z = x.intersect(y)
            if z is not None:
                out.append(z)
    return out


def check_tiling(
    tensor: str,
    shape: Sequence[int],
    pieces: Iterable[tuple[Region, int, str]],
) -> None:
    """Raise :class:`TilingError` unless the pieces cover ``shape`` exactly once.

    ``pieces`` are ``(region, rank, content_digest)``. Identical regions with the
    same digest are replicas (counted once); any other overlap, any gap, or a
    region outside the shape is refused, naming the tensor and ranks.
    Cost is O(n log n) for the usual layouts (bands along dim 0).
    """
    shape = tuple(shape)
    unique: dict[Box, tuple[int, str]] = {}
    ranks_seen: set[int] = set()
    total = prod(shape)
    for region, rank, digest in pieces:
        ranks_seen.add(rank)
        if not region.inside(shape):
            at = (f"at offsets {list(region.box.offsets)} sizes {list(region.box.sizes)}" if region.box is not None
                  else f"flat [{region.flat[0]}, {sum(region.flat)}) of {total} elements")  # type: ignore[index,arg-type]
            raise TilingError(f"tensor {tensor!r}: chunk from rank {rank} {at} lies outside global shape {list(shape)}",
                              tensor=tensor, ranks=[rank])
        for box in region.boxes(shape):
            prev = unique.get(box)
            if prev is None:
                unique[box] = (rank, digest)
            elif prev[1] != digest:
                raise TilingError(
                    f"tensor {tensor!r}: ranks {prev[0]} and {rank} both hold offsets {list(box.offsets)} "
                    f"sizes {list(box.sizes)} with different contents (state that differs between ranks "
                    f"needs a key per rank, or a DTensor whose placements say how it is split)",
                    tensor=tensor, ranks=sorted({prev[0], rank}),
                )
    boxes = sorted(unique, key=lambda b: b.offsets)
    if shape:
        active: list[Box] = []
        for box in boxes:
            start0 = box.offsets[0]
            active = [a for a in active if a.offsets[0] + a.sizes[0] > start0]
            for other in active:
                if box.intersect(other) is not None:
                    r1, r2 = unique[other][0], unique[box][0]
                    raise TilingError(
                        f"tensor {tensor!r}: chunks overlap: rank {r1} at offsets {list(other.offsets)} "
                        f"sizes {list(other.sizes)} and rank {r2} at offsets {list(box.offsets)} "
                        f"sizes {list(box.sizes)}",
                        tensor=tensor, ranks=sorted({r1, r2}),
                    )
            active.append(box)
    covered = sum(b.numel for b in boxes)
    if covered != total:
        where = _first_gap(shape, boxes)
        raise TilingError(
            f"tensor {tensor!r}: chunks cover {covered} of {total} elements{where}; "
            f"chunks came from ranks {sorted(ranks_seen)}",
            tensor=tensor, ranks=sorted(ranks_seen), covered=covered, numel=total,
        )


def _first_gap(shape: tuple[int, ...], boxes: list[Box]) -> str:
    """Name the first missing flat range when every box is a row-major run."""
    if not all(is_row_major_contiguous(b, shape) for b in boxes):
        return ""
    strides = row_major_strides(shape)
    spans = sorted(box_flat_span(b, strides) for b in boxes)
    pos = 0
    for lo, hi in spans:
        if lo > pos:
            break
        pos = max(pos, hi)
    end = next((lo for lo, _ in spans if lo > pos), prod(shape))
    return f" (missing flat elements [{pos}, {end}))"
