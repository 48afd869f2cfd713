"""Chunks as columns (format 2): the whole-column checks agree with the per-chunk ones, the
format round-trips, any other manifest format is refused, and the commit's helpers (index cache, GC pause)
do what they promise.

The reference for every fast path is the code it replaces: ``check_tiling`` over
``Region`` objects (itself property-tested against brute force in test_geometry)
and a plain per-chunk bounds loop.
"""

from __future__ import annotations

import gc
import json
import threading
from datetime import datetime, timezone
from math import prod

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ckptd.store.gcpause import gc_paused
from ckptd.store.index_cache import PARSED_PER_RAW, IndexCache
from ckptd.store.merge import merge_indexes
from ckptd_schemas import (
    BoxChunk, ChunkColumns, FileEntry, FlatChunk, InvalidIndex, Location, Manifest, RankIndex, TensorEntry,
    TilingError, check_tiling,
)
from ckptd_schemas.chunktable import check_columns, check_columns_tiling, columns_of

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _loc(n: int, i: int = 0, codec: str = "raw") -> Location:
    stored = n if codec == "raw" else max(1, n // 2)
    return Location(file="r000000-0000.bin", offset=64 * i, length=stored, codec=codec, raw_length=n,
                    xxh3=f"{i:016x}")


# -- strategies: band layouts (the fast path) and anything else -------------------------------------

@st.composite
def band_chunks(draw, shape, kind):
    """Chunks that cut one dimension (or the flattening) into bands; maybe with a gap, an overlap,
    a replica or an out-of-range band, and in any order."""
    extent = prod(shape) if kind == "flat" else (shape[0] if shape else 1)
    cuts = sorted(draw(st.lists(st.integers(0, extent), max_size=5)))
    edges = [0, *cuts, extent]
    bands = [(lo, hi - lo) for lo, hi in zip(edges, edges[1:])]
    fault = draw(st.sampled_from(["none", "none", "gap", "overlap", "replica", "outside"]))
    if fault == "gap" and bands:
        bands.pop(draw(st.integers(0, len(bands) - 1)))
    elif fault == "overlap" and extent:
        lo = draw(st.integers(0, extent - 1))
        bands.append((lo, 1))
    elif fault == "replica" and bands:
        bands.append(bands[draw(st.integers(0, len(bands) - 1))])
    elif fault == "outside":
        bands.append((extent, 1))
    bands = draw(st.permutations(bands))
    chunks = []
    for i, (lo, n) in enumerate(bands):
        rank = draw(st.integers(0, 7))
        if kind == "flat":
            chunks.append(FlatChunk(rank=rank, start=lo, length=n, location=_loc(4 * n, i)))
        else:
            offs = [lo, *([0] * (len(shape) - 1))] if shape else []
            sizes = [n, *shape[1:]] if shape else []
            chunks.append(BoxChunk(rank=rank, offsets=offs, sizes=sizes, location=_loc(4 * prod(sizes), i)))
    return chunks


def _reference(name, shape, chunks):
    """What the commit did before columns: bounds per chunk, then check_tiling over regions."""
    total = prod(shape)
    for c in chunks:
        if c.kind == "flat":
            if c.start + c.length > total:
                raise ValueError("outside")
        elif len(c.offsets) != len(shape) or any(o + z > d for o, z, d in zip(c.offsets, c.sizes, shape)):
            raise ValueError("outside")
    check_tiling(name, shape, [(c.region, c.rank, c.location.xxh3) for c in chunks])


def _columns(shape, chunks) -> ChunkColumns:
    return ChunkColumns.model_construct(tensor=None, **columns_of(chunks, "float32", name="w"))


@FAST
@given(st.data())
def test_column_checks_agree_with_the_per_chunk_reference(data):
    ndim = data.draw(st.integers(0, 3))
    shape = [data.draw(st.integers(0, 5)) for _ in range(ndim)]
    kind = data.draw(st.sampled_from(["box", "flat"]))
    chunks = data.draw(band_chunks(shape, kind))
    table = _columns(shape, chunks)
    try:
        _reference("model.w", shape, chunks)
        want = None
    except (ValueError, TilingError) as e:
        want = type(e)
    try:
        dims = check_columns("model.w", shape, "float32", 4, table)
        check_columns_tiling("model.w", shape, table, dims)
        got = None
    except (ValueError, TilingError) as e:
        got = type(e)
        assert "'model.w'" in str(e)
    assert got is want


@FAST
@given(st.data())
def test_materialize_round_trips(data):
    shape = [data.draw(st.integers(1, 6)) for _ in range(data.draw(st.integers(1, 3)))]
    chunks = data.draw(band_chunks(shape, data.draw(st.sampled_from(["box", "flat"]))))
    codecs = data.draw(st.lists(st.sampled_from(["raw", "zstd"]), min_size=len(chunks), max_size=len(chunks)))
    chunks = [c.model_copy(update={"location": _loc(c.location.raw_length, i, codec)})
              for i, (c, codec) in enumerate(zip(chunks, codecs))]
    table = ChunkColumns(**columns_of(chunks, "float32", name="w"))
    assert table.materialize(4) == chunks
    assert (table.codec is None) == all(c == "raw" for c in codecs)


def test_raw_length_is_implied_and_checked():
    loc = Location(file="a.bin", offset=0, length=48, raw_length=48, xxh3="0" * 16)
    t = TensorEntry(name="m.w", shape=[3, 4], dtype="float32", group="m",
                    chunks=[BoxChunk(rank=0, offsets=[0, 0], sizes=[3, 4], location=loc)])
    doc = json.loads(t.model_dump_json())
    assert "raw_length" not in json.dumps(doc) and doc["table"]["length"] == [48]
    doc["table"]["length"] = [40]  # a raw chunk must store numel x itemsize bytes
    with pytest.raises(ValidationError, match=r"'m.w'.*raw_length 40 != 12 elements x 4 bytes"):
        TensorEntry.model_validate(doc)


def test_hostile_columns_are_refused_with_the_tensor_named():
    loc = Location(file="a.bin", offset=0, length=48, raw_length=48, xxh3="0" * 16)
    t = TensorEntry(name="m.w", shape=[3, 4], dtype="float32", group="m",
                    chunks=[BoxChunk(rank=0, offsets=[0, 0], sizes=[3, 4], location=loc)])
    good = json.loads(t.model_dump_json())
    cases = {
        "xxh3 has 1": lambda d: d["table"].update(offset=[0, 64]),
        "2-d shape": lambda d: d["table"].update(offsets=[[0]]),
        "outside global shape": lambda d: d["table"].update(offsets=[[1, 0]]),
        "rank column": lambda d: d["table"].update(rank=None),
    }
    for want, mutate in cases.items():
        doc = json.loads(json.dumps(good))
        mutate(doc)
        with pytest.raises(ValidationError, match=want):
            TensorEntry.model_validate(doc)


def _index(rank: int, world: int, flat_for: set[str] = frozenset()) -> RankIndex:
    """Rank ``rank`` of ``world``: row bands of a 2-d tensor, flat ranges of another, and a scalar
    only rank 0 writes; every other rank still lists it with no chunks."""
    f = f"r{rank:06d}-0000.bin"
    rows = 2
    w = TensorEntry(name="model.w", shape=[rows * world, 3], dtype="float32", group="model", chunks=[
        BoxChunk(rank=rank, offsets=[rows * rank, 0], sizes=[rows, 3], location=Location(
            file=f, offset=0, length=24, raw_length=24, xxh3=f"{rank:016x}"))])
    m = TensorEntry(name="optim.m", shape=[5 * world], dtype="bfloat16", group="optim", chunks=[
        FlatChunk(rank=rank, start=5 * rank, length=5, location=Location(
            file=f, offset=64, length=10, raw_length=10, xxh3=f"{rank + 100:016x}"))])
    s = TensorEntry(name="model.step", shape=[], dtype="int64", group="model", chunks=[
        BoxChunk(rank=0, offsets=[], sizes=[], location=Location(
            file=f, offset=128, length=8, raw_length=8, xxh3="a" * 16))] if rank == 0 else [])
    return RankIndex(rank=rank, world_size=world, tensors=[w, m, s], files=[f])


def _merge(indexes, world):
    files = {f"r{r:06d}-0000.bin": FileEntry(size=192, xxh3="0" * 16, block_size=4096, blocks=["0" * 16])
             for r in range(world)}
    return merge_indexes(run="r", name="1", session="s" * 8, step=1, created_at=datetime.now(timezone.utc),
                         world_size=world, indexes=indexes, files=files)


def test_rank_index_wire_form_round_trips_and_rebuilds_entries():
    ix = _index(2, 4)
    raw = ix.model_dump_json()
    assert '"tensors"' not in raw and '"chunk_table"' in raw
    back = RankIndex.model_validate_json(raw)
    assert back == ix
    assert [t.name for t in back.tensors] == ["model.w", "optim.m", "model.step"]
    assert back.tensors[0].chunks[0].offsets == [4, 0] and back.tensors[2].chunks == []
    back.check_chunks()
    doc = json.loads(raw)
    doc["chunk_table"]["tensor"] = [0, 7]
    with pytest.raises(ValidationError, match="does not index"):
        RankIndex.model_validate(doc)
    doc = json.loads(raw)
    doc["chunk_table"]["sizes"][0] = [9, 3]  # rows 4..13 of a 8-row tensor
    with pytest.raises(ValueError, match=r"'model.w'.*outside global shape"):
        RankIndex.model_validate(doc).check_chunks()


def test_merge_regroups_columns_by_tensor():
    world = 6
    m = _merge([_index(r, world) for r in reversed(range(world))], world)
    assert [t.name for t in m.tensors] == ["model.w", "optim.m", "model.step"]
    w = m.tensor("model.w")
    assert w.table.rank == list(range(world)) and w.table.flat is None
    assert [c.offsets for c in w.chunks] == [[2 * r, 0] for r in range(world)]
    assert m.tensor("optim.m").table.flat == [True] * world
    assert m.tensor("model.step").table.rank == [0]
    assert Manifest.model_validate_json(m.model_dump_json()) == m


def test_merge_refusals_name_tensor_and_ranks():
    world = 4
    ixs = [_index(r, world) for r in range(world)]
    bad = ixs[2].model_copy(update={"tensors": [
        ixs[2].tensors[0].model_copy(update={"shape": [99, 3]}), *ixs[2].tensors[1:]]})
    with pytest.raises(InvalidIndex, match=r"'model.w': rank 0 saved shape \[8, 3\].*rank 2 saved shape \[99, 3\]"):
        _merge([*ixs[:2], bad, ixs[3]], world)
    gap = ixs[1].model_copy(update={"tensors": [ixs[1].tensors[0].model_copy(update={"chunks": []}),
                                                *ixs[1].tensors[1:]]})
    with pytest.raises(TilingError, match=r"'model.w': chunks cover 18 of 24"):
        _merge([ixs[0], gap, *ixs[2:]], world)


def test_a_manifest_of_another_format_is_refused():
    """Format 2 (columns) is the only manifest format; a list-of-chunks manifest of format 1 is refused."""
    m = _merge([_index(r, 3) for r in range(3)], 3)
    doc = json.loads(m.model_dump_json())
    doc["format_version"] = 1
    for t, entry in zip(doc["tensors"], m.tensors):
        del t["table"]
        t["chunks"] = [json.loads(c.model_dump_json()) for c in entry.chunks]
    with pytest.raises(ValidationError, match="format_version"):
        Manifest.model_validate_json(json.dumps(doc))
    assert Manifest.model_validate_json(m.model_dump_json()).tensors == m.tensors


def test_index_cache_serves_one_incarnation_of_a_session_once_and_stays_bounded():
    ix = _index(0, 2)
    raw = ix.model_dump_json().encode()
    checked = (ix, {})
    key, first, again = "run/1/sessions/s/ranks/0.json", "2026-12-07T01:00:00+00:00", "2026-12-07T01:05:00+00:00"
    cache = IndexCache(max_bytes=3 * PARSED_PER_RAW * len(raw))
    cache.put(key, first, checked, len(raw))
    assert cache.state(key) == "pending"
    cache.note_stored(key)
    assert cache.state(key) == "stored"  # its write answered
    assert cache.take(key, again) is None  # the session opened again under its id: not the index it sent
    assert cache.state(key) is None  # dropped either way
    cache.put(key, first, checked, len(raw))
    assert cache.take(key, first) is checked
    assert cache.take(key, first) is None  # taken once
    for r in range(5):
        cache.put(f"run/1/sessions/s/ranks/{r}.json", first, checked, len(raw))
    assert cache.take(key, first) is None  # evicted, oldest first
    assert cache.take("run/1/sessions/s/ranks/4.json", first) is checked
    # A received file's records: the same rule (one incarnation, taken once, dropped with the session).
    records = (FileEntry(size=8, xxh3="0" * 16, block_size=4096, blocks=["0" * 16]), ("rows", "stamp"))
    digest_key = "run/1/sessions/s/digests/r000000-0000.bin"
    cache.put_records(digest_key, first, records)
    assert cache.take_records(digest_key, again) is None and cache.take_records(digest_key, first) is None
    cache.put_records(digest_key, first, records)
    assert cache.take_records(digest_key, first) is records and cache.take_records(digest_key, first) is None
    cache.put("run/1/sessions/s/ranks/4.json", first, checked, len(raw))
    cache.put_records(digest_key, first, records)
    cache.drop_under("run/1/sessions/s/")
    assert cache.take("run/1/sessions/s/ranks/4.json", first) is None
    assert cache.take_records(digest_key, first) is None


def test_gc_pause_nests_across_threads_and_restores():
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def hold():
        with gc_paused():
            inside.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    with gc_paused():
        t.start()
        inside.wait(5)
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other holder is still inside
    release.set()
    t.join(5)
    assert gc.isenabled()


def test_a_tensor_may_mix_box_and_flat_chunks():
    loc = lambda i, n: Location(file="a.bin", offset=64 * i, length=n, raw_length=n, xxh3=f"{i:016x}")  # noqa: E731
    t = TensorEntry(name="m.w", shape=[4, 4], dtype="float32", group="m", chunks=[
        BoxChunk(rank=0, offsets=[0, 0], sizes=[2, 4], location=loc(0, 32)),
        FlatChunk(rank=1, start=8, length=8, location=loc(1, 32))])
    assert t.table.flat == [False, True]
    check_columns_tiling(t.name, t.shape, t.table)
    with pytest.raises(ValidationError, match="flat range"):
        TensorEntry(name="m.w", shape=[4, 4], dtype="float32", group="m", chunks=[
            BoxChunk(rank=0, offsets=[0, 0], sizes=[2, 4], location=loc(0, 32)),
            FlatChunk(rank=1, start=10, length=8, location=loc(1, 32))])
