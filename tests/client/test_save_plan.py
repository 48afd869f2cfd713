"""The save plan (``ckptd_client._saveplan.plan_save``), unit-tested with no server and no processes.

What each checks: a plain state dict's chunks, entries and raw layout; boxes and flat ranges (pieces
built directly, on the meta device: the planner reads no tensor's bytes); the layout a raw save writes
(the upload's rule, ``lay_out`` over ``write_order``, run on the plan's raw lengths); replicas written by one rank
across all ranks, by the owners given (the agreed ones, else ``lpt_assign``'s balance);
objects and param groups; files cut at ``file_bytes``, 64-byte aligned; reuse candidates (only chunks
unchanged at the last save that can be hashed in place); the stall's two steps driven by the plan
(reuse: not copied; copy: the rest); the upload's order and the one layout rule (``write_order``,
``lay_out``); that the executor (``build_snapshot`` then ``_pack``, ``_index``) writes files and an
index whose every offset, length and XXH3 is the plan's; and that a real raw save to a service
commits exactly the plan's files, sizes and chunk locations.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch
import xxhash

from ckptd_client._flatten import flatten
from ckptd_client._incremental import chunk_key
from ckptd_client._placement import LocalPiece, local_piece
from ckptd_client import CheckpointClient
from ckptd_client._save import _index, _pack, _pieces, build_snapshot
from ckptd_client._saveplan import ALIGN, FILE_BYTES, Placement, file_prefix, lay_out, plan_save, write_order
from ckptd_client.flat import FlatShard
from ckptd_schemas import Box, Manifest
from ckptd_schemas.balance import lpt_assign

KIB = 1 << 10


def _plan(sd: dict, rank: int = 0, world: int = 1, owners: dict | None = None, **kw):
    flat = flatten(sd)
    pieces = {leaf.fqn: local_piece(leaf.fqn, leaf.value) for leaf in flat.leaves if leaf.kind == "tensor"}
    return plan_save(flat, pieces, rank, world, owners, **kw)


def _layout(plan, file_bytes: int = FILE_BYTES):
    """The plan's chunks as a raw save lays them out (``lay_out`` over ``write_order``, raw lengths):
    where each goes, and the files it writes, ``{name: size}`` with the alignment padding."""
    placements = dict(lay_out(((w.chunk.key, w.chunk.nbytes, w.apart) for w in write_order(plan.chunks)),
                              file_prefix(plan.rank), file_bytes))
    return placements, {p.file: p.offset + p.length + (-p.length) % ALIGN for p in placements.values()}


def _packed(snap, compression, file_bytes: int):
    """What the upload packs: the files ``_pack`` yields for the snapshot's order, and the index from them."""
    order = snap.order()
    files = list(_pack(snap, order, compression, file_bytes))
    return files, _index(snap, order, files)[0]


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g).to(torch.bfloat16),
                  "ids": torch.randint(0, 9, (33,), generator=g, dtype=torch.int64), "none": torch.empty(0, 3),
                  "flat": FlatShard(torch.randn(100, generator=g).half(), (20, 10), 50)},
        "optim": {"state": {"0": {"step": torch.tensor(4.0)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]},
        "epoch": 3,
        "tuple": (1, torch.ones(2)),
    }


def _file_bytes(files) -> dict[str, bytes]:
    return {f.name: b"".join(bytes(p) for p in _pieces(f)) for f in files}


