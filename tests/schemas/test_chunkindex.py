"""The interval index of a tensor's chunks (``ckptd_schemas.chunkindex``) against brute force, and its
cost: what one rank's region visits does not grow with the world size."""

from __future__ import annotations

from bisect import bisect_left
from math import prod

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd_schemas.chunkindex import ChunkIndex
from ckptd_schemas.chunktable import ChunkColumns
from ckptd_schemas.geometry import Box, Region, intersect_regions

from .test_geometry import boxes_in, flat_in, shapes

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _table(regions: list[Region]) -> ChunkColumns:
    flat = [r.flat is not None for r in regions]
    return ChunkColumns(
        rank=list(range(len(regions))), flat=flat if any(flat) else None,
        offsets=[(r.flat[0],) if r.flat else r.box.offsets for r in regions],
        sizes=[(r.flat[1],) if r.flat else r.box.sizes for r in regions],
        file=["f.bin"] * len(regions), offset=[0] * len(regions), length=[0] * len(regions),
        codec=None, xxh3=["0" * 16] * len(regions))


def _key(r: Region) -> tuple:
    return ("flat", r.flat) if r.flat is not None else ("box", r.box)


@st.composite
def tables(draw):
    shape = draw(shapes(max_ndim=3))
    kind = draw(st.sampled_from(["box", "flat", "mixed"]))
    regions = []
    for _ in range(draw(st.integers(0, 12))):
        use_flat = kind == "flat" or (kind == "mixed" and draw(st.booleans()))
        if use_flat:
            s, n = draw(flat_in(shape))
            regions.append(Region(flat=(s, n)))
        else:
            regions.append(Region(box=draw(boxes_in(shape))))
    if regions and draw(st.booleans()):  # replicas: the same region again, later in the table
        regions += [regions[i] for i in draw(st.lists(st.integers(0, len(regions) - 1), max_size=4))]
    want = Region(box=draw(boxes_in(shape))) if draw(st.booleans()) else Region(flat=draw(flat_in(shape)))
    return shape, regions, want


@FAST
@given(tables())
def test_candidates_hold_every_distinct_chunk_that_meets_the_region(case) -> None:
    shape, regions, want = case
    index = ChunkIndex(shape, _table(regions))
    got = list(index.candidates(want))
    assert index.count(want) == len(got)
    first: dict[tuple, int] = {}
    for i, r in enumerate(regions):
        first.setdefault(_key(r), i)
    assert len(set(got)) == len(got), "a chunk listed twice"
    assert set(got) <= set(first.values()), "a replica other than the first in table order"
    meets = {i for i in first.values() if intersect_regions(shape, regions[i], want)}
    assert meets <= set(got), "a chunk that meets the region is missing"
    assert len(index) == len(first)


@FAST
@given(st.integers(1, 6), st.integers(1, 64), st.integers(0, 200), st.booleans())
def test_bands_yield_exactly_the_chunks_they_meet(cols: int, world: int, seed: int, flat: bool) -> None:
    """Row bands (FSDP) and flat ranges (ZeRO): the candidates are the hits, nothing more."""
    rows = world + seed % 7
    bounds = sorted({0, rows, *((seed * (k + 3)) % (rows + 1) for k in range(world - 1))})
    if flat:
        regions = [Region(flat=(a * cols, (b - a) * cols)) for a, b in zip(bounds, bounds[1:])]
    else:
        regions = [Region(box=Box((a, 0), (b - a, cols))) for a, b in zip(bounds, bounds[1:])]
    index = ChunkIndex((rows, cols), _table(regions))
    # brute force, row by row: a band is the union of its rows, so a chunk meets it where it meets one of them
    met = [[y for y in range(rows) if intersect_regions((rows, cols), r, Region(box=Box((y, 0), (1, cols))))]
           for r in regions]
    for a in range(rows):
        for b in range(a + 1, rows + 1):
            want = Region(box=Box((a, 0), (b - a, cols)))
            hits = [i for i, ys in enumerate(met) if bisect_left(ys, a) < len(ys) and ys[bisect_left(ys, a)] < b]
            assert sorted(index.candidates(want)) == hits


def test_a_ranks_region_visits_the_same_few_chunks_at_any_world_size() -> None:
    """What one rank's slice costs: 64 or 100,000 ranks, FSDP bands, 2-D grids (dp x tp) and
    ``Shard(1)``: the candidates are the chunks the slice meets, never a scan of the world."""
    for world in (64, 100_000):
        rows, cols = 2 * world, 8
        bands = _table([Region(box=Box((2 * r, 0), (2, cols))) for r in range(world)])
        index = ChunkIndex((rows, cols), bands)
        assert len(index.candidates(Region(box=Box((2 * 7, 0), (2, cols))))) == 1
        assert len(index.candidates(Region(box=Box((2 * 7 + 1, 0), (2, cols))))) == 2  # a reshard's slice
        assert len(index.candidates(Region(flat=(cols * 2 * 9, cols)))) == 1
        columns = _table([Region(box=Box((0, r), (8, 1))) for r in range(world)])  # Shard(1)
        assert len(ChunkIndex((8, world), columns).candidates(Region(box=Box((0, 5), (8, 1))))) == 1
        tp = 4
        grid = _table([Region(box=Box((2 * (r // tp), r % tp), (2, 1))) for r in range(world)])
        got = ChunkIndex((2 * world // tp, tp), grid).candidates(Region(box=Box((2 * 3, 1), (2, 1))))
        assert len(got) == tp  # the band's tp chunks, filtered exactly by the caller
        flat = _table([Region(flat=(4 * r, 4)) for r in range(world)])
        assert len(ChunkIndex((world, 4), flat).candidates(Region(box=Box((11, 0), (1, 4))))) == 1


def test_replicas_of_every_rank_are_one_candidate() -> None:
    """A tensor every rank wrote whole (HSDP replicas, a replicated bias) is one candidate, not R."""
    regions = [Region(box=Box((0,), (16,)))] * 10_000
    index = ChunkIndex((16,), _table(regions))
    assert list(index.candidates(Region(box=Box((3,), (2,))))) == [0]
    assert prod(index.shape) == 16
