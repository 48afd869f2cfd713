"""FlatShard: how flat-partitioned state (ZeRO-1/2/3, FSDP1) is described per parameter."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

import torch

from ckptd_schemas import InvalidRequest

__all__ = ["FlatShard"]


@dataclass(frozen=True)
class FlatShard:
    """Elements ``[flat_offset, flat_offset + local.numel())`` of a parameter's row-major flattening.

    ``local`` is a 1-D tensor, often a view into the rank's flat buffer; ``load``
    fills it in place at any dp size. Example (a 45x24 weight, this rank holds
    elements 1024..1535)::

        FlatShard(flat_buf[0:512], (45, 24), 1024)
    """

    local: torch.Tensor
    global_shape: Sequence[int]
    flat_offset: int

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor) or self.local.dim() != 1:
            raise InvalidRequest("FlatShard.local must be a 1-D tensor")
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        total = prod(self.global_shape)
        if self.flat_offset < 0 or self.flat_offset + self.local.numel() > total:
            raise InvalidRequest(
                f"FlatShard covers [{self.flat_offset}, {self.flat_offset + self.local.numel()}) "
                f"of a tensor with {total} elements")

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype
