"""Which chunks of a tensor meet a region, in O(log n + hits): an interval index over the chunk columns.

A read plan asks, for each region a reader needs, which chunks of the tensor overlap it. Walking
every chunk costs O(R) per region, so a resume of R ranks costs the service O(R²·T), and a reshard
planner as much. This index is built once per tensor of a parsed manifest (the manifest, cached by
digest, carries it; :attr:`TensorEntry.index`) over its columns, with no object per chunk:

* each chunk becomes an interval ``[lo, hi)`` on one **key axis**: for box chunks, the outermost
  dimension along which the chunks do not all span the whole tensor (FSDP's rows, ``Shard(1)``'s
  columns; the rows of a dp x tp grid); for flat chunks, the flat range itself. A region's interval
  on the same axis is a superset of what it holds (:meth:`ChunkIndex.key_interval`), so every chunk
  that meets the region meets that interval;
* replicas (the same region written by several ranks) are indexed once, the first in table order,
  the one a plan reads;
* the intervals are sorted by ``lo`` with a running maximum of ``hi``: the chunks meeting
  ``[a, b)`` lie between the first row whose running maximum exceeds ``a`` and the last row whose
  ``lo`` is below ``b`` (two bisections). Rows in between whose own interval ends before ``a``
  (nested intervals, rare in a tiling) are candidates the caller's exact intersection drops.

A table that mixes box and flat chunks is not indexed: every distinct chunk is a candidate (O(n)).
The answer is candidates, not intersections: the caller intersects exactly
(:func:`ckptd_schemas.geometry.intersect_regions`). Pure: no I/O, no torch. Memory: three
8-byte columns per distinct chunk.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from itertools import accumulate
from math import prod
from typing import Sequence

from .chunktable import ChunkColumns
from .geometry import Region, box_flat_span, row_major_strides

__all__ = ["ChunkIndex"]


class ChunkIndex:
    """Candidate chunks (row numbers of the table) for a region; see the module's docstring."""

    __slots__ = ("shape", "axis", "flat", "rows", "lo", "reach")

    def __init__(self, shape: Sequence[int], table: ChunkColumns) -> None:
        self.shape = tuple(shape)
        n = len(table)
        flat_col = table.flat
        all_flat = flat_col is not None and n > 0 and all(flat_col)
        mixed = flat_col is not None and not all_flat and any(flat_col)
        self.flat = all_flat
        self.axis: int | None = None  # None: every distinct chunk is a candidate (mixed tables, 0-d tensors)
        offs, sizes = table.offsets, table.sizes
        first: dict[tuple, int] = {}  # one row per distinct region: the first in table order
        for i, key in enumerate(zip(offs, sizes) if flat_col is None else zip(offs, sizes, flat_col)):
            first.setdefault(key, i)
        if mixed or n == 0 or (not all_flat and not self.shape):
            self.rows = array("q", first.values())
            self.lo = self.reach = array("q")
            return
        self.axis = 0 if all_flat else _key_axis(self.shape, offs, sizes)
        starts = [o[self.axis] for o in offs]
        ends = [o[self.axis] + z[self.axis] for o, z in zip(offs, sizes)]
        keep = sorted(first.values(), key=lambda i: (starts[i], i))
        self.rows = array("q", keep)
        self.lo = array("q", (starts[i] for i in keep))
        self.reach = array("q", accumulate((ends[i] for i in keep), max))

    def __len__(self) -> int:
        """Distinct chunks indexed (every row for a table that is not indexed)."""
        return len(self.rows)

    def key_interval(self, region: Region) -> tuple[int, int]:
        """``[a, b)`` on the key axis: every element of ``region`` lies in it."""
        if self.flat:
            if region.flat is not None:
                return region.flat[0], region.flat[0] + region.flat[1]
            box = region.box
            assert box is not None
            return box_flat_span(box, row_major_strides(self.shape)) if box.numel else (0, 0)
        k = self.axis
        assert k is not None
        if region.box is not None:
            return region.box.offsets[k], region.box.offsets[k] + region.box.sizes[k]
        assert region.flat is not None
        start, length = region.flat
        if length == 0:
            return 0, 0
        strides = row_major_strides(self.shape)
        end = start + length - 1  # last element
        outer = strides[k - 1] if k > 0 else prod(self.shape)  # elements per index of the dimension above k
        if start // outer != end // outer:  # spans more than one slab of the dimension above: all of axis k
            return 0, self.shape[k]
        return (start % outer) // strides[k], (end % outer) // strides[k] + 1

    def candidates(self, region: Region) -> Sequence[int]:
        """Row numbers of the table whose chunks may meet ``region``, in key order (each region's first
        replica only). Work: two bisections, O(log n), and a slice of the candidates."""
        start, stop = self.span(region)
        return self.rows[start:stop]

    def count(self, region: Region) -> int:
        """How many candidates ``region`` has, without listing them: O(log n)."""
        start, stop = self.span(region)
        return stop - start

    def span(self, region: Region) -> tuple[int, int]:
        """Where ``region``'s candidates lie in :attr:`rows`."""
        if self.axis is None:
            return 0, len(self.rows)
        a, b = self.key_interval(region)
        if b <= a:
            return 0, 0
        start = bisect_right(self.reach, a)
        return start, max(start, bisect_left(self.lo, b))


def _key_axis(shape: tuple[int, ...], offs: Sequence[tuple[int, ...]], sizes: Sequence[tuple[int, ...]]) -> int:
    """The outermost dimension along which some chunk does not span the whole tensor (0 when every
    chunk is the whole tensor)."""
    for k, extent in enumerate(shape):
        if any(o[k] != 0 or z[k] != extent for o, z in zip(offs, sizes)):
            return k
    return 0
