"""Layout specs and layouts (pure): grammar, refusals, and exact tiling for every spec."""

from __future__ import annotations

from math import prod

import pytest
from hypothesis import given, settings, strategies as st

from ckptd.reshard.layouts import build_layout, logical_param, rank_bytes
from ckptd.reshard.spec import GRAMMAR, parse_spec
from ckptd_schemas import InvalidRequest, TensorEntry, check_tiling, itemsize

SPECS = ["full", "replicate", "replicate:dp=3", "fsdp2:dp=1", "fsdp2:dp=3", "fsdp2:dp=8", "zero1:dp=2", "owner:dp=3,group=role",
         "zero2:dp=3,align=8", "zero3:dp=4,align=16", "fsdp1:dp=5", "tp=2", "tp=2,dp=3", "owner:dp=3",
         "owner:dp=2,max-per-rank=50", "pp=2"]


@st.composite
def tensor_sets(draw):
    layers = draw(st.integers(2, 4))
    dims = st.integers(2, 9)
    out = [("model.embed.weight", [draw(dims), draw(dims)])]
    for i in range(layers):
        out.append((f"model.layers.{i}.attn.wq.weight", [draw(dims), draw(dims)]))
        out.append((f"model.layers.{i}.mlp.down_proj.weight", [draw(dims), draw(dims)]))
        out.append((f"model.layers.{i}.mlp.down_proj.bias", [draw(dims)]))
        out.append((f"model.layers.{i}.norm.weight", [draw(dims)]))
    out.append(("model.head.weight", [draw(dims), draw(dims), draw(st.integers(1, 3))]))
    entries = [TensorEntry(name=n, shape=s, dtype=draw(st.sampled_from(["float32", "bfloat16"])), group="model",
                           chunks=[]) for n, s in out]
    for n, s in out[: draw(st.integers(0, len(out)))]:
        for stat in ("exp_avg", "exp_avg_sq"):
            entries.append(TensorEntry(name=f"optim.state.{n[6:]}.{stat}", shape=s, dtype="float32", group="optim",
                                       chunks=[]))
        entries.append(TensorEntry(name=f"optim.state.{n[6:]}.step", shape=[], dtype="float32", group="optim",
                                   chunks=[]))
    return entries


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets(), spec=st.sampled_from(SPECS))
def test_every_layout_covers_every_element_exactly_once(tensors, spec):
    layout = build_layout(parse_spec(spec), tensors)
    for t in tensors:
        check_tiling(t.name, t.shape, [(c.region, c.rank, "") for c in layout.chunks if c.tensor == t.name])
    assert all(0 <= c.rank < layout.world_size for c in layout.chunks)
    total = sum(prod(t.shape) * itemsize(t.dtype) for t in tensors)
    assert sum(sum(r.values()) for r in rank_bytes(layout, tensors)) == total


def test_fsdp2_uses_torch_chunk_semantics():
    t = TensorEntry(name="model.w", shape=[10, 3], dtype="float32", group="model", chunks=[])
    layout = build_layout(parse_spec("fsdp2:dp=4"), [t])
    assert [(c.rank, c.region.box.sizes[0]) for c in layout.chunks] == [(0, 3), (1, 3), (2, 3), (3, 1)]
    t5 = TensorEntry(name="model.w", shape=[5, 3], dtype="float32", group="model", chunks=[])
    assert [c.rank for c in build_layout(parse_spec("fsdp2:dp=4"), [t5]).chunks] == [0, 1, 2]  # rank 3 empty


