"""Describe a ZeRO/FSDP1-style flat partition as FlatShards (the ``zero3:dp=N,align=A`` layout).

ZeRO-3 and FSDP1 keep, per rank, one contiguous slice of the concatenation of
all parameters (each padded to ``align`` elements). :func:`flat_partition`
maps that rank's flat buffer back to per-parameter :class:`FlatShard` views,
so ``CheckpointClient.save`` records each parameter's global shape and range,
and ``load`` refills the same buffer at any dp size::

    shards = flat_partition([("model.l1.weight", (45, 24)), ("model.l1.bias", (45,))],
                            flat_buf, rank=rank, world=world, align=16)
    client.save({**shards, "step": step}, "zero/100")
"""

from __future__ import annotations

from math import prod
from typing import Sequence

import torch

from ckptd_schemas import InvalidRequest

from .flat import FlatShard

__all__ = ["flat_partition", "partition_size"]


def partition_size(shapes: Sequence[Sequence[int]], world: int, align: int = 1) -> int:
    """Elements per rank: the padded total divided by ``world``, rounded up to ``align``."""
    total = sum(-(-prod(s) // align) * align for s in shapes)
    return -(-(-(-total // world)) // align) * align


def flat_partition(params: Sequence[tuple[str, Sequence[int]]], flat: torch.Tensor, *, rank: int, world: int,
                   align: int = 1) -> dict[str, FlatShard]:
    """FlatShards viewing ``flat`` (this rank's partition) for every parameter it overlaps."""
    part = partition_size([s for _, s in params], world, align)
    if flat.dim() != 1 or flat.numel() != part:
        raise InvalidRequest(f"rank {rank}: flat buffer has {flat.numel()} elements, the partition has {part}",
                             rank=rank)
    lo_rank, hi_rank = rank * part, (rank + 1) * part
    out: dict[str, FlatShard] = {}
    cursor = 0
    for name, shape in params:
        n = prod(shape)
        lo, hi = max(cursor, lo_rank), min(cursor + n, hi_rank)
        if hi > lo:
            out[name] = FlatShard(flat[lo - lo_rank:hi - lo_rank], tuple(shape), lo - cursor)
        cursor += -(-n // align) * align
    return out