def test_a_plain_state_dict_is_planned_in_order_with_every_chunk_laid_out_raw():
    sd = _state()
    plan = _plan(sd)
    assert [t.name for t in plan.tensors] == ["model.w", "model.b", "model.ids", "model.none", "model.flat",
                                              "optim.state.0.step"]
    assert [t.dtype for t in plan.tensors][:3] == ["float32", "bfloat16", "int64"]
    assert [c.fqn for c in plan.chunks] == ["model.w", "model.b", "model.ids", "model.flat", "optim.state.0.step"]
    w = plan.chunks[0]
    assert (w.box, w.flat, w.shape, w.itemsize, w.nbytes) == (([0, 0], [64, 48]), None, (64, 48), 4, 64 * 48 * 4)
    assert w.key == chunk_key("model.w", "float32", ([0, 0], [64, 48]), None)
    flat = plan.chunks[3]
    assert (flat.box, flat.flat, flat.dtype) == (None, (50, 100), "float16")
    assert plan.reuse == frozenset() and not any(c.candidate for c in plan.chunks)
    # one file, the chunks back to back at 64-byte aligned offsets
    offset, want = 0, {}
    for c in plan.chunks:
        want[c.key] = Placement("r000000-0000.bin", offset, c.nbytes)
        offset += c.nbytes + (-c.nbytes) % ALIGN
    assert _layout(plan, 1 << 20) == (want, {"r000000-0000.bin": offset})
    assert plan.layouts == {"model": "flat:dp=1", "optim": "replicate"} and plan.mesh == {} == plan.coords


def test_objects_and_param_groups_come_from_the_same_flattening():
    plan = _plan(_state())
    assert [o.fqn for o in plan.objects] == ["optim.param_groups.0.lr", "optim.param_groups.0.betas",
                                             "optim.param_groups.0.params", "epoch", "tuple"]
    assert plan.objects[-1].value[0] == 1  # the value, for the stall to encode
    (g,) = plan.param_groups
    assert (g.optimizer, g.index, g.params, g.hyperparams) == ("optim", 0, [0, 1], {"betas": [0.9, 0.99], "lr": 0.1})
    assert not any(c.fqn.startswith("optim.param_groups") for c in plan.chunks)


def test_boxes_and_flat_ranges_are_planned_from_pieces_alone():
    """FSDP2-like boxes (row shards of a 10x8 weight over 3 ranks, the last one empty in dim 0) and a
    ZeRO-like flat range, on the meta device: a plan needs shapes, dtypes and placements, no bytes."""
    shape = (10, 8)
    rows = [(0, 4), (4, 4), (8, 2)]
    flats = [(0, 30), (30, 30), (60, 20)]
    for rank in range(3):
        lo, n = rows[rank]
        sd = {"model": {"w": "box", "m": "flat"}}  # placeholders: the plan reads the pieces below
        pieces = {
            "model.w": LocalPiece(shape, torch.float32, torch.empty(n, 8, device="meta"),
                                  box=Box((lo, 0), (n, 8)), placement="(Shard(dim=0),)"),
            "model.m": LocalPiece(shape, torch.bfloat16, torch.empty(flats[rank][1], dtype=torch.bfloat16, device="meta"),
                                  flat=flats[rank], placement="flat"),
        }
        flat = flatten(sd)
        for leaf in flat.leaves:
            leaf.kind = "tensor"
        stall = {chunk_key("model.w", "float32", ([lo, 0], [n, 8]), None)}
        plan = plan_save(flat, pieces, rank, 3, stall_keys=stall)
        w, m = plan.chunks
        assert (w.box, w.shape, w.nbytes) == (([lo, 0], [n, 8]), (n, 8), n * 8 * 4)
        assert (m.flat, m.box, m.nbytes) == (flats[rank], None, flats[rank][1] * 2)
        assert [t.placement for t in plan.tensors] == ["(Shard(dim=0),)", "flat"]
        assert plan.reuse == frozenset()  # in stall_keys, but on no CPU: hashed after the copy, not in place
        placements, files = _layout(plan, 1 << 20)
        assert list(files) == [f"r{rank:06d}-0000.bin"]
        assert placements[m.key].offset == math.ceil(w.nbytes / ALIGN) * ALIGN


