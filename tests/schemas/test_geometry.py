"""Property tests of the pure geometry (``ckptd_schemas.geometry``) and read plans
(``ckptd_schemas.readplan``) against brute force.

Brute force is plain enumeration of element indices with numpy: a box's
elements are ``arange(numel).reshape(shape)[slices]`` (row-major order), a flat
range's are ``range(start, start + length)``. Shapes are small, 0-d to 4-d,
zero-size dimensions included.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from math import prod

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ckptd_schemas import (
    BoxChunk, FileEntry, FlatChunk, Location, Manifest, ReadRequest, TensorEntry, TilingError, Topology,
    plan_reads,
)
from ckptd_schemas.geometry import (
    Box, Region, check_tiling, flat_range_to_boxes, intersect_regions, is_row_major_contiguous,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# -- strategies ----------------------------------------------------------------

@st.composite
def shapes(draw, min_ndim: int = 0, max_ndim: int = 4, nonempty: bool = False):
    ndim = draw(st.integers(min_ndim, max_ndim))
    lo = 1 if nonempty else 0
    return tuple(draw(st.one_of(st.integers(1, 5), st.integers(lo, 5))) for _ in range(ndim))


@st.composite
def boxes_in(draw, shape, allow_empty: bool = True):
    offs, sizes = [], []
    for n in shape:
        if n == 0:
            offs.append(0)
            sizes.append(0)
            continue
        lo = draw(st.integers(0, n if allow_empty else n - 1))
        hi = draw(st.integers(lo if allow_empty else lo + 1, n))
        offs.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offs), tuple(sizes))


@st.composite
def flat_in(draw, shape):
    total = prod(shape)
    a = draw(st.integers(0, total))
    b = draw(st.integers(a, total))
    return a, b - a


@st.composite
def regions_in(draw, shape):
    if draw(st.booleans()):
        return Region(box=draw(boxes_in(shape)))
    return Region(flat=draw(flat_in(shape)))


# -- brute force ---------------------------------------------------------------


def box_elems(shape, box: Box) -> list[int]:
    """Flat indices of a box's elements, in row-major order of the box."""
    idx = np.arange(prod(shape), dtype=np.int64).reshape(shape)
    sl = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
    return idx[sl].ravel().tolist()


def region_elems(shape, region: Region) -> set[int]:
    if region.box is not None:
        return set(box_elems(shape, region.box))
    s, n = region.flat
    return set(range(s, s + n))


# -- flat_range_to_boxes ---------------------------------------------------------


@FAST
@given(st.data())
def test_flat_range_to_boxes_matches_brute_force(data):
    shape = data.draw(shapes())
    start, length = data.draw(flat_in(shape))
    boxes = flat_range_to_boxes(shape, start, length)
    ndim = len(shape)
    assert len(boxes) <= max(1, 2 * ndim - 1)
    got: list[int] = []
    for b in boxes:
        assert len(b.offsets) == len(b.sizes) == ndim
        assert b.numel > 0, "no empty boxes"
        assert Box.full(shape).contains(b)
        assert is_row_major_contiguous(b, shape), (shape, b)
        elems = box_elems(shape, b)
        assert elems == list(range(elems[0], elems[0] + len(elems))), "box is not one row-major run"
        got.extend(elems)
    # every element of the range exactly once, boxes in flat order
    assert got == list(range(start, start + length))


@FAST
@given(st.data())
def test_flat_range_to_boxes_refuses_outside(data):
    shape = data.draw(shapes())
    total = prod(shape)
    start = data.draw(st.integers(0, total + 3))
    length = data.draw(st.integers(total - start + 1, total + 5)) if start <= total else data.draw(st.integers(0, 3))
    with pytest.raises(ValueError):
        flat_range_to_boxes(shape, start, length)
    with pytest.raises(ValueError):
        flat_range_to_boxes(shape, -1, 1)


