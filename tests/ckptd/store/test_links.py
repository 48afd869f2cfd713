"""Links pay for themselves: the client's rule (``ckptd_client._incremental.worth_linking``), the
service's check at commit (``ckptd.store.links.check_links``) and ``Manifest.unchanged_bytes``,
unit-tested on built manifests and chunk lists, no server.

What each attacks: a linked file that the chunks reused from it barely fill (the reported case: one
4-byte scalar in a file of a large changed tensor) must be refused by both sides, exactly at half
and not below; references repeated to one range (a hostile index) count once; a file of unknown
size is never linked; dropping a chunk whose frames span two files empties the other file too;
bytes a save already placed in a link (the stall's) fill it; unchanged chunks written again are
laid out apart, so that the next save can link their file whole; and ``show``'s unchanged figure is
the reused chunks' bytes, not the linked files' sizes.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import torch

from ckptd_client._incremental import SLOT, ChunkHistory, _Last, _Stored, chunk_key, worth_linking
from ckptd_client._save import Snapshot, _Chunk, _index, _pack
from ckptd.store.links import check_links, filled_bytes
from ckptd_schemas import (
    BoxChunk, FileEntry, InvalidIndex, Location, Manifest, ObjectEntry, TensorEntry, Topology, linked_name,
)

T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)
BLOCK = 1 << 20


def _file(size: int, linked: str | None = None) -> FileEntry:
    return FileEntry(size=size, xxh3="1" * 16, block_size=BLOCK, blocks=["2" * 16] * -(-size // BLOCK), linked=linked)


def _tensor(name: str, nbytes: int, file: str, offset: int = 0, rank: int = 0) -> TensorEntry:
    n = nbytes // 4
    loc = Location(file=file, offset=offset, length=nbytes, raw_length=nbytes, xxh3="0" * 16)
    return TensorEntry(name=name, shape=[n], dtype="float32", group="model",
                       chunks=[BoxChunk(rank=rank, offsets=[0], sizes=[n], location=loc)])


def _manifest(tensors: list[TensorEntry], files: dict[str, FileEntry], objects: list[ObjectEntry] = (),
              world: int = 1) -> Manifest:
    return Manifest(run="ft", name="3", session="s", created_at=T0, topology=Topology(world_size=world),
                    tensors=tensors, objects=list(objects), files=files)


BIG = 1 << 20
LN = linked_name("2", "r000000-0000.bin")


# -- the service's check ---------------------------------------------------------------------------

def test_a_linked_file_holding_only_an_unchanged_scalar_is_refused_naming_file_rank_and_bytes():
    """The reported case: the earlier file holds the changed tensor's old bytes and the scalar; the new
    checkpoint writes the tensor again and links the whole earlier file for the scalar's 4 bytes."""
    m = _manifest([_tensor("model.big", BIG, "r000001-0000.bin", rank=1), _tensor("model.scale", 4, LN, BIG, rank=1)],
                  {"r000001-0000.bin": _file(BIG), LN: _file(BIG + SLOT, linked="2/r000001-0000.bin")}, world=2)
    with pytest.raises(InvalidIndex) as e:
        check_links(m)
    assert e.value.details == {"file": LN, "rank": 1, "linked": "2/r000001-0000.bin", "referenced_bytes": SLOT,
                               "file_bytes": BIG + SLOT}
    assert LN in e.value.message and "rank 1" in e.value.message and f"{SLOT} of its {BIG + SLOT} bytes" in e.value.message
    assert e.value.status == 422 and e.value.code == "invalid_index"


def test_exactly_half_filled_passes_and_one_slot_less_is_refused():
    half = BIG // 2
    ok = _manifest([_tensor("model.a", half, LN)], {LN: _file(BIG, linked="2/f.bin")})
    check_links(ok)
    short = _manifest([_tensor("model.a", half - SLOT, LN)], {LN: _file(BIG, linked="2/f.bin")})
    with pytest.raises(InvalidIndex, match="is filled by"):
        check_links(short)