def test_zero3_partitions_are_aligned_and_equal():
    ts = [TensorEntry(name=f"model.p{i}", shape=[7, i + 1], dtype="float32", group="model", chunks=[])
          for i in range(5)]
    layout = build_layout(parse_spec("zero3:dp=4,align=16"), ts)
    padded = sum(-(-prod(t.shape) // 16) * 16 for t in ts)
    part = -(-(-(-padded // 4)) // 16) * 16
    per_rank = [sum(c.numel for c in layout.chunks if c.rank == r) for r in range(4)]
    assert all(n <= part for n in per_rank) and part % 16 == 0
    assert sum(per_rank) == sum(prod(t.shape) for t in ts)


def test_owner_keeps_matrices_whole_with_their_optimizer_state():
    ts = [TensorEntry(name=f"model.l{i}.weight", shape=[8 * (i + 1), 4], dtype="float32", group="model", chunks=[])
          for i in range(9)]
    ts += [TensorEntry(name=f"optim.state.l{i}.weight.exp_avg", shape=[8 * (i + 1), 4], dtype="float32",
                       group="optim", chunks=[]) for i in range(9)]
    layout = build_layout(parse_spec("owner:dp=4,max-per-rank=3"), ts)
    owner = {}
    for c in layout.chunks:
        assert c.region.box is not None and list(c.region.box.sizes) == next(t.shape for t in ts if t.name == c.tensor)
        owner.setdefault(logical_param(next(t for t in ts if t.name == c.tensor)), set()).add(c.rank)
    assert all(len(r) == 1 for r in owner.values())   # weight and its state on one rank
    counts = [sum(1 for p, r in owner.items() if r == {k}) for k in range(4)]
    assert max(counts) <= 3
    loads = [sum(r.values()) for r in rank_bytes(layout, ts)]
    assert max(loads) / (sum(loads) / 4) < 1.3
    with pytest.raises(InvalidRequest, match="at most 2 per rank"):
        build_layout(parse_spec("owner:dp=4,max-per-rank=2"), ts)


def test_tp_splits_columns_and_rows_and_refuses_impossible_targets():
    ts = [TensorEntry(name="model.attn.wq.weight", shape=[6, 4], dtype="float32", group="model", chunks=[]),
          TensorEntry(name="model.mlp.down_proj.weight", shape=[4, 6], dtype="float32", group="model", chunks=[]),
          TensorEntry(name="model.norm.weight", shape=[4], dtype="float32", group="model", chunks=[])]
    layout = build_layout(parse_spec("tp=2"), ts)
    boxes = {(c.tensor, c.rank): c.region.box for c in layout.chunks}
    assert boxes[("model.attn.wq.weight", 1)].offsets == (3, 0)       # column parallel: Shard(0)
    assert boxes[("model.mlp.down_proj.weight", 1)].offsets == (0, 3)  # row parallel: Shard(1)
    assert sum(1 for c in layout.chunks if c.tensor == "model.norm.weight") == 1  # replicated, written once
    with pytest.raises(InvalidRequest, match="tp=8 cannot split tensor 'model.attn.wq.weight': dim 0"):
        build_layout(parse_spec("tp=8"), ts)


def test_pp_stages_own_contiguous_layers():
    ts = [TensorEntry(name="model.embed.weight", shape=[4, 4], dtype="float32", group="model", chunks=[])]
    ts += [TensorEntry(name=f"model.layers.{i}.w", shape=[4, 4], dtype="float32", group="model", chunks=[])
           for i in range(6)]
    ts += [TensorEntry(name="model.head.weight", shape=[4, 4], dtype="float32", group="model", chunks=[])]
    layout = build_layout(parse_spec("pp=3"), ts)
    stage = {c.tensor: c.rank for c in layout.chunks}
    layer_stages = [stage[f"model.layers.{i}.w"] for i in range(6)]
    assert layer_stages == sorted(layer_stages) and set(layer_stages) == {0, 1, 2}
    assert stage["model.embed.weight"] == 0 and stage["model.head.weight"] == 2
    with pytest.raises(InvalidRequest, match="pp=9 needs at least 9 layers"):
        build_layout(parse_spec("pp=9"), ts)


@pytest.mark.parametrize("bad", ["", "fsdp2", "fsdp2:dp=0", "fsdp2:dp=x", "fsdp2:dp=2,dp=3", "zero3:align=16",
                                 "tp=2,pp=2", "owner:dp=2,max=3", "mystery:dp=2", "pp=", "full:dp=2",
                                 "fsdp2:dp=99999999"])
def test_bad_specs_are_refused_with_the_grammar(bad):
    with pytest.raises(InvalidRequest) as e:
        parse_spec(bad)
    assert GRAMMAR in e.value.message


def test_spec_round_trips_through_its_canonical_string():
    for s in SPECS:
        assert str(parse_spec(str(parse_spec(s)))) == str(parse_spec(s))


def test_owner_group_role_batches_same_role_same_shape_matrices_never_splitting_one():
    ts = []
    for layer in range(2):
        for e in range(6):
            for proj, shape in (("gate_proj", [16, 8]), ("up_proj", [16, 8]), ("down_proj", [8, 16])):
                name = f"layers.{layer}.mlp.experts.{e}.{proj}.weight"
                ts.append(TensorEntry(name=f"model.{name}", shape=shape, dtype="float32", group="model", chunks=[]))
                ts.append(TensorEntry(name=f"optim.state.{name}.exp_avg", shape=shape, dtype="float32",
                                      group="optim", chunks=[]))
    layout = build_layout(parse_spec("owner:dp=4,max-per-rank=9,group=role"), ts)
    owner: dict[str, set[int]] = {}
    for c in layout.chunks:
        t = next(t for t in ts if t.name == c.tensor)
        assert list(c.region.box.sizes) == t.shape  # whole, never split
        owner.setdefault(logical_param(t), set()).add(c.rank)
    assert all(len(r) == 1 for r in owner.values())
    # each rank's matrices of one role come in batches: per (rank, role) the count is a multiple of the
    # batch size (an even share of 12 matrices per role over 4 ranks = 3)
    per = {}
    for p, (r,) in ((p, tuple(r)) for p, r in owner.items()):
        role = p.split(".")[-2]
        per[(r, role)] = per.get((r, role), 0) + 1
    assert all(n % 3 == 0 for n in per.values()), per
    assert max(sum(n for (r, _), n in per.items() if r == k) for k in range(4)) <= 9
    for t in ts:
        check_tiling(t.name, t.shape, [(c.region, c.rank, "") for c in layout.chunks if c.tensor == t.name])


@st.composite
def _shardings(draw):
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 11)) for _ in range(ndim)]
    mesh = [draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3)))]
    placements = [draw(st.one_of(st.just("R"), st.integers(-ndim, ndim - 1))) for _ in mesh]
    coord = [draw(st.integers(0, k - 1)) for k in mesh]
    return shape, mesh, placements, coord


@settings(max_examples=400, deadline=None)
@given(case=_shardings())
def test_shard_box_agrees_with_torch_for_shard_and_replicate(case):
    """The saver's shard geometry (no index tensors) equals torch's for every mesh coordinate,
    uneven and empty shards and nested sharding of one dimension included."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from ckptd_client._placement import shard_box

    shape, mesh, spec, coord = case
    placements = [Replicate() if p == "R" else Shard(p % len(shape)) for p in spec]
    want = _compute_local_shape_and_global_offset(shape, mesh, coord, placements)
    assert shard_box(shape, mesh, coord, placements) == (tuple(want[0]), tuple(want[1]))
    negative = [Replicate() if p == "R" else Shard(p) for p in spec]  # Shard(-1) names the last dimension
    assert shard_box(shape, mesh, coord, negative) == (tuple(want[0]), tuple(want[1]))


def test_shard_box_leaves_other_placements_to_torch():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckptd_client._placement import shard_box

    assert shard_box([8], [2, 2], [0, 1], [_StridedShard(0, split_factor=2), Shard(0)]) is None