def test_flat_range_to_boxes_examples():
    assert flat_range_to_boxes((), 0, 1) == [Box((), ())]
    assert flat_range_to_boxes((), 0, 0) == []
    assert flat_range_to_boxes((3, 0, 2), 0, 0) == []
    assert flat_range_to_boxes((4, 5), 0, 20) == [Box((0, 0), (4, 5))]
    # head of row 0, rows 1-2, tail of row 3
    assert flat_range_to_boxes((4, 5), 3, 14) == [Box((0, 3), (1, 2)), Box((1, 0), (2, 5)), Box((3, 0), (1, 2))]
    # worst case for 3-d: 2 * 3 - 1 boxes
    assert len(flat_range_to_boxes((3, 3, 3), 1, 25)) == 5


@FAST
@given(st.data())
def test_is_row_major_contiguous_matches_brute_force(data):
    shape = data.draw(shapes(nonempty=True))
    box = data.draw(boxes_in(shape, allow_empty=False))
    elems = box_elems(shape, box)
    assert is_row_major_contiguous(box, shape) == (elems == list(range(elems[0], elems[0] + len(elems))))


# -- intersection ----------------------------------------------------------------


@FAST
@given(st.data())
def test_box_intersect_is_set_intersection(data):
    shape = data.draw(shapes())
    a = data.draw(boxes_in(shape))
    b = data.draw(boxes_in(shape))
    want = set(box_elems(shape, a)) & set(box_elems(shape, b))
    z = a.intersect(b)
    if not want:
        assert z is None
    else:
        assert z is not None and z.numel > 0
        assert set(box_elems(shape, z)) == want
        assert a.contains(z) and b.contains(z)
    assert (b.intersect(a) is None) == (z is None)


@FAST
@given(st.data())
def test_intersect_regions_is_set_intersection(data):
    shape = data.draw(shapes())
    kinds = data.draw(st.sampled_from(["box/box", "box/flat", "flat/box", "flat/flat"]))
    ka, kb = kinds.split("/")
    a = Region(box=data.draw(boxes_in(shape))) if ka == "box" else Region(flat=data.draw(flat_in(shape)))
    b = Region(box=data.draw(boxes_in(shape))) if kb == "box" else Region(flat=data.draw(flat_in(shape)))
    want = region_elems(shape, a) & region_elems(shape, b)
    got: list[int] = []
    for z in intersect_regions(shape, a, b):
        assert z.numel > 0
        assert Box.full(shape).contains(z)
        got.extend(box_elems(shape, z))
    assert len(got) == len(set(got)), "intersection boxes overlap"
    assert set(got) == want


# -- tiling ----------------------------------------------------------------------


@st.composite
def grid_tilings(draw, shape):
    """A grid partition: random cuts along each dimension (empty slabs now and then)."""
    per_dim = []
    for n in shape:
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=2)))
        edges = [0, *cuts, n]
        per_dim.append([(lo, hi - lo) for lo, hi in zip(edges, edges[1:])])
    out = []
    for cell in _product(per_dim):
        out.append(Region(box=Box(tuple(c[0] for c in cell), tuple(c[1] for c in cell))))
    return out


def _product(lists):
    if not lists:
        return [()]
    return [(x, *rest) for x in lists[0] for rest in _product(lists[1:])]


@st.composite
def flat_tilings(draw, shape):
    total = prod(shape)
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=6)))
    edges = [0, *cuts, total]
    return [Region(flat=(lo, hi - lo)) for lo, hi in zip(edges, edges[1:])]


@st.composite
def tilings(draw, shape):
    """Exact tilings as (region, rank, digest) pieces, possibly mixing boxes and flat ranges."""
    kind = draw(st.sampled_from(["grid", "flat", "flat-as-boxes"]))
    if kind == "grid":
        regions = draw(grid_tilings(shape))
    else:
        regions = draw(flat_tilings(shape))
        if kind == "flat-as-boxes":
            # express some flat pieces as their (row-major contiguous) boxes
            mixed = []
            for r in regions:
                if draw(st.booleans()):
                    mixed.extend(Region(box=b) for b in r.boxes(shape))
                else:
                    mixed.append(r)
            regions = mixed
    world = draw(st.integers(1, 8))
    pieces = [(r, draw(st.integers(0, world - 1)), f"d{i:015x}") for i, r in enumerate(regions)]
    return pieces


def _names_ranks(msg: str, ranks) -> bool:
    return all(re.search(rf"(?<![0-9]){r}(?![0-9])", msg) for r in ranks)