def test_a_scalar_alone_in_its_file_fills_it_with_its_alignment_padding():
    """A 4-byte chunk takes a 64-byte slot, in its file as in any file written instead: a file of
    unchanged chunks laid out apart is linkable, and unchanged_bytes counts only the 4 bytes."""
    m = _manifest([_tensor("model.scale", 4, LN), _tensor("model.big", BIG, "r000000-0000.bin")],
                  {LN: _file(SLOT, linked="2/r000000-0000.bin"), "r000000-0000.bin": _file(BIG)})
    check_links(m)
    assert filled_bytes(m) == {LN: (SLOT, 0)}
    assert m.unchanged_bytes == 4 and m.linked_bytes == SLOT


def test_references_repeated_to_one_range_count_once():
    """A hostile index placing many chunks on the same bytes of a big linked file fills no more of it."""
    tensors = [_tensor(f"model.t{i}", 4096, LN) for i in range(200)]  # 200 x 4 KiB, all at offset 0
    m = _manifest(tensors, {LN: _file(BIG, linked="2/f.bin")})
    assert filled_bytes(m)[LN] == (4096, 0)
    with pytest.raises(InvalidIndex) as e:
        check_links(m)
    assert e.value.details["referenced_bytes"] == 4096


def test_stored_objects_fill_a_linked_file_and_unreferenced_linked_files_are_refused():
    obj = ObjectEntry(name="extra", rank=0, encoding="torch",
                      location=Location(file=LN, offset=0, length=BIG // 2, raw_length=BIG // 2, xxh3="0" * 16))
    check_links(_manifest([_tensor("model.a", 8, "r000000-0000.bin")],
                          {LN: _file(BIG, linked="2/f.bin"), "r000000-0000.bin": _file(SLOT)}, [obj]))
    other = linked_name("2", "r000000-0001.bin")
    m = _manifest([_tensor("model.a", 8, "r000000-0000.bin")],
                  {other: _file(4096, linked="2/r000000-0001.bin"), "r000000-0000.bin": _file(SLOT)})
    with pytest.raises(InvalidIndex, match="no rank") as e:
        check_links(m)
    assert e.value.details["rank"] is None and e.value.details["referenced_bytes"] == 0


def test_files_the_save_wrote_are_not_concerned():
    m = _manifest([_tensor("model.scale", 4, "r000000-0000.bin")], {"r000000-0000.bin": _file(BIG)})
    check_links(m)
    assert filled_bytes(m) == {} and m.unchanged_bytes == 0 and m.linked_bytes == 0


def test_unchanged_bytes_counts_chunks_in_linked_files_only():
    m = _manifest([_tensor("model.frozen", BIG, LN), _tensor("model.scale", 4, LN, BIG),
                   _tensor("model.moving", 4096, "r000000-0000.bin")],
                  {LN: _file(BIG + 3 * SLOT, linked="2/r000000-0000.bin"), "r000000-0000.bin": _file(4096)})
    assert m.unchanged_bytes == BIG + 4
    assert m.linked_bytes == BIG + 3 * SLOT


# -- the client's rule ------------------------------------------------------------------------------

def _piece(file: str, offset: int, length: int) -> BoxChunk:
    return BoxChunk(rank=0, offsets=[0], sizes=[length // 4 or 1],
                    location=Location(file=file, offset=offset, length=length, raw_length=length, xxh3="0" * 16))


def test_an_unchanged_scalar_beside_a_changed_tensor_is_not_worth_its_file():
    scalar = ("model.scale", "float32", ("box", (0,), (1,)))
    got = worth_linking({scalar: [_piece("f0", BIG, 4)]}, {"f0": BIG + SLOT})
    assert got == {}


def test_files_at_least_half_filled_are_linked_and_others_are_not():
    a, b, c = (("t", "float32", ("flat", i, 1)) for i in range(3))
    cands = {a: [_piece("f0", 0, 512)], b: [_piece("f1", 0, 448)], c: [_piece("f2", 0, 4)]}
    got = worth_linking(cands, {"f0": 1024, "f1": 1024, "f2": 64})
    assert set(got) == {a, c}  # 512 of 1024: half; 448 of 1024: less; 4 bytes in a 64-byte slot: all of it
    assert worth_linking(cands, {"f0": 1024}) == {a: cands[a]}  # a file of unknown size is never linked


def test_dropping_a_chunk_empties_the_other_file_its_frames_are_in():
    """x's frames span f0 (mostly changed) and f1; without x, y alone fills too little of f1."""
    x, y = ("x", "float32", ("flat", 0, 1)), ("y", "float32", ("flat", 0, 1))
    cands = {x: [_piece("f0", 0, 256), _piece("f1", 0, 512)], y: [_piece("f1", 512, 128)]}
    assert worth_linking(cands, {"f0": 4096, "f1": 1024}) == {}
    assert set(worth_linking(cands, {"f0": 512, "f1": 1024})) == {x, y}


def test_bytes_already_placed_in_a_link_fill_it():
    y = ("y", "float32", ("flat", 0, 1))
    cands = {y: [_piece("f1", 512, 128)]}
    assert worth_linking(cands, {"f1": 1024}) == {}
    assert worth_linking(cands, {"f1": 1024}, held={"f1": 512}) == cands


def test_history_offers_only_worthwhile_files_and_credits_what_the_stall_linked():
    """``ChunkHistory.candidates``, as the stall and the upload call it: the scalar in a big file is
    not offered; a chunk in a file the stall already linked half of is; the sizes of offered files
    reach the next save through ``remember``."""
    h = ChunkHistory()
    k_big, k_small, k_scale = (chunk_key(n, "float32", None, (0, 1)) for n in ("big", "small", "scale"))
    d = {k_big: b"B" * 16, k_small: b"S" * 16, k_scale: b"C" * 16}
    h._last = _Last("ft", "2", {
        k_big: _Stored(d[k_big], [_piece("r000000-0000.bin", 0, 2048)]),
        k_small: _Stored(d[k_small], [_piece("r000000-0000.bin", 2048, 256)]),
        k_scale: _Stored(d[k_scale], [_piece("r000000-0001.bin", 0, 4)]),
    }, {"r000000-0000.bin": 4096, "r000000-0001.bin": 1 << 20})
    assert h.candidates("ft", "3", {k_scale: d[k_scale]}) == (None, {})
    assert h.candidates("ft", "3", {k_small: d[k_small]}) == (None, {})
    stalled = [_piece(linked_name("2", "r000000-0000.bin"), 0, 2048)]
    source, got = h.candidates("ft", "3", {k_small: d[k_small]}, placed=[stalled])
    assert source == "2" and set(got) == {k_small}
    assert h._offered[("ft", "3")] == {linked_name("2", "r000000-0000.bin"): 4096}


def test_unchanged_chunks_written_again_are_laid_out_in_files_of_their_own():
    """``Snapshot.order(apart=...)`` packed: the unchanged scalar goes first into its own file, the
    changed tensor and the objects into the next; the index keeps the snapshot's tensor order."""
    snap = Snapshot(rank=0, world=1)
    big, scale = torch.arange(4096, dtype=torch.float32), torch.tensor([1.5])
    for name, t in (("model.big", big), ("model.scale", scale)):
        snap.tensors.append(TensorEntry(name=name, shape=list(t.shape), dtype="float32", group="model", chunks=[]))
        snap.chunks[name] = [_Chunk(name, t, ([0], list(t.shape)), None)]
    key = chunk_key("model.scale", "float32", ([0], [1]), None)
    order = snap.order(apart={key})
    files = list(_pack(snap, order, None, 1 << 20))
    index, _ = _index(snap, order, files)
    assert [f.size for f in files] == [SLOT, 4096 * 4]
    assert [t.name for t in index.tensors] == ["model.big", "model.scale"]
    where = {t.name: t.chunks[0].location.file for t in index.tensors}
    assert where == {"model.scale": files[0].name, "model.big": files[1].name}
    files = list(_pack(snap, snap.order(), None, 1 << 20))  # nothing apart: one file, in the snapshot's order
    assert [f.size for f in files] == [4096 * 4 + SLOT]
