"""Offline reads of stored tensors: a tensor's row-major stream, slab by slab, from any layout, every
block verified (export and the layout-independent digest read through it)."""

from __future__ import annotations

from math import prod
from typing import Callable, Iterator

from ckptd_schemas import Manifest, ReadRequest, TensorEntry, plan_reads, run_fetches

from ckptd_schemas.format.engines import ChunkBuffer

__all__ = ["ReadFn", "iter_slabs"]

ReadFn = Callable[[str, int, int], bytes]  # (file, start, end) -> bytes of a data file


def iter_slabs(manifest: Manifest, t: TensorEntry, read: ReadFn, *, slab_elems: int, buffer: ChunkBuffer,
               dtype: str | None = None) -> Iterator[tuple[memoryview, memoryview]]:
    """The tensor's row-major flattening in slabs of at most ``slab_elems`` elements, each assembled in
    ``buffer`` from whatever chunks hold it and block-verified: bounded memory for any layout.

    Yields (the slab's stored bytes, the same slab as ``dtype``), views valid until the next slab; a
    ``dtype`` other than the stored one needs a buffer that casts (``TorchEngine``)."""
    numel = prod(t.shape)
    step = max(1, slab_elems)
    for start in range(0, numel, step):
        n = min(step, numel - start)
        plan = plan_reads(manifest, [ReadRequest(name=t.name, flat_start=start, flat_length=n)])
        buffer.begin(t.dtype, n, t.shape, flat_start=start)
        run_fetches(plan, lambda f: read(f.file, f.start, f.end), buffer.copy)  # no copy: the engine copies out
        stored = buffer.result(t.dtype)
        yield stored, (stored if dtype is None or dtype == t.dtype else buffer.result(dtype))
