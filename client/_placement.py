"""Where this rank's tensors sit in the global tensors: boxes, flat ranges, writers.

Pure functions of (state-dict leaf, rank, world); no I/O. Shared by save
(which chunks this rank writes) and load (which regions it needs).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ckptd_schemas import Box, InvalidRequest
from ckptd_schemas.dtypes import ITEMSIZE

from .flat import FlatShard

__all__ = ["LocalPiece", "check_savable", "dtype_name", "local_piece", "mesh_of", "shard_box"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_savable(fqn: str, value: object) -> None:
    """Raise :class:`InvalidRequest` naming ``fqn`` when its tensor has no dense bytes of a stored
    dtype: sparse or other non-strided layouts, nested and quantized tensors, the meta device, or a
    dtype the manifest cannot name (sub-byte ``uint1`` .. ``int7``). Anything else is saved bit for bit."""
    t = value.local if isinstance(value, FlatShard) else value
    if isinstance(t, DTensor):
        t = t._local_tensor
    if not isinstance(t, torch.Tensor):
        return
    kind = None
    if t.is_nested:
        kind = "a nested tensor"
    elif t.layout != torch.strided:
        kind = f"a {str(t.layout).removeprefix('torch.')} tensor (only dense, strided tensors are saved; .to_dense() first)"
    elif t.is_quantized:
        kind = f"a quantized tensor ({dtype_name(t.dtype)}; .dequantize() or .int_repr() first)"
    elif t.is_meta:
        kind = "on the meta device (it holds no data)"
    elif dtype_name(t.dtype) not in ITEMSIZE:
        kind = f"of dtype {dtype_name(t.dtype)}, which checkpoints cannot hold (stored dtypes: {', '.join(ITEMSIZE)})"
    if kind is not None:
        raise InvalidRequest(f"tensor {fqn!r} is {kind}", tensor=fqn, dtype=dtype_name(t.dtype))


@dataclass
class LocalPiece:
    """The part of a global tensor that one rank holds, and whether it writes it."""

    shape: tuple[int, ...]         # global shape
    dtype: torch.dtype
    local: torch.Tensor            # the rank's data (box: shaped like the box; flat: 1-D)
    box: Box | None = None
    flat: tuple[int, int] | None = None
    replicated: bool = False       # plain tensor: every rank holds all of it
    writes: bool = True            # this rank writes the chunk (replicas are written once)
    placement: str | None = None

    @property
    def numel(self) -> int:
        return self.local.numel()


def shard_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              placements: Sequence[object]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The local shape and global offsets of the shard at mesh coordinate ``coord`` when every
    placement is ``Shard`` or ``Replicate``; None for any other placement (``_StridedShard``, ...).

    The same answer as torch's ``compute_local_shape_and_global_offset``, which materialises an
    index tensor as long as each sharded dimension (an ``arange`` over 32 M elements costs about as
    much as copying them): shards of ``Shard`` placements are contiguous ranges, so nesting them
    adds offsets. A dimension cut to nothing sits at offset ``shape[dim]``, as torch reports it.
    """
    local, start = list(shape), [0] * len(shape)
    empty = [False] * len(shape)
    for mesh_dim, p in enumerate(placements):
        if type(p) is Replicate:
            continue
        if type(p) is not Shard:
            return None
        d = p.dim if p.dim >= 0 else p.dim + len(shape)
        n, k, i = local[d], mesh_shape[mesh_dim], coord[mesh_dim]
        full = n // k if n % k == 0 else -(-n // k)  # torch.chunk's sizes
        size = max(0, min(n, full * i + full) - full * i)
        if size == 0:
            empty[d] = True
        else:
            start[d] += full * i
        local[d] = size
    return tuple(local), tuple(shape[d] if empty[d] else start[d] for d in range(len(shape)))


def local_piece(fqn: str, value: object) -> LocalPiece:
    """Describe a tensor leaf: DTensor (box from its placements), FlatShard, or plain (replicated)."""
    check_savable(fqn, value)
    if isinstance(value, FlatShard):
        return LocalPiece(tuple(value.global_shape), value.local.dtype, value.local,
                          flat=(value.flat_offset, value.local.numel()), placement="flat")
    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh, placements = value.device_mesh, value.placements
        if any(isinstance(p, Partial) for p in placements):
            raise InvalidRequest(f"tensor {fqn!r} is a Partial DTensor; reduce it before saving", tensor=fqn)
        shape = tuple(value.shape)
        coord = mesh.get_coordinate()
        known = coord is not None and shard_box(shape, tuple(mesh.shape), coord, placements)
        if known:
            local_shape, offsets = known
        else:
            local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        with torch.no_grad():
            local = value.to_local()
        if tuple(local.shape) != tuple(local_shape):
            raise InvalidRequest(f"tensor {fqn!r}: local shard shape {tuple(local.shape)} does not match "
                                 f"placements {placements} (expected {tuple(local_shape)})", tensor=fqn)
        writes = coord is not None
        h = zlib.crc32(fqn.encode())  # the replica that writes: the same on every rank and in every process
        for dim, p in enumerate(placements):
            if isinstance(p, Replicate) and coord is not None:
                writes = writes and coord[dim] == h % mesh.size(dim)
        return LocalPiece(shape, value.dtype, local, box=Box(tuple(offsets), tuple(local_shape)),
                          writes=writes, placement=str(tuple(placements)))
    if isinstance(value, torch.Tensor):
        return LocalPiece(tuple(value.shape), value.dtype, value.detach(), box=Box.full(value.shape),
                          replicated=True, placement="replicate")
    raise TypeError(f"{fqn!r} is not a tensor")


def mesh_of(values: Sequence[object], world: int) -> tuple[dict[str, int], dict[str, int]]:
    """Named mesh dims and this rank's coordinates from the first full-world DTensor mesh."""
    for v in values:
        if isinstance(v, DTensor) and v.device_mesh.size() == world:
            mesh = v.device_mesh
            names = mesh.mesh_dim_names or (("dp",) if mesh.ndim == 1 else tuple(f"dim{i}" for i in range(mesh.ndim)))
            coord = mesh.get_coordinate() or []
            return ({n: mesh.size(i) for i, n in enumerate(names)}, {n: int(c) for n, c in zip(names, coord)})
    return ({}, {})
