"""Assembly of tensors from fetched byte ranges with torch: verify, decode, copy (shared by
``CheckpointClient.load``, the DCP reader and the service's torch engine, on any device).

A :class:`ckptd_schemas.ReadPlan` lists fetches (byte ranges with block
digests) and copies (which global boxes of which chunk land where). For each
fetch: :func:`ckptd_schemas.verify_fetch`, then for each of its copies
:func:`copy_into` with a destination described by :class:`Destination`; a
compressed chunk is decoded by :func:`ckptd_schemas.format.encoding.source_bytes`.
Non-tensor objects are decoded by :mod:`ckptd_schemas.format.objects`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from ..readplan import dest_region
from .encoding import source_bytes

if TYPE_CHECKING:
    from ..readplan import Copy

__all__ = ["Destination", "copy_into", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


@dataclass
class Destination:
    """Where a requested region lives in memory: a tensor holding a box of the global
    tensor (shaped like the box) or a 1-D tensor holding a flat range."""

    tensor: torch.Tensor
    global_shape: Sequence[int]
    box_offsets: Sequence[int] | None = None
    flat_start: int | None = None

    def view(self, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        dst = self.tensor
        strides, rel = dest_region(offsets, dst.stride(), global_shape=self.global_shape,
                                   box_offsets=self.box_offsets, flat_start=self.flat_start)
        return dst.as_strided(list(sizes), strides, dst.storage_offset() + rel)


def copy_into(buf: bytearray | memoryview, c: Copy, dest: Destination) -> None:
    """Copy every region of ``c`` from the fetched bytes into ``dest`` (cast if dtypes differ)."""
    dtype, raw = torch_dtype(c.dtype), source_bytes(buf, c)
    src = torch.frombuffer(raw, dtype=dtype) if len(raw) else torch.empty(0, dtype=dtype)
    src = src.to(dest.tensor.device)  # a no-op on the host
    with torch.no_grad():
        for offsets, sizes in c.regions:
            view = src.as_strided(sizes, c.strides, src.storage_offset() + c.source_offset(offsets))
            dest.view(offsets, sizes).copy_(view)
