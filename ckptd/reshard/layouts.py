"""Layouts: (tensor metadata, layout spec) -> the chunks each target rank holds. Pure.

Every function here places each element of every tensor in exactly one
*written* chunk (replicas are written once, by a rank chosen to balance
bytes), so a layout is also a valid checkpoint tiling. ``tests/ckptd/reshard/test_layouts.py``
checks that property for random shapes and every spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from math import prod
from typing import Sequence

from ckptd_schemas import Box, InvalidRequest, Region, TensorEntry, itemsize
from ckptd_schemas.balance import lpt_assign

from .spec import LayoutSpec

__all__ = ["TargetChunk", "TargetLayout", "build_layout", "logical_param", "rank_bytes"]

ROW_PARALLEL = re.compile(r"(?:^|\.)(?:o_proj|out_proj|down_proj|wo|w2|fc2|c_proj|dense_4h_to_h|proj_out)\.weight$")
LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")


@dataclass(frozen=True)
class TargetChunk:
    rank: int
    tensor: str
    region: Region

    @property
    def numel(self) -> int:
        return self.region.numel


@dataclass
class TargetLayout:
    spec: LayoutSpec
    world_size: int
    mesh: dict[str, int]
    coords: list[dict[str, int]]
    chunks: list[TargetChunk]
    group_layouts: dict[str, str]
    placements: dict[str, str] = field(default_factory=dict)

    def by_rank(self) -> dict[int, list[TargetChunk]]:
        out: dict[int, list[TargetChunk]] = {r: [] for r in range(self.world_size)}
        for c in self.chunks:
            out[c.rank].append(c)
        return out


def logical_param(t: TensorEntry) -> str:
    """The parameter a tensor belongs to: ``model.l1.weight`` and
    ``optim.state.l1.weight.exp_avg`` both give ``l1.weight``."""
    name = t.name
    if ".state." in name:
        return name.split(".state.", 1)[1].rsplit(".", 1)[0]
    return name.split(".", 1)[1] if "." in name else name


def _nbytes(t: TensorEntry) -> int:
    return prod(t.shape) * itemsize(t.dtype)


def _chunk_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk semantics: pieces of ceil(n/parts); trailing pieces may be short or empty."""
    size = -(-n // parts) if n else 0
    lo = min(i * size, n)
    return lo, min(lo + size, n)


def _split(box: Box, dim: int, parts: int, i: int) -> Box | None:
    lo, hi = _chunk_range(box.sizes[dim], parts, i)
    if hi <= lo:
        return None
    offs, sizes = list(box.offsets), list(box.sizes)
    offs[dim] += lo
    sizes[dim] = hi - lo
    return Box(tuple(offs), tuple(sizes))


def _replicated_writers(tensors: Sequence[TensorEntry], world: int) -> dict[str, int]:
    return lpt_assign([(t.name, _nbytes(t)) for t in tensors], world)


def _full(t: TensorEntry, rank: int) -> TargetChunk | None:
    return TargetChunk(rank, t.name, Region(box=Box.full(t.shape))) if prod(t.shape) else None


def _replicate_into(out: "TargetLayout", t: TensorEntry, writer: int) -> None:
    """A replicated tensor (scalars, norms, zero1/2 weights): one chunk, written by ``writer``."""
    if (c := _full(t, writer)) is not None:
        out.chunks.append(c)
    out.placements[t.name] = "replicate"


def build_layout(spec: LayoutSpec, tensors: Sequence[TensorEntry]) -> TargetLayout:
    """Place every tensor under ``spec``; raise InvalidRequest for an impossible target."""
    builder = {
        "full": _layout_full, "replicate": _layout_replicate, "fsdp2": _layout_fsdp2, "tp": _layout_tp,
        "zero1": _layout_flat, "zero2": _layout_flat, "zero3": _layout_flat, "fsdp1": _layout_flat,
        "owner": _layout_owner, "pp": _layout_pp,
    }[spec.kind]
    layout = builder(spec, list(tensors))
    layout.chunks.sort(key=lambda c: c.rank)
    return layout


def _mesh(spec: LayoutSpec) -> tuple[dict[str, int], list[dict[str, int]]]:
    if spec.kind == "full":
        return {}, [{}]
    if spec.kind == "tp":
        return {"dp": spec.dp, "tp": spec.tp}, [{"dp": r // spec.tp, "tp": r % spec.tp} for r in range(spec.world_size)]
    if spec.kind == "pp":
        return {"pp": spec.pp}, [{"pp": r} for r in range(spec.pp)]
    return {"dp": spec.dp}, [{"dp": r} for r in range(spec.dp)]


def _new(spec: LayoutSpec, tensors: Sequence[TensorEntry], name: str) -> TargetLayout:
    mesh, coords = _mesh(spec)
    return TargetLayout(spec, spec.world_size, mesh, coords, [], {t.group: name for t in tensors})


def _layout_full(spec: LayoutSpec, tensors: list[TensorEntry]) -> TargetLayout:
    out = _new(spec, tensors, "full")
    out.chunks = [c for t in tensors if (c := _full(t, 0)) is not None]
    return out


def _layout_replicate(spec: LayoutSpec, tensors: list[TensorEntry]) -> TargetLayout:
    out = _new(spec, tensors, str(spec))
    writers = _replicated_writers(tensors, spec.dp)
    out.chunks = [c for t in tensors if (c := _full(t, writers[t.name])) is not None]
    out.placements = {t.name: "replicate" for t in tensors}
    return out


def _layout_fsdp2(spec: LayoutSpec, tensors: list[TensorEntry]) -> TargetLayout:
    out = _new(spec, tensors, str(spec))
    scalars = [t for t in tensors if not t.shape]
    writers = _replicated_writers(scalars, spec.dp)
    for t in tensors:
        if not t.shape:
            _replicate_into(out, t, writers[t.name])
            continue
        for r in range(spec.dp):
            box = _split(Box.full(t.shape), 0, spec.dp, r)
            if box is not None:
                out.chunks.append(TargetChunk(r, t.name, Region(box=box)))
        out.placements[t.name] = "(Shard(dim=0),)"
    return out


def _tp_dim(t: TensorEntry) -> int | None:
    """Which dim tensor parallelism splits: 1 for row-parallel weights, 0 for column-parallel
    weights and their biases, None (replicated) for norms, scalars and row-parallel biases."""
    param = logical_param(t)
    if not t.shape:
        return None
    if ROW_PARALLEL.search(param):
        return 1 if len(t.shape) >= 2 else None
    if len(t.shape) >= 2:
        return 0
    if "norm" in param or "ln" in param.split("."):
        return None
    sibling = param.rsplit(".", 1)[0] + ".weight"
    return None if ROW_PARALLEL.search(sibling) else 0


def _layout_tp(spec: LayoutSpec, tensors: list[TensorEntry]) -> TargetLayout:
    out = _new(spec, tensors, str(spec))
    T, D = spec.tp, spec.dp
    replicated = [t for t in tensors if _tp_dim(t) is None and not t.shape]
    writers = _replicated_writers(replicated, spec.world_size)
    for t in tensors:
        if not t.shape:
            _replicate_into(out, t, writers[t.name])
            continue
        d = _tp_dim(t)
        if d is not None and t.shape[d] < T:
            raise InvalidRequest(
                f"tp={T} cannot split tensor {t.name!r}: dim {d} has {t.shape[d]} < {T} elements",
                tensor=t.name, spec=str(spec))
        out.placements[t.name] = f"(Shard(dim=0), Shard(dim={d}))" if d is not None else "(Shard(dim=0), Replicate())"
        owner_tp = (sum(map(ord, t.name)) % T) if d is None else None  # one tp rank writes a replica
        for dp_i in range(D):
            for tp_i in range(T):
                if d is None and tp_i != owner_tp:
                    continue
                box: Box | None = Box.full(t.shape)
                if d is not None:
                    box = _split(box, d, T, tp_i)
                if box is not None and D > 1:
                    box = _split(box, 0, D, dp_i)
                if box is not None:
                    out.chunks.append(TargetChunk(dp_i * T + tp_i, t.name, Region(box=box)))
    return out


def _layout_flat(spec: LayoutSpec, tensors: list[TensorEntry]) -> TargetLayout:
    """ZeRO/FSDP1: per state group, the flat concatenation (each tensor padded to ``align``
    elements) is cut into dp equal, aligned partitions. zero1/zero2 keep ``model`` replicated."""
    out = _new(spec, tensors, str(spec))
    A, N = spec.align, spec.dp
    replicated = [t for t in tensors if not t.shape or (spec.kind in ("zero1", "zero2") and t.group == "model")]
    writers = _replicated_writers(replicated, N)
    groups: dict[str, list[TensorEntry]] = {}
    for t in tensors:
        if t.name in writers:
            _replicate_into(out, t, writers[t.name])
            out.group_layouts[t.group] = f"replicate:dp={N}" if t.group == "model" else out.group_layouts[t.group]
        else:
            groups.setdefault(t.group, []).append(t)
            out.placements[t.name] = "flat"
    for members in groups.values():
        cursor, starts = 0, []
        for t in members:
            starts.append(cursor)
            cursor += -(-prod(t.shape) // A) * A
        part = -(-(-(-cursor // N)) // A) * A  # ceil(total / N) rounded up to the alignment
        for t, s in zip(members, starts):
            n = prod(t.shape)
            for r in range(N):
                lo, hi = max(s, r * part), min(s + n, (r + 1) * part)
                if hi > lo:
                    out.chunks.append(TargetChunk(r, t.name, Region(flat=(lo - s, hi - lo))))
    return out


def _role(param: str) -> str:
    """``layers.3.mlp.experts.7.down_proj.weight`` -> ``layers.*.mlp.experts.*.down_proj.weight``."""
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", param)


def _layout_owner(spec: LayoutSpec, tensors: list[TensorEntry]) -> TargetLayout:
    """Whole logical matrices (a weight and its optimizer state together) on one rank each.

    With ``group=role``, matrices of one role and shape (MoE down/up/gate across
    layers and experts) are batched: each batch of at most ``max-per-rank``
    (or an even share) lands whole on one rank, so it can run one batched
    Newton-Schulz; no matrix is ever split.
    """
    out = _new(spec, tensors, str(spec))
    sizes: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for t in tensors:
        p = logical_param(t)
        sizes[p] = sizes.get(p, 0) + _nbytes(t)
        if len(t.shape) >= 2 and p not in shapes:
            shapes[p] = tuple(t.shape)
    unit_of = {p: p for p in sizes}
    if spec.group == "role":
        batches: dict[tuple, list[str]] = {}
        for p in sizes:
            if p in shapes:
                batches.setdefault((_role(p), shapes[p]), []).append(p)
        for (role, _), members in batches.items():
            size = spec.max_per_rank or -(-len(members) // spec.dp)
            for i in range(0, len(members), size):
                for p in members[i:i + size]:
                    unit_of[p] = f"{role}#{i // size}"
    units: dict[str, int] = {}
    counts: dict[str, int] = {}
    for p, n in sizes.items():
        u = unit_of[p]
        units[u] = units.get(u, 0) + n
        counts[u] = counts.get(u, 0) + (p in shapes)
    owner = lpt_assign(list(units.items()), spec.dp, cap=spec.max_per_rank, counted=counts)
    for t in tensors:
        if (c := _full(t, owner[unit_of[logical_param(t)]])) is not None:
            out.chunks.append(c)
        out.placements[t.name] = "owner"
    return out


def _layout_pp(spec: LayoutSpec, tensors: list[TensorEntry]) -> TargetLayout:
    """Contiguous layer ranges per stage, balanced by bytes; layer-less tensors that come before
    the first layer (embeddings) go to stage 0, the rest (final norm, head) to the last stage."""
    out = _new(spec, tensors, str(spec))
    P = spec.pp
    order: list[str] = []
    layer_of: dict[str, int | None] = {}
    sizes: dict[int, int] = {}
    for t in tensors:
        p = logical_param(t)
        m = LAYER.search(p)
        if p not in layer_of:
            order.append(p)
            layer_of[p] = int(m.group(1)) if m else None
        if m:
            sizes[int(m.group(1))] = sizes.get(int(m.group(1)), 0) + _nbytes(t)
    layers = sorted(sizes)
    if len(layers) < P:
        raise InvalidRequest(f"pp={P} needs at least {P} layers; the checkpoint has {len(layers)}",
                             spec=str(spec), layers=len(layers))
    stage_of_layer: dict[int, int] = {}
    target = sum(sizes.values()) / P
    stage, acc = 0, 0
    for i, layer in enumerate(layers):
        later_stages = P - 1 - stage
        if acc and later_stages and (acc + sizes[layer] > target or len(layers) - i <= later_stages):
            stage, acc = stage + 1, 0
        stage_of_layer[layer] = stage
        acc += sizes[layer]
    first_layered = next(i for i, p in enumerate(order) if layer_of[p] is not None)
    for t in tensors:
        p = logical_param(t)
        lay = layer_of[p]
        st = stage_of_layer[lay] if lay is not None else (0 if order.index(p) < first_layered else P - 1)
        if (c := _full(t, st)) is not None:
            out.chunks.append(c)
        out.placements[t.name] = f"stage{st}"
    return out


def rank_bytes(layout: TargetLayout, tensors: Sequence[TensorEntry]) -> list[dict[str, int]]:
    """Bytes each target rank writes, per state group."""
    size = {t.name: itemsize(t.dtype) for t in tensors}
    group = {t.name: t.group for t in tensors}
    out: list[dict[str, int]] = [{} for _ in range(layout.world_size)]
    for c in layout.chunks:
        g = group[c.tensor]
        out[c.rank][g] = out[c.rank].get(g, 0) + c.numel * size[c.tensor]
    return out
