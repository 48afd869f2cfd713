"""Layout-independent tensor digests computed by walking a stored tensor in slabs.

The definition lives in ``ckptd_schemas.digest``. This walk assembles the
tensor's row-major stream slab by slab (bounded memory, any layout) and is
the fallback for pieces that are not row-major contiguous (column shards),
for cast sources, and for ``ckptd verify``-style checks. With ``cast``,
floating tensors are cast before hashing (the digest a cast conversion must
reproduce).
"""

from __future__ import annotations

from ckptd_schemas import Manifest, TensorEntry, itemsize
from ckptd_schemas.digest import DIGEST_BLOCK, StreamHasher

from ckptd_schemas.format.engines import HostEngine, TorchEngine, iter_slabs
from ckptd_schemas.readplan import ReadFn

from .planner import cast_dtype

__all__ = ["tensor_digest"]


def tensor_digest(manifest: Manifest, t: TensorEntry, read: ReadFn, *, cast: str | None = None,
                  slab_bytes: int = 32 << 20) -> str:
    """The digest of ``t`` as stored, or cast to ``cast`` (floating tensors only): on the host engine,
    torch only for a cast."""
    out = cast_dtype(t.dtype, cast)
    widest = max(itemsize(t.dtype), itemsize(out))
    engine = HostEngine() if out == t.dtype else TorchEngine("cpu")
    h = StreamHasher()
    for _, raw in iter_slabs(manifest, t, read, slab_elems=max(DIGEST_BLOCK, slab_bytes // widest),
                             buffer=engine.buffer(slab_bytes), dtype=out):
        h.update(raw)
    return h.hexdigest()
