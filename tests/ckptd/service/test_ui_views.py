"""What the web view shows of a manifest (:mod:`ckptd.service.ui_views`): pure functions, checked on one
hand-built manifest whose every figure is worked out here.

The manifest has two ranks and two data files: ``f0.bin`` written by this save, ``f1.bin`` linked from
an earlier checkpoint (an incremental save). Its tensors cover each shape a chunk can have: a 2-D
tensor in two row blocks (one zstd-compressed), a 1-D box, a scalar, a tensor with no elements, a 3-D
box (drawn by its first two dimensions), a flat-sharded optimizer state; plus a JSON object whose value
is longer than the view shows, a stored object, and a param group.

The byte counts keep their distinct meanings (logical: every tensor once, decoded; stored: the chunks
as stored; file: the data files; linked, written, unchanged), per rank and per group.
"""

from __future__ import annotations

from datetime import datetime, timezone


from ckptd.service.ui_views import (
    VALUE_CHARS, manifest_stats, object_row, page, param_group_row, segments, tensor_row,
)
from ckptd_schemas import BoxChunk, FileEntry, FlatChunk, Location, Manifest, ObjectEntry, ParamGroup, TensorEntry, \
    Topology

H = "0123456789abcdef"


def _loc(file: str, offset: int, length: int, raw_length: int | None = None, codec: str = "raw") -> Location:
    return Location(file=file, offset=offset, length=length, raw_length=length if raw_length is None else raw_length,
                    codec=codec, xxh3=H)


def _box(rank: int, offsets: list[int], sizes: list[int], loc: Location) -> BoxChunk:
    return BoxChunk(rank=rank, offsets=offsets, sizes=sizes, location=loc)


def _tensor(name: str, shape: list[int], dtype: str, chunks: list) -> TensorEntry:
    return TensorEntry(name=name, shape=shape, dtype=dtype, group=name.split(".")[0], chunks=chunks)


def _manifest() -> Manifest:
    tensors = [
        _tensor("model.w", [4, 6], "float32", [_box(0, [0, 0], [2, 6], _loc("f0.bin", 0, 48)),
                                               _box(1, [2, 0], [2, 6], _loc("f1.bin", 0, 30, 48, "zstd"))]),
        _tensor("model.b", [6], "float32", [_box(0, [2], [4], _loc("f0.bin", 64, 16))]),
        _tensor("model.s", [], "float32", [_box(0, [], [], _loc("f0.bin", 56, 4))]),
        _tensor("model.e", [0, 3], "float32", []),
        _tensor("model.v", [2, 3, 4], "float32", [_box(1, [1, 1, 0], [1, 2, 4], _loc("f1.bin", 42, 32))]),
        _tensor("optim.m", [10], "bfloat16", [FlatChunk(rank=0, start=0, length=4, location=_loc("f0.bin", 48, 8)),
                                             FlatChunk(rank=1, start=4, length=6, location=_loc("f1.bin", 30, 12))]),
    ]
    objects = [ObjectEntry(name="extra.notes", encoding="json", value={"text": "n" * 400}),
               ObjectEntry(name="extra.rng", rank=1, encoding="torch", location=_loc("f1.bin", 74, 10))]
    files = {"f0.bin": FileEntry(size=80, xxh3=H, block_size=4096, blocks=[H]),
             "f1.bin": FileEntry(size=120, xxh3=H, block_size=4096, blocks=[H], linked="0/f1.bin")}
    return Manifest(run="r", name="1", step=1, session="s" * 32, created_at=datetime(2026, 1, 2, tzinfo=timezone.utc),
                    parent="base/7", topology=Topology(world_size=2, mesh={"dp": 2}, layouts={"model": "dp=2"}),
                    tensors=tensors, objects=objects, files=files,
                    param_groups=[ParamGroup(optimizer="optim", index=0, params=[f"p{i}" for i in range(25)],
                                             hyperparams={"lr": 0.1})])


def test_manifest_stats_keeps_each_byte_count_to_its_meaning():
    stats = manifest_stats(_manifest())
    assert stats == {
        "files": 2, "file_bytes": 200, "linked_bytes": 120, "written_bytes": 80,
        "unchanged_bytes": 30 + 12 + 32 + 10,  # the chunks and the object placed in the linked file
        "linked_files": 1,
        "logical_bytes": 96 + 24 + 4 + 0 + 96 + 20, "stored_bytes": 48 + 30 + 16 + 4 + 32 + 8 + 12,
        "chunks": 7, "compressed_chunks": 1, "tensors": 6, "objects": 2, "param_groups": 1,
        "world_size": 2, "mesh": {"dp": 2}, "layouts": {"model": "dp=2"},
        "created_at": "2026-01-02T00:00:00+00:00", "parent": "base/7",
        "groups": {"model": {"tensors": 5, "logical_bytes": 220, "stored_bytes": 130},
                   "optim": {"tensors": 1, "logical_bytes": 20, "stored_bytes": 20}},
        "rank_bytes": [48 + 16 + 4 + 8, 30 + 32 + 12],
    }


