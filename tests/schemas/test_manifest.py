"""``ckptd_schemas.manifest``: what each model refuses at construction, and the field or entry it names.

A manifest is the one description a load trusts after its digest: a tensor entry needs its chunks
(once, as objects or as a table), a known dtype and a name; an object lives inline (JSON) or in a
file, never both; a topology's mesh and rank list agree with its world size; a file's block digests
cover its size, and a linked file names ``NAME/FILE``; a manifest has unique tensor names and every
location inside a file it lists. The byte counts (total, linked, unchanged) and the name lookup are
checked on a manifest with a linked file. Pure: no I/O.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from ckptd_schemas.chunks import BoxChunk, FlatChunk, Location
from ckptd_schemas.chunktable import ChunkColumns
from ckptd_schemas.manifest import FileEntry, Manifest, ObjectEntry, ParamGroup, RankInfo, TensorEntry, Topology

H = "0123456789abcdef"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _loc(file: str = "a.bin", offset: int = 0, length: int = 16, **kw) -> Location:
    return Location(file=file, offset=offset, length=length, raw_length=kw.pop("raw_length", length), xxh3=H, **kw)


def _tensor(name: str = "model.w", file: str = "a.bin", offset: int = 0) -> TensorEntry:
    return TensorEntry(name=name, shape=[2, 2], dtype="float32", group="model",
                       chunks=[BoxChunk(rank=0, offsets=[0, 0], sizes=[2, 2], location=_loc(file, offset))])


def _file(size: int, **kw) -> FileEntry:
    return FileEntry(size=size, xxh3=H, block_size=4096, blocks=[H] * -(-size // 4096), **kw)


def _manifest(**over) -> Manifest:
    kw = dict(run="gpt", name="7", session="s-1", created_at=T0, topology=Topology(world_size=1),
              tensors=[_tensor()], files={"a.bin": _file(64)})
    kw.update(over)
    return Manifest(**kw)


def _refusal(make) -> tuple[set, str]:
    with pytest.raises(ValidationError) as info:
        make()
    return {e["loc"][0] if e["loc"] else None for e in info.value.errors()}, str(info.value)


# -- TensorEntry ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["", "a\x00b", "n" * 1025])
def test_a_tensor_name_must_be_a_plain_non_empty_string(name):
    fields, _ = _refusal(lambda: _tensor(name=name))
    assert "name" in fields


def test_an_unknown_dtype_names_the_tensor():
    fields, msg = _refusal(lambda: TensorEntry(name="model.q", shape=[1], dtype="qint8", group="model", chunks=[]))
    assert fields == {"dtype"} and "tensor 'model.q': unknown dtype 'qint8'" in msg


def test_a_tensor_needs_its_chunks_once():
    _, msg = _refusal(lambda: TensorEntry(name="model.w", shape=[1], dtype="float32", group="model"))
    assert "tensor 'model.w': needs its chunks (table)" in msg
    table = _tensor().table
    _, msg = _refusal(lambda: TensorEntry(name="model.w", shape=[2, 2], dtype="float32", group="model",
                                          table=table, chunks=_tensor().chunks))
    assert "tensor 'model.w': give chunks or table, not both" in msg
    # a rank index's table (a tensor column, no rank column) is not a manifest's
    rank_index_table = ChunkColumns(**{**table.model_dump(), "rank": None, "tensor": [0]})
    fields, msg = _refusal(lambda: TensorEntry(name="model.w", shape=[2, 2], dtype="float32", group="model",
                                               table=rank_index_table))
    assert fields == {"table"} and "tensor 'model.w': the chunk table needs a rank column" in msg
    both = ChunkColumns(**{**table.model_dump(), "tensor": [0]})  # a rank column, and a tensor column too
    fields, msg = _refusal(lambda: TensorEntry(name="model.w", shape=[2, 2], dtype="float32", group="model",
                                               table=both))
    assert fields == {"table"} and "(and no tensor column)" in msg


def test_chunks_given_as_objects_or_as_a_table_are_the_same_entry():
    t = _tensor()
    again = TensorEntry.model_validate_json(t.model_dump_json())
    assert again == t and again.chunks == t.chunks and again.table.rank == [0]
    assert '"chunks"' not in t.model_dump_json()


def test_a_chunk_outside_the_tensor_names_it_and_the_rank():
    _, msg = _refusal(lambda: TensorEntry(name="model.x", shape=[4], dtype="float32", group="model", chunks=[
        FlatChunk(rank=3, start=2, length=3, location=_loc(length=12))]))
    assert "tensor 'model.x'" in msg and "rank 3" in msg and "[2, 5)" in msg


# -- ObjectEntry ---------------------------------------------------------------------------------------

def test_an_object_lives_inline_or_in_a_file_never_both():
    for enc in ("torch", "pickle"):
        _, msg = _refusal(lambda: ObjectEntry(name="rng", encoding=enc, value=None))
        assert f"object 'rng': {enc} objects need a location" in msg
    _, msg = _refusal(lambda: ObjectEntry(name="cfg", encoding="json", value=1, location=_loc()))
    assert "object 'cfg': json objects need" in msg
    fields, _ = _refusal(lambda: ObjectEntry(name="cfg", encoding="yaml", value=1))
    assert fields == {"encoding"}


def test_value_key_tells_equal_values_apart_from_different_ones():
    a = ObjectEntry(name="cfg", rank=0, encoding="json", value={"lr": 0.1})
    b = ObjectEntry(name="cfg", rank=1, encoding="json", value={"lr": 0.1})
    c = ObjectEntry(name="cfg", rank=2, encoding="json", value={"lr": 0.2})
    assert a.value_key() == b.value_key() != c.value_key()
    s1 = ObjectEntry(name="rng", rank=0, encoding="torch", location=_loc(offset=0))
    s2 = ObjectEntry(name="rng", rank=1, encoding="torch", location=_loc(offset=16))  # same digest elsewhere
    s3 = ObjectEntry(name="rng", rank=2, encoding="pickle", location=_loc(offset=16))
    assert s1.value_key() == s2.value_key() != s3.value_key()


# -- Topology ------------------------------------------------------------------------------------------

def test_topology_agrees_with_its_world_size():
    _, msg = _refusal(lambda: Topology(world_size=6, mesh={"dp": 2, "tp": 2}))
    assert "mesh {'dp': 2, 'tp': 2} has 4 ranks, world size is 6" in msg
    _, msg = _refusal(lambda: Topology(world_size=2, ranks=[RankInfo(rank=0), RankInfo(rank=0)]))
    assert "rank list [0, 0] is not a set of distinct ranks below 2" in msg
    _, msg = _refusal(lambda: Topology(world_size=2, ranks=[RankInfo(rank=0), RankInfo(rank=2)]))
    assert "rank list [0, 2]" in msg
    fields, _ = _refusal(lambda: Topology(world_size=0))
    assert fields == {"world_size"}
    fields, _ = _refusal(lambda: Topology(world_size=1, mesh={"dp": 0}))
    assert fields == {"mesh"}
    t = Topology(world_size=4, mesh={"dp": 2, "tp": 2},
                 ranks=[RankInfo(rank=r, coords={"dp": r // 2}) for r in range(4)])
    assert len(t.ranks) == 4


# -- FileEntry -----------------------------------------------------------------------------------------

def test_a_files_block_digests_cover_its_size():
    _, msg = _refusal(lambda: FileEntry(size=4097, xxh3=H, block_size=4096, blocks=[H]))
    assert "1 block digests for 4097 bytes in blocks of 4096" in msg
    assert _file(0).blocks == [] and len(_file(4097).blocks) == 2
    fields, _ = _refusal(lambda: FileEntry(size=1, xxh3=H, block_size=1024, blocks=[H]))
    assert fields == {"block_size"}


@pytest.mark.parametrize("linked", ["../x", "a", "a/b/c", "/a/b", "a/.b", ".a/b"])
def test_a_linked_file_names_name_slash_file(linked):
    fields, _ = _refusal(lambda: _file(1, linked=linked))
    assert fields == {"linked"}


def test_linked_is_absent_from_the_bytes_unless_set():
    plain = json.loads(_file(1).model_dump_json())
    assert "linked" not in plain
    assert json.loads(_file(1, linked="5/a.bin").model_dump_json())["linked"] == "5/a.bin"
    assert FileEntry.model_validate(plain) == _file(1)


# -- Manifest ------------------------------------------------------------------------------------------

def test_tensor_names_are_unique():
    _, msg = _refusal(lambda: _manifest(tensors=[_tensor(), _tensor(), _tensor("model.v")]))
    assert "tensor names appear more than once: ['model.w']" in msg


def test_every_location_is_inside_a_file_the_manifest_lists():
    _, msg = _refusal(lambda: _manifest(tensors=[_tensor(offset=56)]))
    assert "tensor 'model.w': bytes [56, 72) exceed file 'a.bin' of 64 bytes" in msg
    _manifest(tensors=[_tensor(offset=48)])  # [48, 64): the last bytes of the file
    _, msg = _refusal(lambda: _manifest(tensors=[_tensor(file="b.bin")]))
    assert "tensor 'model.w' refers to file 'b.bin', which is not in the manifest" in msg
    _, msg = _refusal(lambda: _manifest(objects=[ObjectEntry(name="rng", encoding="torch",
                                                             location=_loc(offset=60, length=8))]))
    assert "object 'rng': bytes [60, 68) exceed file 'a.bin' of 64 bytes" in msg


def test_the_manifest_takes_only_its_format_and_fields():
    fields, _ = _refusal(lambda: _manifest(format_version=1))
    assert fields == {"format_version"}
    fields, _ = _refusal(lambda: _manifest(surprise=1))
    assert fields == {"surprise"}
    fields, _ = _refusal(lambda: _manifest(files={"../a.bin": _file(64)}))
    assert fields == {"files"}
    fields, _ = _refusal(lambda: _manifest(step=-1))
    assert fields == {"step"}


def test_lookup_and_byte_counts_with_a_linked_file():
    m = _manifest(
        tensors=[_tensor("model.w", "a.bin"), _tensor("model.v", "ln.bin", 0), _tensor("model.u", "ln.bin", 16),
                 TensorEntry(name="model.split", shape=[2], dtype="float32", group="model", chunks=[
                     BoxChunk(rank=0, offsets=[0], sizes=[1], location=_loc("a.bin", 16, 4)),
                     BoxChunk(rank=0, offsets=[1], sizes=[1], location=_loc("ln.bin", 40, 4))])],
        objects=[ObjectEntry(name="rng", encoding="torch", location=_loc("ln.bin", 32, 8)),
                 ObjectEntry(name="cfg", encoding="json", value=[1])],
        param_groups=[ParamGroup(optimizer="optim", index=0, params=["model.w", 3], hyperparams={"lr": 0.1})],
        files={"a.bin": _file(64), "ln.bin": _file(100, linked="5/r0.bin")})
    assert m.ref == "gpt/7"
    assert m.tensor("model.v") is m.tensors[1] and m.tensor("model.nope") is None
    assert m.total_bytes == 164 and m.linked_bytes == 100
    assert m.unchanged_bytes == 16 + 16 + 4 + 8  # what lies in the linked file, not the file's size
    assert _manifest().linked_bytes == 0 == _manifest().unchanged_bytes
    assert Manifest.model_validate_json(m.model_dump_json()) == m