@FAST
@given(st.data())
def test_check_tiling_accepts_exact_tilings(data):
    shape = data.draw(shapes())
    pieces = data.draw(tilings(shape))
    # identical replicas with the same digest on other ranks are counted once
    replicas = data.draw(st.lists(st.sampled_from(pieces), max_size=4)) if pieces else []
    pieces = pieces + [(r, rank + 100, d) for r, rank, d in replicas]
    order = data.draw(st.permutations(range(len(pieces))))
    check_tiling("model.w", shape, [pieces[i] for i in order])


@FAST
@given(st.data())
def test_check_tiling_refuses_gaps(data):
    shape = data.draw(shapes(nonempty=True))
    pieces = [p for p in data.draw(tilings(shape)) if p[0].numel > 0]
    drop = data.draw(st.integers(0, len(pieces) - 1))
    rest = pieces[:drop] + pieces[drop + 1:]
    with pytest.raises(TilingError) as ei:
        check_tiling("model.layers.0.w", shape, rest)
    e = ei.value
    assert "'model.layers.0.w'" in e.message
    assert e.details["tensor"] == "model.layers.0.w"
    ranks = sorted({r for _, r, _ in rest})
    assert e.details["ranks"] == ranks
    assert _names_ranks(e.message, ranks), e.message
    assert e.details["covered"] == prod(shape) - pieces[drop][0].numel
    assert e.details["numel"] == prod(shape)


@FAST
@given(st.data())
def test_check_tiling_refuses_overlaps(data):
    shape = data.draw(shapes(nonempty=True))
    pieces = data.draw(tilings(shape))
    extra = data.draw(regions_in(shape))
    assume(extra.numel > 0)
    pieces = pieces + [(extra, 99, "e" * 16)]
    order = data.draw(st.permutations(range(len(pieces))))
    with pytest.raises(TilingError) as ei:
        check_tiling("optim.state.w.exp_avg", shape, [pieces[i] for i in order])
    e = ei.value
    assert "'optim.state.w.exp_avg'" in e.message
    assert e.details["tensor"] == "optim.state.w.exp_avg"
    assert 99 in e.details["ranks"] and len(e.details["ranks"]) <= 2
    assert _names_ranks(e.message, e.details["ranks"]), e.message


@FAST
@given(st.data())
def test_check_tiling_refuses_replicas_with_different_digests(data):
    shape = data.draw(shapes())
    pieces = [p for p in data.draw(tilings(shape)) if p[0].numel > 0]
    assume(pieces)
    region, rank, digest = data.draw(st.sampled_from(pieces))
    pieces = pieces + [(region, 77, "f" * 16)]
    with pytest.raises(TilingError) as ei:
        check_tiling("model.emb", shape, pieces)
    e = ei.value
    assert "'model.emb'" in e.message
    assert 77 in e.details["ranks"]
    assert _names_ranks(e.message, e.details["ranks"]), e.message
    assert rank in e.details["ranks"]


@FAST
@given(st.data())
def test_check_tiling_refuses_out_of_bounds(data):
    shape = data.draw(shapes(min_ndim=1))
    pieces = data.draw(tilings(shape))
    d = data.draw(st.integers(0, len(shape) - 1))
    offs = [data.draw(st.integers(0, max(0, n - 1))) for n in shape]
    sizes = [data.draw(st.integers(1, 3)) for _ in shape]
    sizes[d] = shape[d] - offs[d] + data.draw(st.integers(1, 3))  # sticks out along dim d
    bad = Region(box=Box(tuple(offs), tuple(sizes)))
    pieces = pieces + [(bad, 55, "a" * 16)]
    with pytest.raises(TilingError) as ei:
        check_tiling("model.out", shape, pieces)
    e = ei.value
    assert "'model.out'" in e.message and "55" in e.message
    assert e.details["ranks"] == [55]


@pytest.mark.parametrize("shape,region", [
    ((4, 4), Region(box=Box((0,), (4,)))),                 # wrong ndim
    ((4, 4), Region(box=Box((0, 0, 0), (4, 4, 1)))),
    ((4, 4), Region(flat=(10, 7))),                         # flat range past the end
    ((), Region(flat=(0, 2))),
    ((3, 0), Region(flat=(0, 1))),
])
def test_check_tiling_refuses_malformed_regions(shape, region):
    pieces = [(Region(box=Box.full(shape)), 0, "0" * 16), (region, 3, "1" * 16)]
    with pytest.raises(TilingError) as ei:
        check_tiling("model.bad", shape, pieces)
    assert "'model.bad'" in ei.value.message and "3" in ei.value.message
    assert 3 in ei.value.details["ranks"]


