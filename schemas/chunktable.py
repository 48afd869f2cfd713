"""Chunks stored as columns: the on-disk form of a tensor's chunks (format 2).

A manifest of 1,024 ranks x 500 tensors holds 512,000 chunks. As one object
per chunk (format 1) pydantic parsed it object by object, and the garbage
collector passed over millions of objects; as columns (one list per
field) the parse is a few list validations in pydantic-core, the checks below
are C-speed ``map``/slice passes, and chunk objects are built only for the
tensors a reader touches (:meth:`ChunkColumns.materialize`).

Row ``i`` of every column describes chunk ``i``. A box chunk stores its
per-dimension ``offsets`` and ``sizes``; a flat chunk (``flat[i]`` true) stores
``[start]`` and ``[length]``. The decoded byte length is not stored: it is
``numel * itemsize`` by definition, so it cannot disagree.

Pure: no I/O, no torch.
"""

from __future__ import annotations

from math import prod
from operator import add, le, mul
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field

from .dtypes import ITEMSIZE
from .geometry import Box, Region, check_tiling
from .chunks import BoxChunk, Codec, FileName, FlatChunk, Hex64, Location, NonNeg

__all__ = ["ChunkColumns", "check_columns", "check_columns_tiling", "columns_of", "index_rows_valid"]

_COLUMNS = ("offsets", "sizes", "file", "offset", "length", "xxh3")