def test_a_piece_this_rank_does_not_write_is_described_but_not_planned():
    """A Replicate copy that another coordinate writes, and an empty shard: entries, no chunks."""
    pieces = {"a": LocalPiece((4,), torch.float32, torch.empty(4, device="meta"), box=Box((0,), (4,)), writes=False),
              "b": LocalPiece((4,), torch.float32, torch.empty(0, device="meta"), box=Box((4,), (0,)))}
    flat = flatten({"a": 0, "b": 0})
    for leaf in flat.leaves:
        leaf.kind = "tensor"
    plan = plan_save(flat, pieces, 1, 2)
    assert [t.name for t in plan.tensors] == ["a", "b"] and plan.chunks == [] and _layout(plan) == ({}, {})


@pytest.mark.parametrize("world", [1, 2, 3])
def test_replicated_tensors_are_written_once_across_ranks(world):
    sd = {"model": {f"t{i}": torch.zeros(16 * (i + 1)) for i in range(7)}}
    names = [f"model.t{i}" for i in range(7)]
    plans = [_plan(sd, rank, world) for rank in range(world)]
    owners = lpt_assign([(n, 64 * (i + 1)) for i, n in enumerate(names)], world)
    for rank, plan in enumerate(plans):
        assert [c.fqn for c in plan.chunks] == [n for n in names if owners[n] == rank]  # in the state dict's order
        assert len(plan.tensors) == 7  # every rank describes every tensor
    assert sorted(c.fqn for p in plans for c in p.chunks) == sorted(owners)
    agreed = {f"model.t{i}": (i * 2) % world for i in range(7)}  # writers agreed among the ranks win
    assert [[c.fqn for c in _plan(sd, r, world, owners=agreed).chunks] for r in range(world)] == \
        [[n for n, w in agreed.items() if w == r] for r in range(world)]


def test_files_are_cut_at_file_bytes_and_every_offset_is_aligned():
    sd = {"m": {"a": torch.zeros(100), "b": torch.zeros(3000), "c": torch.zeros(10), "big": torch.zeros(9000),
                "d": torch.zeros(1)}}
    plan = _plan(sd, rank=2, world=3, owners={k: 2 for k in ("m.a", "m.b", "m.c", "m.big", "m.d")})
    placements, files = _layout(plan, 16 * KIB)
    where = {c.fqn: placements[c.key] for c in plan.chunks}
    assert list(files) == ["r000002-0000.bin", "r000002-0001.bin", "r000002-0002.bin"]
    assert {n: p.file[-8:-4] for n, p in where.items()} == {"m.a": "0000", "m.b": "0000", "m.c": "0000",
                                                            "m.big": "0001", "m.d": "0002"}
    assert all(p.offset % ALIGN == 0 for p in where.values())
    assert (where["m.b"].offset, where["m.c"].offset) == (448, 448 + 12032)
    assert files["r000002-0001.bin"] == 36032 > 16 * KIB  # a chunk larger than a file fills one alone
    for name, size in files.items():
        in_file = sorted((p.offset, p.length) for p in where.values() if p.file == name)
        assert size == sum(n + (-n) % ALIGN for _, n in in_file)
        assert size <= 16 * KIB or len(in_file) == 1


def test_the_layout_keeps_pieces_laid_out_apart_in_files_of_their_own():
    got = list(lay_out([(i, n, apart) for i, (n, apart) in enumerate(
        ((10, True), (20, True), (30, False), (900, False), (200, False)))], "r000001", 1000))
    assert [(i, p.file[-8:-4], p.offset, p.length) for i, p in got] == [
        (0, "0000", 0, 10), (1, "0000", 64, 20), (2, "0001", 0, 30), (3, "0001", 64, 900), (4, "0002", 0, 200)]


def test_the_layout_places_each_piece_as_it_is_drawn():
    """Lazy, as the upload needs it: a piece is placed before the next one is asked for (compressed)."""
    drawn: list[int] = []

    def pieces():
        for i, n in enumerate((100, 200, 300)):
            drawn.append(i)
            yield i, n, False

    for i, _ in lay_out(pieces(), "r000000", 250):
        assert drawn[-1] == i