def test_check_tiling_zero_d_and_empty():
    check_tiling("s", (), [(Region(box=Box((), ())), 0, "0" * 16)])
    check_tiling("s", (), [(Region(flat=(0, 1)), 0, "0" * 16), (Region(box=Box((), ())), 1, "0" * 16)])
    check_tiling("empty", (3, 0), [])
    with pytest.raises(TilingError, match="'s'"):
        check_tiling("s", (), [])
    with pytest.raises(TilingError, match="'s'"):
        check_tiling("s", (), [(Region(box=Box((), ())), 0, "0" * 16), (Region(flat=(0, 1)), 1, "1" * 16)])


def test_check_tiling_gap_message_names_missing_range():
    shape = (4, 6)
    pieces = [(Region(flat=(0, 10)), 0, "0" * 16), (Region(flat=(14, 10)), 2, "2" * 16)]
    with pytest.raises(TilingError) as ei:
        check_tiling("model.w", shape, pieces)
    assert "[10, 14)" in ei.value.message
    assert ei.value.details["ranks"] == [0, 2]


# -- read plans ----------------------------------------------------------------

# dtypes by item size; the data is handled as unsigned integers of that size
DTYPES = {"uint8": 1, "int8": 1, "bool": 1, "float16": 2, "bfloat16": 2, "int16": 2,
          "float32": 4, "int32": 4, "float64": 8, "int64": 8, "complex64": 8}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
BLOCK = 4096