class ChunkColumns(BaseModel):
    """One tensor's chunks as parallel lists (in a manifest ``rank`` is set; in a rank index ``tensor``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    rank: list[NonNeg] | None = Field(default=None, description="writer rank of each chunk (manifest)")
    tensor: list[NonNeg] | None = Field(default=None, description="position in the index's tensor list (rank index)")
    flat: list[bool] | None = Field(default=None, description="true for flat-range chunks; null: every chunk is a box")
    # tuples, not lists: pydantic-core parses 512,000 of them in half the time
    offsets: list[tuple[NonNeg, ...]] = Field(description="box: per-dimension offsets; flat: [start]")
    sizes: list[tuple[NonNeg, ...]] = Field(description="box: per-dimension sizes; flat: [length]")
    file: list[FileName]
    offset: list[NonNeg] = Field(description="byte offset of the stored bytes in the file")
    length: list[NonNeg] = Field(description="stored (possibly compressed) byte length")
    codec: list[Codec] | None = Field(default=None, description="null: every chunk is stored raw")
    xxh3: list[Hex64] = Field(description="XXH3-64 of the stored bytes")

    def __len__(self) -> int:
        return len(self.xxh3)

    def is_flat(self, i: int) -> bool:
        return self.flat is not None and self.flat[i]

    def codec_of(self, i: int) -> str:
        return "raw" if self.codec is None else self.codec[i]

    def region(self, i: int) -> Region:
        """What chunk ``i`` covers: its flat range, or its box."""
        if self.is_flat(i):
            return Region(flat=(self.offsets[i][0], self.sizes[i][0]))
        return Region(box=Box(tuple(self.offsets[i]), tuple(self.sizes[i])))

    def take(self, rows: Sequence[int], *, rank: int) -> dict:
        """Columns of the given rows, as keyword arguments for a new table whose rank column is ``rank``."""
        out: dict = {k: [getattr(self, k)[i] for i in rows] for k in _COLUMNS}
        out["flat"] = None if self.flat is None or not any(self.flat[i] for i in rows) else [self.flat[i] for i in rows]
        out["codec"] = (None if self.codec is None or all(self.codec[i] == "raw" for i in rows)
                        else [self.codec[i] for i in rows])
        out["rank"] = [rank] * len(rows)
        return out

    def materialize(self, itemsize: int) -> list:
        """Chunk objects (``BoxChunk`` / ``FlatChunk``) for the rows, built without re-validation."""
        ranks = self.rank
        out = []
        for i in range(len(self)):
            offs, sizes = self.offsets[i], self.sizes[i]
            flat = self.is_flat(i)
            numel = sizes[0] if flat else prod(sizes)
            loc = Location.model_construct(file=self.file[i], offset=self.offset[i], length=self.length[i],
                                           codec=self.codec_of(i), raw_length=numel * itemsize, xxh3=self.xxh3[i])
            r = ranks[i] if ranks is not None else 0
            if flat:
                out.append(FlatChunk.model_construct(kind="flat", rank=r, start=offs[0], length=sizes[0], location=loc))
            else:
                out.append(BoxChunk.model_construct(kind="box", rank=r, offsets=list(offs), sizes=list(sizes),
                                                    location=loc))
        return out


def columns_of(chunks: Sequence, dtype: str, *, name: str) -> dict:
    """Columns (keyword arguments of :class:`ChunkColumns`) from chunk objects or their dicts.

    The inverse of :meth:`ChunkColumns.materialize`; refuses a ``raw_length``
    that is not ``numel * itemsize``, since the columns do not keep it.
    """
    itemsize = ITEMSIZE[dtype]
    cols: dict = {k: [] for k in ("rank", "flat", *_COLUMNS, "codec")}
    for c in chunks:
        if isinstance(c, dict):
            c = (FlatChunk if c.get("kind") == "flat" else BoxChunk).model_validate(c)
        loc = c.location
        if c.kind == "flat":
            cols["offsets"].append((c.start,))
            cols["sizes"].append((c.length,))
            numel = c.length
        else:
            cols["offsets"].append(tuple(c.offsets))
            cols["sizes"].append(tuple(c.sizes))
            numel = prod(c.sizes)
        if loc.raw_length != numel * itemsize:
            raise ValueError(f"tensor {name!r}: chunk from rank {c.rank}: raw_length {loc.raw_length} != "
                             f"{numel} elements x {itemsize} bytes ({dtype})")
        cols["rank"].append(c.rank)
        cols["flat"].append(c.kind == "flat")
        cols["file"].append(loc.file)
        cols["offset"].append(loc.offset)
        cols["length"].append(loc.length)
        cols["codec"].append(loc.codec)
        cols["xxh3"].append(loc.xxh3)
    if not any(cols["flat"]):
        cols["flat"] = None
    if all(c == "raw" for c in cols["codec"]):
        cols["codec"] = None
    return cols


Dims = tuple[list[tuple[int, ...]], list[tuple[int, ...]]]  # offsets and sizes, one tuple per dimension


def check_columns(name: str, shape: Sequence[int], dtype: str, itemsize: int, t: ChunkColumns) -> Dims | None:
    """Raise ``ValueError`` naming the tensor and rank unless every chunk lies inside ``shape`` and
    every raw chunk's stored length is ``numel * itemsize``. Returns the transposed columns for
    :func:`check_columns_tiling` (None for mixed box/flat tables).

    Runs on every tensor of every manifest parsed and merged: passes over whole
    columns (``map``, slices, list equality) when the rows are uniform, the
    per-row loop only to name the culprit or for mixed box/flat tensors.
    """
    n = _rows(f"tensor {name!r}", t)
    if n == 0:
        return None
    ndim = len(shape)
    dims: Dims | None = None
    if t.flat is None or not any(t.flat):
        dims = _by_dim(ndim, t)
        ok = dims is not None and all(max(map(add, o, z)) <= d for o, z, d in zip(*dims, shape))
        numels = _box_numels(n, dims[1]) if ok else None  # type: ignore[index]
    elif all(t.flat):
        dims = _by_dim(1, t)
        ok = dims is not None and max(map(add, dims[0][0], dims[1][0])) <= prod(shape)
        numels = list(dims[1][0]) if ok else None  # type: ignore[index]
    else:
        ok, numels = False, None
    if ok and numels is not None:
        want = [x * itemsize for x in numels]
        if t.codec is None and want == t.length:
            return dims
        if t.codec is not None and all(c != "raw" or w == g for c, w, g in zip(t.codec, want, t.length)):
            return dims
    # Mixed box/flat rows, or something is off: check row by row (naming the first bad one).
    for i in range(n):
        _check_row(name, shape, dtype, itemsize, t, i, t.rank[i] if t.rank is not None else "?")
    return dims


def _rows(what: str, t: ChunkColumns) -> int:
    """The table's rows, once every column has one entry a row (else ``ValueError`` naming ``what``)."""
    n = len(t.xxh3)
    for k in ("rank", "tensor", "flat", "codec", *_COLUMNS):
        col = getattr(t, k)
        if col is not None and len(col) != n:
            raise ValueError(f"{what}: chunk column {k!r} has {len(col)} rows, xxh3 has {n}")
    return n


