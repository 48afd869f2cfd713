"""Layout-independent tensor digests: XXH3-64 of the full tensor's row-major bytes.

Computed by walking each tensor in flat slabs (bounded memory), assembling
every slab from whatever chunks hold it, so two checkpoints of one tensor in
different layouts have equal digests iff their values are bit-identical.
With ``cast``, floating tensors are cast before hashing (the digest a cast
conversion must reproduce).
"""

from __future__ import annotations

import torch
import xxhash

from ckptd_client.assemble import torch_dtype
from ckptd_schemas import Manifest, TensorEntry, itemsize
from ckptd_schemas.dtypes import FLOATING as FLOATS

from ..store.offline import ReadFn, iter_slabs

__all__ = ["ReadFn", "tensor_digest", "tensor_digests"]



def tensor_digest(manifest: Manifest, t: TensorEntry, read: ReadFn, *, cast: str | None = None,
                  slab_bytes: int = 32 << 20) -> str:
    h = xxhash.xxh3_64()
    out_dtype = torch_dtype(cast if cast is not None and t.dtype in FLOATS else t.dtype)
    for buf in iter_slabs(manifest, t, read, slab_elems=slab_bytes // itemsize(t.dtype)):
        if buf.dtype != out_dtype:
            buf = buf.to(out_dtype)
        h.update(memoryview(buf.view(torch.uint8).numpy()))
    return h.hexdigest()


def tensor_digests(manifest: Manifest, read: ReadFn, *, cast: str | None = None,
                   names: set[str] | None = None) -> dict[str, str]:
    return {t.name: tensor_digest(manifest, t, read, cast=cast) for t in manifest.tensors
            if names is None or t.name in names}