def xxh(b: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(b)


@st.composite
def checkpoints(draw):
    """(manifest, {tensor name: numpy array}, {file name: bytes}) with real bytes and digests."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ntensors = draw(st.integers(1, 3))
    nfiles = draw(st.integers(1, 3))
    world = draw(st.integers(1, 4))
    fnames = [f"data-r{i}-0.bin" for i in range(nfiles)]
    buffers = {f: bytearray(rng.integers(0, 256, draw(st.integers(0, 300)), dtype=np.uint8).tobytes()) for f in fnames}
    arrays, tensors = {}, []
    for ti in range(ntensors):
        name = f"model.layers.{ti}.weight"
        shape = draw(shapes())
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        size = DTYPES[dtype]
        arr = np.asarray(rng.integers(0, np.iinfo(UINT[size]).max, size=shape, dtype=UINT[size], endpoint=True))
        arrays[name] = arr
        kind = draw(st.sampled_from(["box", "flat"]))
        regions = draw(grid_tilings(shape)) if kind == "box" else draw(flat_tilings(shape))
        # a replica (same region, same bytes) elsewhere, which plans must read only once
        if regions and draw(st.booleans()):
            regions = regions + [draw(st.sampled_from(regions))]
        chunks = []
        for region in regions:
            if region.box is not None:
                b = region.box
                raw = np.ascontiguousarray(arr[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))]).tobytes()
            else:
                s, n = region.flat
                raw = arr.reshape(-1)[s:s + n].tobytes()
            codec = draw(st.sampled_from(["raw", "raw", "zstd"]))
            stored = raw if codec == "raw" else zstandard.ZstdCompressor().compress(raw)
            f = draw(st.sampled_from(fnames))
            buf = buffers[f]
            buf += rng.integers(0, 256, draw(st.sampled_from([0, 0, 7, 100, 5000])), dtype=np.uint8).tobytes()
            loc = Location(file=f, offset=len(buf), length=len(stored), codec=codec, raw_length=len(raw),
                           xxh3=xxh(stored))
            buf += stored
            rank = draw(st.integers(0, world - 1))
            if region.box is not None:
                chunks.append(BoxChunk(rank=rank, offsets=list(region.box.offsets), sizes=list(region.box.sizes),
                                       location=loc))
            else:
                chunks.append(FlatChunk(rank=rank, start=region.flat[0], length=region.flat[1], location=loc))
        tensors.append(TensorEntry(name=name, shape=list(shape), dtype=dtype, group="model", chunks=chunks))
    for f in fnames:
        buffers[f] += rng.integers(0, 256, draw(st.integers(0, 5000)), dtype=np.uint8).tobytes()
    files = {}
    for f, buf in buffers.items():
        data = bytes(buf)
        files[f] = FileEntry(size=len(data), xxh3=xxh(data), block_size=BLOCK,
                             blocks=[xxh(data[i:i + BLOCK]) for i in range(0, len(data), BLOCK)])
    m = Manifest(run="gpt", name="1000", step=1000, session="s1", created_at=datetime(2024, 1, 1, tzinfo=timezone.utc),
                 topology=Topology(world_size=world), tensors=tensors, files=files)
    for t in m.tensors:
        # sanity: the generated chunks tile the tensor (replicas keyed by region, as codecs may differ)
        check_tiling(t.name, t.shape, [(c.region, c.rank, repr(c.region)) for c in t.chunks])
    return m, arrays, {f: bytes(b) for f, b in buffers.items()}


@st.composite
def requests_for(draw, manifest):
    reqs = []
    for _ in range(draw(st.integers(1, 4))):
        t = draw(st.sampled_from(manifest.tensors))
        shape = tuple(t.shape)
        kind = draw(st.sampled_from(["box", "flat", "all"]))
        if kind == "box":
            b = draw(boxes_in(shape))
            reqs.append(ReadRequest(name=t.name, offsets=list(b.offsets), sizes=list(b.sizes)))
        elif kind == "flat":
            s, n = draw(flat_in(shape))
            reqs.append(ReadRequest(name=t.name, flat_start=s, flat_length=n))
        else:
            reqs.append(ReadRequest(name=t.name))
    return reqs


def _requested_mask(shape, req: ReadRequest) -> np.ndarray:
    mask = np.zeros(prod(shape), dtype=bool)
    if req.offsets is not None:
        mask[box_elems(shape, Box(tuple(req.offsets), tuple(req.sizes)))] = True
    elif req.flat_start is not None:
        mask[req.flat_start:req.flat_start + req.flat_length] = True
    else:
        mask[:] = True
    return mask.reshape(shape)


def execute_plan(plan, manifest, files, requests):
    """Run a plan the way a reader does; returns per request (values, times each element was written)."""
    fetched = []
    for f in plan.fetches:
        data = files[f.file][f.start:f.end]
        assert len(data) == f.end - f.start
        fetched.append(data)
    outs = []
    for req in requests:
        t = manifest.tensor(req.name)
        size = DTYPES[t.dtype]
        outs.append((np.zeros(t.shape, dtype=UINT[size]), np.zeros(t.shape, dtype=np.int64)))
    for c in plan.copies:
        t = manifest.tensor(c.tensor)
        assert c.dtype == t.dtype and requests[c.request].name == c.tensor
        size = DTYPES[t.dtype]
        data = fetched[c.fetch]
        assert 0 <= c.byte_start and c.byte_start + c.byte_length <= len(data)
        piece = data[c.byte_start:c.byte_start + c.byte_length]
        if c.codec == "zstd":
            assert xxh(piece) == c.chunk_xxh3  # the whole frame is fetched: its digest checks
            raw = zstandard.ZstdDecompressor().decompress(piece)
        else:
            raw = piece
        assert len(raw) == c.npos * size
        elems = np.frombuffer(raw, dtype=UINT[size])
        out, count = outs[c.request]
        for offsets, sizes in c.regions:
            assert len(offsets) == len(sizes) == len(t.shape)
            ind = np.indices(sizes, dtype=np.int64) if sizes else np.zeros((0,), dtype=np.int64)
            pos = np.full(sizes, -c.base - c.pos0, dtype=np.int64)
            for d, (o, st_) in enumerate(zip(offsets, c.strides)):
                pos += (ind[d] + o) * st_
            assert pos.size == 0 or (pos.min() >= 0 and pos.max() < c.npos), "copy reads outside its chunk bytes"
            sl = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            out[sl] = elems[pos]
            count[sl] += 1
    return outs


@SLOW
@given(st.data())
def test_plan_reads_reconstructs_requested_elements(data):
    manifest, arrays, files = data.draw(checkpoints())
    requests = data.draw(requests_for(manifest))
    gap = data.draw(st.sampled_from([0, 1, 4096, 1 << 20]))
    plan = plan_reads(manifest, requests, coalesce_gap=gap)

    # fetches: block-aligned, inside the file, listing the right block digests
    for f in plan.fetches:
        fe = manifest.files[f.file]
        assert f.block_size == fe.block_size == BLOCK
        assert 0 <= f.start < f.end <= fe.size
        assert f.start % BLOCK == 0
        assert f.end % BLOCK == 0 or f.end == fe.size
        assert f.first_block == f.start // BLOCK
        body = files[f.file][f.start:f.end]
        want = [xxh(body[i:i + BLOCK]) for i in range(0, len(body), BLOCK)]
        assert f.blocks == want
        assert f.blocks == fe.blocks[f.first_block:f.first_block + len(want)]
    by_file: dict[str, list[tuple[int, int]]] = {}
    for f in plan.fetches:
        by_file.setdefault(f.file, []).append((f.start, f.end))
    for spans in by_file.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"overlapping fetches {spans}"

    outs = execute_plan(plan, manifest, files, requests)
    for req, (out, count) in zip(requests, outs):
        t = manifest.tensor(req.name)
        mask = _requested_mask(tuple(t.shape), req)
        assert np.array_equal(count, mask.astype(np.int64)), "each requested element exactly once, nothing else"
        assert np.array_equal(out[mask], arrays[req.name][mask])
    assert plan.bytes_to_read == sum(f.end - f.start for f in plan.fetches)


@SLOW
@given(st.data())
def test_plan_reads_full_tensor_reads_no_more_than_needed(data):
    """Without coalescing, a full-tensor plan reads each chunk's blocks and nothing far away."""
    manifest, arrays, files = data.draw(checkpoints())
    t = data.draw(st.sampled_from(manifest.tensors))
    plan = plan_reads(manifest, [ReadRequest(name=t.name)], coalesce_gap=0)
    seen, needed = set(), {}
    for c in t.chunks:
        key = (c.kind, tuple(getattr(c, "offsets", ())), tuple(getattr(c, "sizes", ())), getattr(c, "start", 0))
        if c.numel == 0 or key in seen:
            continue
        seen.add(key)
        loc = c.location
        blocks = needed.setdefault(loc.file, set())
        blocks.update(range(loc.offset // BLOCK, -(-(loc.offset + loc.length) // BLOCK)))
    got: dict[str, set[int]] = {}
    for f in plan.fetches:
        got.setdefault(f.file, set()).update(range(f.first_block, f.first_block + len(f.blocks)))
    assert got == needed


def test_plan_reads_refuses_bad_requests():
    from ckptd_schemas import StateDictMismatch

    raw = np.arange(12, dtype=np.float32).tobytes()
    loc = Location(file="f0", offset=0, length=48, raw_length=48, xxh3=xxh(raw))
    t = TensorEntry(name="model.w", shape=[3, 4], dtype="float32", group="model",
                    chunks=[BoxChunk(rank=0, offsets=[0, 0], sizes=[3, 4], location=loc)])
    m = Manifest(run="gpt", name="1", session="s", created_at=datetime(2024, 1, 1, tzinfo=timezone.utc),
                 topology=Topology(world_size=1), tensors=[t],
                 files={"f0": FileEntry(size=48, xxh3=xxh(raw), block_size=BLOCK, blocks=[xxh(raw)])})
    for req in [ReadRequest(name="model.w", offsets=[0, 0], sizes=[4, 4]),
                ReadRequest(name="model.w", offsets=[0], sizes=[3]),
                ReadRequest(name="model.w", flat_start=5, flat_length=8),
                ReadRequest(name="model.missing")]:
        with pytest.raises(StateDictMismatch) as ei:
            plan_reads(m, [req])
        assert repr(req.name) in ei.value.message
    with pytest.raises(ValueError):
        ReadRequest(name="model.w", offsets=[0, 0], sizes=[1, 1], flat_start=0, flat_length=1)
    with pytest.raises(ValueError):
        ReadRequest(name="model.w", offsets=[0, 0])
    with pytest.raises(ValueError):
        ReadRequest(name="model.w", flat_start=0)