def _by_dim(ndim: int, t: ChunkColumns) -> Dims | None:
    """Offsets and sizes transposed to one tuple per dimension (C-speed ``zip``), or None when some
    row does not have ``ndim`` entries."""
    if set(map(len, t.offsets)) != {ndim} or set(map(len, t.sizes)) != {ndim}:
        return None
    return list(zip(*t.offsets)), list(zip(*t.sizes))


def _box_numels(n: int, sizes: list[tuple[int, ...]]) -> list[int]:
    if not sizes:
        return [1] * n
    out = list(sizes[0])
    for col in sizes[1:]:
        out = list(map(mul, out, col))
    return out


def index_rows_valid(rank: int, names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[str],
                     t: ChunkColumns) -> None:
    """:func:`check_columns` for a rank index, whose rows belong to different tensors (``t.tensor``)."""
    _rows(f"rank {rank}", t)
    for i, p in enumerate(t.tensor or ()):
        _check_row(names[p], shapes[p], dtypes[p], ITEMSIZE[dtypes[p]], t, i, rank)


def _check_row(name: str, shape: Sequence[int], dtype: str, itemsize: int, t: ChunkColumns, i: int,
               rank: object) -> None:
    offs, sizes = list(t.offsets[i]), list(t.sizes[i])
    if t.is_flat(i):
        if len(offs) != 1 or len(sizes) != 1:
            raise ValueError(f"tensor {name!r}: flat chunk from rank {rank} needs one start and one length")
        numel, total = sizes[0], prod(shape)
        if offs[0] + numel > total:
            raise ValueError(f"tensor {name!r}: chunk from rank {rank} flat range [{offs[0]}, "
                             f"{offs[0] + numel}) exceeds {total} elements")
    else:
        if len(offs) != len(shape) or len(sizes) != len(shape):
            raise ValueError(f"tensor {name!r}: chunk from rank {rank} has {len(offs)}-d offsets "
                             f"for a {len(shape)}-d shape {list(shape)}")
        if any(o + z > d for o, z, d in zip(offs, sizes, shape)):
            raise ValueError(f"tensor {name!r}: chunk from rank {rank} at offsets {offs} sizes "
                             f"{sizes} lies outside global shape {list(shape)}")
        numel = prod(sizes)
    if t.codec_of(i) == "raw" and t.length[i] != numel * itemsize:
        raise ValueError(f"tensor {name!r}: chunk from rank {rank}: raw_length {t.length[i]} != "
                         f"{numel} elements x {itemsize} bytes ({dtype})")


def check_columns_tiling(name: str, shape: Sequence[int], t: ChunkColumns, dims: Dims | None = None) -> None:
    """Raise ``TilingError`` unless the chunks cover ``shape`` exactly once (replicas with equal digests
    counted once), like :func:`ckptd_schemas.geometry.check_tiling`.

    The usual layouts (bands along one dimension: FSDP, ZeRO, Shard(d), one
    owner per tensor) are checked with whole-column passes; anything else, and
    every failure, goes through the general check, which names the culprits.
    """
    n = len(t.xxh3)
    if n and _bands_tile(shape, t, dims):
        return
    ranks = t.rank or [0] * n
    check_tiling(name, shape, [(t.region(i), ranks[i], t.xxh3[i]) for i in range(n)])


def _bands_tile(shape: Sequence[int], t: ChunkColumns, dims: Dims | None) -> bool:
    """True when every chunk spans all of the tensor but one dimension (or is a flat range) and the
    chunks, sorted, follow each other without gap or overlap from 0 to that dimension's extent."""
    n = len(t.xxh3)
    if t.flat is not None and any(t.flat):
        dims = dims or (_by_dim(1, t) if all(t.flat) else None)
        if dims is None:
            return False
        starts, lens, extent = dims[0][0], dims[1][0], prod(shape)
    else:
        ndim = len(shape)
        dims = dims or _by_dim(ndim, t)
        if dims is None or ndim == 0:
            return dims is not None and n == 1
        offs, sizes = dims
        partial = [k for k in range(ndim) if offs[k].count(0) != n or sizes[k].count(shape[k]) != n]
        if len(partial) > 1:
            return False
        k = partial[0] if partial else 0
        starts, lens, extent = offs[k], sizes[k], shape[k]
    if not all(map(le, starts, starts[1:])):
        order = sorted(range(n), key=starts.__getitem__)
        starts, lens = [starts[i] for i in order], [lens[i] for i in order]
    ends = list(map(add, starts, lens))
    return starts[0] == 0 and ends[-1] == extent and list(starts[1:]) == ends[:-1]