def test_write_order_puts_unchanged_chunks_written_again_first_and_marks_the_linked():
    plan = _plan({"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(4)})
    keys = {c.fqn: c.key for c in plan.chunks}
    got = write_order(plan.chunks, {keys["b"]: ["pieces of b"]}, apart={keys["c"]})
    assert [(w.chunk.fqn, w.linked, w.apart) for w in got] == [("c", None, True), ("a", None, False),
                                                               ("b", ["pieces of b"], False)]
    assert [w.chunk.fqn for w in write_order(plan.chunks)] == ["a", "b", "c"]


def test_reuse_candidates_are_unchanged_chunks_that_can_be_hashed_in_place():
    base = torch.randn(8, 6)
    sd = {"frozen": torch.randn(5, 5), "moving": torch.randn(7), "transposed": base.t(), "new": torch.ones(3)}
    keys = {c.fqn: c.key for c in _plan(sd).chunks}
    stall = {keys["frozen"], keys["transposed"], keys["moving"]}
    plan = _plan(sd, stall_keys=stall)
    assert plan.reuse == {keys["frozen"], keys["moving"]}  # not a non-contiguous view, nor a key unknown before
    assert [c.candidate for c in plan.chunks] == [True, True, False, False]


def test_the_stall_reuses_what_the_plan_offers_and_links_and_copies_the_rest():
    """``build_snapshot``: reuse hashes the candidates in place and hands their digests to ``link``;
    what it linked is not copied, everything else is."""
    sd = {"frozen": torch.randn(5, 5), "moving": torch.randn(7), "opt": torch.randn(3)}
    keys = {c.fqn: c.key for c in _plan(sd).chunks}
    offered = []

    def link(digests):
        offered.append(dict(digests))
        return {keys["frozen"]: ["pieces of frozen in a linked file"]}

    snap = build_snapshot(sd, 0, 1, link=link, stall_keys={keys["frozen"], keys["moving"]})
    assert set(offered[0]) == {keys["frozen"], keys["moving"]}
    assert offered[0][keys["frozen"]] == xxhash.xxh3_128_digest(sd["frozen"].numpy().tobytes())
    frozen, moving, opt = (snap.chunks[n][0] for n in ("frozen", "moving", "opt"))
    assert frozen.data is None and frozen.reused == ["pieces of frozen in a linked file"]
    assert torch.equal(moving.data, sd["moving"]) and moving.digest is not None and moving.reused is None
    assert torch.equal(opt.data, sd["opt"]) and opt.digest is None
    assert [c.key for cs in snap.chunks.values() for c in cs] == [c.key for c in _plan(sd).chunks]


def test_a_save_flattens_the_state_dict_once(monkeypatch):
    import ckptd_client._save as save_mod

    calls = []
    real = save_mod.flatten
    monkeypatch.setattr(save_mod, "flatten", lambda sd: calls.append(1) or real(sd))
    build_snapshot(_state(), 0, 1).release()
    assert calls == [1]


@pytest.mark.parametrize("world", [1, 2])
def test_the_executor_writes_what_the_plan_predicts(world):
    """``build_snapshot`` + ``_pack`` with every chunk raw: the same files (names, sizes) as the plan,
    every chunk at the plan's file, offset and length, the bytes there the source's bytes (their XXH3
    the index's), the alignment padding zeros, and the objects after the chunks in the last file."""
    fb = 24 * KIB
    sd = {"model": {f"w{i}": torch.randn(17 * (i + 1), 31) for i in range(6)},
          "ids": torch.arange(1000, dtype=torch.int16), "meta": (1, "x"), "step": 12}
    for rank in range(world):
        plan = _plan(sd, rank, world)
        placements, planned = _layout(plan, fb)
        snap = build_snapshot(sd, rank, world)
        assert [c.plan for cs in snap.chunks.values() for c in cs] == plan.chunks and snap.tensors == plan.tensors
        files, index = _packed(snap, None, fb)
        data = _file_bytes(files)
        assert [f.name for f in files][:len(planned)] == list(planned)
        sizes = {f.name: f.size for f in files}
        for name in list(planned)[:-1]:
            assert sizes[name] == planned[name]
        got = {chunk_key(t.name, t.dtype, (c.offsets, c.sizes), None): c.location for t in index.tensors
               for c in t.chunks}
        assert set(got) == set(placements)
        for c in plan.chunks:
            p, loc = placements[c.key], got[c.key]
            assert (loc.file, loc.offset, loc.length, loc.raw_length, loc.codec) == \
                (p.file, p.offset, p.length, p.length, "raw")
            stored = data[p.file][p.offset:p.offset + p.length]
            assert stored == snap.chunks[c.fqn][0].data.numpy().tobytes()
            assert xxhash.xxh3_64_hexdigest(stored) == loc.xxh3
            assert data[p.file][p.offset + p.length:p.offset + p.length + (-p.length) % ALIGN].count(0) == \
                (-p.length) % ALIGN
        for f in files:
            assert f.xxh3 == xxhash.xxh3_64_hexdigest(data[f.name])
        stored_objects = [o for o in index.objects if o.location is not None]
        assert [o.name for o in stored_objects] == ["meta"]
        last = list(planned)[-1] if planned else None
        loc = stored_objects[0].location
        if last is not None and loc.file == last:
            assert loc.offset == planned[last]  # right after the plan's last chunk
        assert [t.name for t in index.tensors] == [t.name for t in plan.tensors]
        snap.release()


def test_compressed_chunks_are_cut_at_the_plan_s_frames():
    """With compression the lengths are the executor's, the frames the plan's."""
    sd = {"big": torch.zeros(1500, 1024)}  # 6 MiB of fp32: two frames of at most 4 MiB
    plan = _plan(sd)
    (c,) = plan.chunks
    frames = c.frames()
    assert len(frames) == 2 and sum(n for _, n, _, _ in frames) == 1500 * 1024
    snap = build_snapshot(sd, 0, 1)
    files, index = _packed(snap, "zstd", 1 << 30)
    pieces = index.tensors[0].chunks
    assert [(p.offsets, p.sizes) for p in pieces] == [tuple(box) for _, _, box, _ in frames]
    assert [p.location.raw_length for p in pieces] == [n * 4 for _, n, _, _ in frames]
    assert all(p.location.codec == "zstd" and p.location.offset % ALIGN == 0 for p in pieces)
    assert pieces[1].location.offset == pieces[0].location.length + (-pieces[0].location.length) % ALIGN
    snap.release()


def test_a_raw_save_commits_the_plan_s_files_and_chunk_locations(server):
    """The plan is what runs: a real save, every chunk stored raw, none linked, commits the data files
    (names and sizes) and every chunk's file, offset and length that ``plan_save`` computed for it."""
    fb = 40 * KIB
    g = torch.Generator().manual_seed(5)
    sd = {"model": {f"w{i}": torch.randn(9 * (i + 1), 61, generator=g) for i in range(8)},
          "ids": torch.arange(3000, dtype=torch.int16), "half": torch.randn(777, generator=g).half(), "step": 7}
    placements, planned = _layout(_plan(sd), fb)
    assert len(planned) >= 3  # cut at file_bytes, a chunk larger than a file alone in one
    with CheckpointClient(server.url, file_bytes=fb, compression=None, incremental=False) as client:
        client.save(sd, "plan/1").wait()
    m = Manifest.model_validate_json(httpx.get(f"{server.url}/v1/checkpoints/plan/1", timeout=30).content)
    assert {name: f.size for name, f in m.files.items()} == planned
    committed = {chunk_key(t.name, t.dtype, (c.offsets, c.sizes), None): c.location
                 for t in m.tensors for c in t.chunks}
    assert {k: (loc.file, loc.offset, loc.length) for k, loc in committed.items()} == \
        {k: (p.file, p.offset, p.length) for k, p in placements.items()}