def test_segments_place_each_chunk_in_a_unit_box():
    m = _manifest()
    assert segments(m.tensor("model.w")) == [[0, 0.0, 0.5, 0.0, 1.0], [1, 0.5, 1.0, 0.0, 1.0]]
    assert segments(m.tensor("model.b")) == [[0, 0.333333, 1.0, 0.0, 1.0]]  # 1-D: the whole height
    assert segments(m.tensor("model.s")) == [[0, 0.0, 1.0, 0.0, 1.0]]  # a scalar fills the box
    assert segments(m.tensor("model.e")) == []  # no elements, nothing drawn
    assert segments(m.tensor("model.v")) == [[1, 0.5, 1.0, 0.333333, 1.0]]  # dims 0 and 1 of a 3-D box
    assert segments(m.tensor("optim.m")) == [[0, 0.0, 0.4, 0.0, 1.0], [1, 0.4, 1.0, 0.0, 1.0]]  # flat: row-major
    assert segments(m.tensor("model.w"), limit=1) == [[0, 0.0, 0.5, 0.0, 1.0]]


def test_tensor_row_describes_the_tensor_and_its_first_chunks():
    m = _manifest()
    row = tensor_row(m.tensor("model.w"), chunks_shown=1)
    assert {k: row[k] for k in ("name", "shape", "dtype", "group", "numel", "logical_bytes", "stored_bytes",
                                "chunk_count", "ranks", "codecs")} == {
        "name": "model.w", "shape": [4, 6], "dtype": "float32", "group": "model", "numel": 24, "logical_bytes": 96,
        "stored_bytes": 78, "chunk_count": 2, "ranks": [0, 1], "codecs": ["raw", "zstd"]}
    assert row["chunks"] == [{"rank": 0, "kind": "box", "offsets": [0, 0], "sizes": [2, 6], "file": "f0.bin",
                              "offset": 0, "length": 48, "codec": "raw", "xxh3": H}]  # one shown of two
    assert len(row["segments"]) == 2  # the picture has every rank's part
    flat = tensor_row(m.tensor("optim.m"))
    assert [(c["kind"], c["start"], c["rank"], c["file"], c["offset"]) for c in flat["chunks"]] == [
        ("flat", 0, 0, "f0.bin", 48), ("flat", 4, 1, "f1.bin", 30)]
    assert "offsets" not in flat["chunks"][0]
    empty = tensor_row(m.tensor("model.e"))
    assert (empty["numel"], empty["chunk_count"], empty["chunks"], empty["ranks"], empty["codecs"]) == (0, 0, [], [], [])


def test_a_flat_chunk_row_keeps_its_element_range():
    flat = tensor_row(_manifest().tensor("optim.m"))
    assert [(c["start"], c["numel"]) for c in flat["chunks"]] == [(0, 4), (4, 6)]  # elements
    assert [c["length"] for c in flat["chunks"]] == list(_manifest().tensor("optim.m").table.length)  # stored bytes


def test_object_and_param_group_rows_cut_what_is_long():
    m = _manifest()
    notes = object_row(m.objects[0])
    assert len(notes["value"]) == VALUE_CHARS + 3 and notes["value"].endswith("...")
    assert notes["value"].startswith('{"text": "nnn') and (notes["file"], notes["length"]) == (None, None)
    short = object_row(ObjectEntry(name="extra.epoch", encoding="json", value=3))
    assert short["value"] == "3"
    assert object_row(m.objects[1]) == {"name": "extra.rng", "rank": 1, "encoding": "torch", "value": None,
                                        "file": "f1.bin", "length": 10}
    g = param_group_row(m.param_groups[0])
    assert g["params"] == 25 and g["first_params"] == [f"p{i}" for i in range(20)]
    assert g["hyperparams"] == {"lr": 0.1} and (g["optimizer"], g["index"]) == ("optim", 0)


def test_page_slices_and_says_the_total():
    assert page(list(range(10)), 8, 5, run="r") == {"items": [8, 9], "total": 10, "offset": 8, "limit": 5, "run": "r"}
    assert page(list(range(10)), 20, 5)["items"] == []
    assert page((), 0, 5) == {"items": [], "total": 0, "offset": 0, "limit": 5}
