"""Layout-independent tensor digests: XXH3-64 of the full tensor's row-major bytes.

Computed by walking each tensor in flat slabs (bounded memory), assembling
every slab from whatever chunks hold it, so two checkpoints of one tensor in
different layouts have equal digests iff their values are bit-identical.
With ``cast``, floating tensors are cast before hashing (the digest a cast
conversion must reproduce).
"""

from __future__ import annotations

from math import prod
from typing import Callable

import torch
import xxhash

from ckptd_client.assemble import Destination, copy_into, torch_dtype, verify_fetch
from ckptd_schemas import Manifest, ReadRequest, TensorEntry, itemsize, plan_reads

__all__ = ["ReadFn", "tensor_digest", "tensor_digests"]

ReadFn = Callable[[str, int, int], bytes]
FLOATS = {"float64", "float32", "float16", "bfloat16"}


def tensor_digest(manifest: Manifest, t: TensorEntry, read: ReadFn, *, cast: str | None = None,
                  slab_bytes: int = 32 << 20) -> str:
    h = xxhash.xxh3_64()
    numel = prod(t.shape)
    out_dtype = torch_dtype(cast if cast is not None and t.dtype in FLOATS else t.dtype)
    step = max(1, slab_bytes // itemsize(t.dtype))
    for start in range(0, numel, step):
        n = min(step, numel - start)
        plan = plan_reads(manifest, [ReadRequest(name=t.name, flat_start=start, flat_length=n)])
        buf = torch.empty(n, dtype=torch_dtype(t.dtype))
        dest = Destination(buf, t.shape, flat_start=start)
        for i, f in enumerate(plan.fetches):
            data = bytearray(read(f.file, f.start, f.end))
            verify_fetch(data, f)
            for c in plan.copies:
                if c.fetch == i:
                    copy_into(data, c, dest)
        if buf.dtype != out_dtype:
            buf = buf.to(out_dtype)
        h.update(memoryview(buf.view(torch.uint8).numpy()))
    return h.hexdigest()


def tensor_digests(manifest: Manifest, read: ReadFn, *, cast: str | None = None,
                   names: set[str] | None = None) -> dict[str, str]:
    return {t.name: tensor_digest(manifest, t, read, cast=cast) for t in manifest.tensors
            if names is None or t.name in names}
