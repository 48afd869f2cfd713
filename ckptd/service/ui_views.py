"""What the web view shows of a manifest, as plain JSON-ready dicts: pure, no I/O.

``ui_routes`` asks the store for a visible checkpoint's manifest and hands it here:

* :func:`manifest_stats`: one row of a run's checkpoint table (sizes, counts, layout), computed
  once per manifest digest (``ui_routes`` caches it by digest: a digest fixes the bytes);
* :func:`tensor_row`: one tensor of the manifest tree, with its chunks and the geometry of each
  rank's part (:func:`segments`) for the per-rank picture;
* :func:`page`: the paging every list answer shares.

Sizes, because a manifest says three different things about bytes: ``logical_bytes`` is every
tensor once, decoded (``numel x itemsize``; a replicated tensor is saved once, so this is what a
save without replicas would write); ``stored_bytes`` is the chunks as stored (after compression);
``file_bytes`` is the data files (chunks, objects and alignment padding), of which
``linked_bytes`` were linked from an earlier checkpoint (incremental saves) and ``written_bytes``
were actually written by this save; ``unchanged_bytes`` is what the save reused: the bytes of the
chunks and objects in those linked files (``Manifest.unchanged_bytes``, as ``ckptd show`` reports).
"""

from __future__ import annotations

import json
from math import prod
from typing import Any, Sequence, TypeVar

from ckptd_schemas import Manifest, TensorEntry, itemsize

__all__ = ["CHUNKS_SHOWN", "SEGMENTS_SHOWN", "manifest_stats", "object_row", "page", "param_group_row", "segments",
           "tensor_row"]

T = TypeVar("T")
CHUNKS_SHOWN = 64  # chunk rows per tensor in an answer (the count says how many there are)
SEGMENTS_SHOWN = 1024  # rank segments per tensor in an answer (the picture of a 1,024-rank tensor)
VALUE_CHARS = 300  # of an object's JSON value


def page(items: Sequence[T], offset: int, limit: int, **extra: Any) -> dict[str, Any]:
    """``{"items", "total", "offset", "limit"}``: ``items[offset:offset + limit]``."""
    return {"items": list(items[offset:offset + limit]), "total": len(items), "offset": offset, "limit": limit,
            **extra}


def manifest_stats(m: Manifest) -> dict[str, Any]:
    """The per-checkpoint figures of a run's table (see the module docstring for the byte counts)."""
    logical = stored = chunks = compressed = 0
    rank_bytes: dict[int, int] = {}
    groups: dict[str, dict[str, int]] = {}
    for t in m.tensors:
        tab = t.table
        n = prod(t.shape) * itemsize(t.dtype)
        logical += n
        s = sum(tab.length)
        stored += s
        chunks += len(tab)
        if tab.codec is not None:
            compressed += sum(c != "raw" for c in tab.codec)
        for r, length in zip(tab.rank or [0] * len(tab), tab.length):
            rank_bytes[r] = rank_bytes.get(r, 0) + length
        g = groups.setdefault(t.group, {"tensors": 0, "logical_bytes": 0, "stored_bytes": 0})
        g["tensors"] += 1
        g["logical_bytes"] += n
        g["stored_bytes"] += s
    total, linked = m.total_bytes, m.linked_bytes
    return {
        "files": len(m.files), "file_bytes": total, "linked_bytes": linked, "written_bytes": total - linked,
        "unchanged_bytes": m.unchanged_bytes,
        "linked_files": sum(f.linked is not None for f in m.files.values()),
        "logical_bytes": logical, "stored_bytes": stored, "chunks": chunks, "compressed_chunks": compressed,
        "tensors": len(m.tensors), "objects": len(m.objects), "param_groups": len(m.param_groups),
        "world_size": m.topology.world_size, "mesh": dict(m.topology.mesh), "layouts": dict(m.topology.layouts),
        "created_at": m.created_at.isoformat(), "parent": m.parent,
        "groups": groups, "rank_bytes": [rank_bytes.get(r, 0) for r in range(m.topology.world_size)],
    }


def segments(t: TensorEntry, limit: int = SEGMENTS_SHOWN) -> list[list[float]]:
    """Each chunk's place in the tensor as ``[rank, x0, x1, y0, y1]``, fractions of a unit box: x
    along dim 0 (a flat chunk: along the row-major flattening), y along dim 1 (the whole height for
    tensors of fewer than 2 dimensions and for flat chunks). A box of a 3-D or higher tensor is
    drawn by its first two dimensions."""
    tab, shape = t.table, t.shape
    numel = prod(shape)
    out: list[list[float]] = []
    if numel == 0:
        return out
    ranks = tab.rank or [0] * len(tab)
    for i in range(min(len(tab), limit)):
        offs, sizes = tab.offsets[i], tab.sizes[i]
        if tab.is_flat(i):
            x0, x1, y0, y1 = offs[0] / numel, (offs[0] + sizes[0]) / numel, 0.0, 1.0
        elif not shape:
            x0, x1, y0, y1 = 0.0, 1.0, 0.0, 1.0
        else:
            x0, x1 = offs[0] / shape[0], (offs[0] + sizes[0]) / shape[0]
            y0, y1 = (offs[1] / shape[1], (offs[1] + sizes[1]) / shape[1]) if len(shape) > 1 else (0.0, 1.0)
        out.append([ranks[i], round(x0, 6), round(x1, 6), round(y0, 6), round(y1, 6)])
    return out


def tensor_row(t: TensorEntry, chunks_shown: int = CHUNKS_SHOWN) -> dict[str, Any]:
    """A tensor of the manifest tree: its description, its chunks (the first ``chunks_shown``) and
    its rank segments."""
    tab = t.table
    ranks = tab.rank or [0] * len(tab)
    rows = []
    for i in range(min(len(tab), chunks_shown)):
        flat = tab.is_flat(i)
        where = ({"start": tab.offsets[i][0], "numel": tab.sizes[i][0]} if flat  # elements; "length" is bytes
                 else {"offsets": list(tab.offsets[i]), "sizes": list(tab.sizes[i])})
        rows.append({"rank": ranks[i], "kind": "flat" if flat else "box", **where, "file": tab.file[i],
                     "offset": tab.offset[i], "length": tab.length[i], "codec": tab.codec_of(i), "xxh3": tab.xxh3[i]})
    return {
        "name": t.name, "shape": list(t.shape), "dtype": t.dtype, "group": t.group, "placement": t.placement,
        "digest": t.digest, "numel": prod(t.shape), "logical_bytes": prod(t.shape) * itemsize(t.dtype),
        "stored_bytes": sum(tab.length), "chunk_count": len(tab), "ranks": sorted(set(ranks)),
        "codecs": sorted({tab.codec_of(i) for i in range(len(tab))}), "chunks": rows, "segments": segments(t),
    }


def object_row(o: Any) -> dict[str, Any]:
    """An object entry: its home, and its JSON value cut to :data:`VALUE_CHARS` characters."""
    value = None
    if o.encoding == "json":
        text = json.dumps(o.value, default=str)
        value = text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS] + "..."
    loc = o.location
    return {"name": o.name, "rank": o.rank, "encoding": o.encoding, "value": value,
            "file": loc.file if loc else None, "length": loc.length if loc else None}


def param_group_row(g: Any, params_shown: int = 20) -> dict[str, Any]:
    return {"optimizer": g.optimizer, "index": g.index, "params": len(g.params),
            "first_params": [str(p) for p in g.params[:params_shown]], "hyperparams": g.hyperparams}
