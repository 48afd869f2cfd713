"""``ckptd_schemas.chunks``: where a piece of a tensor is stored, and what a chunk refuses to describe.

A location's file name is a storage path (no ``..``, ``/``, hidden names), its digest 16 lowercase hex
digits, its offsets non-negative and bounded; a raw chunk stores exactly the bytes it decodes to. A
box chunk and a flat chunk give their region and element count; the ``kind`` field picks the model.
Pure: no I/O.
"""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from ckptd_schemas.chunks import BoxChunk, Chunk, FlatChunk, Location
from ckptd_schemas.geometry import Box, Region

H = "0123456789abcdef"


def loc(**over) -> Location:
    kw = dict(file="r000000-0000.bin", offset=0, length=48, raw_length=48, xxh3=H)
    kw.update(over)
    return Location(**kw)


def _refused(field: str, **over) -> str:
    with pytest.raises(ValidationError) as info:
        loc(**over)
    assert {e["loc"][0] for e in info.value.errors()} == {field}, info.value.errors()
    return str(info.value)


def test_a_raw_chunk_stores_exactly_what_it_decodes_to():
    with pytest.raises(ValidationError) as info:
        loc(length=40, raw_length=48)
    msg = str(info.value)
    assert "'r000000-0000.bin'" in msg and "length 40 != raw_length 48" in msg
    for codec in ("zstd", "blosc2"):  # compressed: fewer (or more) stored bytes than decoded
        assert loc(codec=codec, length=40).raw_length == 48
        assert loc(codec=codec, length=60).length == 60
    assert loc().codec == "raw"


@pytest.mark.parametrize("codec", ["lz4", "RAW", "", "gzip"])
def test_an_unknown_codec_is_refused(codec):
    _refused("codec", codec=codec, length=48)


@pytest.mark.parametrize("name", ["../r0.bin", "a/b", ".hidden", "/abs", "x\x00y", "", "a\\b", "é.bin",
                                  "a" * 129, "-lead"])
def test_a_file_name_that_is_not_a_plain_storage_name_is_refused(name):
    _refused("file", file=name)


@pytest.mark.parametrize("name", ["r000000-0000.bin", "A", "a" * 128, "x.y_z-0"])
def test_plain_file_names_are_taken(name):
    assert loc(file=name).file == name


@pytest.mark.parametrize("digest", ["0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0", "g" * 16, ""])
def test_a_digest_is_sixteen_lowercase_hex_digits(digest):
    _refused("xxh3", xxh3=digest)


@pytest.mark.parametrize("field", ["offset", "length", "raw_length"])
def test_byte_counts_are_non_negative_and_bounded(field):
    over = {"length": 48, "raw_length": 48, "codec": "zstd"}
    _refused(field, **{**over, field: -1})
    _refused(field, **{**over, field: 2**62 + 1})
    assert getattr(loc(**{**over, field: 2**62}), field) == 2**62


def test_a_location_is_frozen_and_takes_no_other_field():
    with pytest.raises(ValidationError):
        loc().offset = 8
    with pytest.raises(ValidationError) as info:
        loc(path="/etc/passwd")
    assert info.value.errors()[0]["loc"] == ("path",)


def test_box_and_flat_chunks_give_their_region_and_size():
    box = BoxChunk(rank=3, offsets=[2, 0], sizes=[3, 4], location=loc())
    assert box.kind == "box" and box.numel == 12
    assert box.region == Region(box=Box((2, 0), (3, 4)))
    scalar = BoxChunk(rank=0, offsets=[], sizes=[], location=loc(length=8, raw_length=8))
    assert scalar.numel == 1 and scalar.region == Region(box=Box((), ()))
    flat = FlatChunk(rank=1, start=10, length=7, location=loc(length=28, raw_length=28))
    assert flat.kind == "flat" and flat.numel == 7
    assert flat.region == Region(flat=(10, 7))


@pytest.mark.parametrize("field", ["rank", "start", "length"])
def test_a_flat_chunk_refuses_negative_numbers(field):
    kw = dict(rank=0, start=0, length=1, location=loc(length=4, raw_length=4))
    with pytest.raises(ValidationError) as info:
        FlatChunk(**{**kw, field: -1})
    assert info.value.errors()[0]["loc"][0] == field


def test_a_box_chunk_refuses_negative_offsets_and_sizes():
    with pytest.raises(ValidationError) as info:
        BoxChunk(rank=0, offsets=[0, -2], sizes=[1, 1], location=loc())
    assert info.value.errors()[0]["loc"][:2] == ("offsets", 1)
    with pytest.raises(ValidationError) as info:
        BoxChunk(rank=0, offsets=[0], sizes=[-1], location=loc())
    assert info.value.errors()[0]["loc"][:2] == ("sizes", 0)


def test_the_kind_field_picks_the_model():
    adapter = TypeAdapter(Chunk)
    where = loc(length=4, raw_length=4).model_dump()
    assert type(adapter.validate_python({"kind": "flat", "rank": 0, "start": 0, "length": 1,
                                         "location": where})) is FlatChunk
    assert type(adapter.validate_python({"kind": "box", "rank": 0, "offsets": [0], "sizes": [1],
                                         "location": where})) is BoxChunk
    for kind in ("ring", None):
        with pytest.raises(ValidationError):
            adapter.validate_python({"kind": kind, "rank": 0, "start": 0, "length": 1, "location": where})
    with pytest.raises(ValidationError):  # a flat chunk's fields under the box kind
        adapter.validate_python({"kind": "box", "rank": 0, "start": 0, "length": 1, "location": where})
    box = BoxChunk(rank=0, offsets=[0], sizes=[1], location=loc(length=4, raw_length=4))
    assert adapter.validate_json(box.model_dump_json()) == box
