"""Where chunks sit in their tensor's row-major byte stream, for piecewise digests.

A reshard checks that every target tensor's layout-independent digest equals
the source's (``ckptd_schemas.digest``). The executor computes both from
bytes it already holds: the verified source fetches (``SourcePieces``) and the
target chunks it writes (``target_place``, ``write_hashed``, then
``digest_piece``).
Only chunks that are one row-major contiguous run can be placed in the stream
this way; tensors with other chunks (column shards, compressed frames) are
left to the slab walk.

Speed: the block arithmetic and hashing live in one place,
``ckptd_schemas.digest`` (``digest_piece`` hashes a piece's whole blocks in
one comprehension, ``block_values``); this module only places pieces in
their streams. A target chunk is hashed four times (its chunk
XXH3, its digest blocks, the file sink's whole-file and 1 MiB block digests)
and copied once more by the write; ``write_hashed`` feeds all of them slice by
slice, so the chunk is read from memory once and every later pass over a slice
finds it in the CPU cache.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from math import prod
from typing import Callable, Iterable

import xxhash

from ckptd_schemas import BoxChunk, Chunk, FlatChunk, Manifest, itemsize
from ckptd_schemas.digest import DIGEST_BLOCK, DigestPart, block_values, digest_piece, whole_blocks
from ckptd_schemas.geometry import Box, is_row_major_contiguous, row_major_strides

__all__ = ["SLICE", "SourcePieces", "stream_start", "target_place", "write_hashed"]

_B = DIGEST_BLOCK
SLICE = 16 * DIGEST_BLOCK  # write_hashed's unit of work: 1 MiB, small enough to stay in cache while hashed


def stream_start(shape: list[int], chunk: Chunk | tuple[list[int] | None, list[int] | None, int | None]) -> int | None:
    """First element of the chunk in the row-major flattening, or None when it is not one run."""
    if isinstance(chunk, FlatChunk):
        return chunk.start
    if isinstance(chunk, BoxChunk):
        offsets, sizes = chunk.offsets, chunk.sizes
    else:
        offsets, sizes, flat = chunk
        if offsets is None or sizes is None:
            return flat
    if prod(sizes) == 0:
        return None
    box = Box(tuple(offsets), tuple(sizes))
    if not is_row_major_contiguous(box, shape):
        return None
    return sum(o * s for o, s in zip(offsets, row_major_strides(shape)))


@dataclass(frozen=True)
class _Span:
    file_offset: int
    length: int
    tensor: str
    stream_offset: int
    nbytes: int


class SourcePieces:
    """Maps verified byte ranges of source files to digest parts of the tensors they hold.

    ``tensors`` limits the work to the tensors whose source digest is needed.
    """

    def __init__(self, manifest: Manifest, tensors: Iterable[str]) -> None:
        want = set(tensors)
        by_file: dict[str, list[_Span]] = {}
        for t in manifest.tensors:
            if t.name not in want:
                continue
            isz = itemsize(t.dtype)
            spans = []
            for c in t.chunks:
                start = stream_start(t.shape, c)
                if c.location is None or c.location.codec != "raw" or start is None:
                    break
                spans.append(_Span(c.location.offset, c.location.length, t.name, start * isz, prod(t.shape) * isz))
            else:
                for c, s in zip(t.chunks, spans):
                    by_file.setdefault(c.location.file, []).append(s)
        self._spans = {f: sorted(v, key=lambda s: s.file_offset) for f, v in by_file.items()}
        self._starts = {f: [s.file_offset for s in v] for f, v in self._spans.items()}

    def parts(self, file: str, start: int, data: memoryview, whole: set[tuple[str, int]] | None = None
              ) -> list[DigestPart]:
        """Digest parts of every placeable chunk overlapping ``data`` (bytes [start, start+len) of ``file``).

        ``whole``: the chunks (file, offset) this caller already has a whole part of, skipped, and added to
        as whole parts are made. A reader fetches the same verification blocks for many target chunks (a
        block holds many small chunks: every norm and bias of a rank), and without it would hash every
        chunk of the block once per fetch: 400 parts per target chunk at 200 small tensors a file."""
        spans = self._spans.get(file)
        if not spans:
            return []
        end = start + len(data)
        out = []
        i = max(0, bisect_right(self._starts[file], start) - 1)
        while i < len(spans) and spans[i].file_offset < end:
            s = spans[i]
            i += 1
            a, b = max(start, s.file_offset), min(end, s.file_offset + s.length)
            if b <= a:
                continue
            if whole is not None:
                if (file, s.file_offset) in whole:
                    continue
                if b - a == s.length:
                    whole.add((file, s.file_offset))
            out.append(digest_piece("src", s.tensor, s.nbytes, s.stream_offset + a - s.file_offset,
                                    data[a - start:b - start], file=file, file_offset=a))
        return out


def target_place(shape: list[int], dtype: str, geometry: tuple[list[int] | None, list[int] | None, int | None]
                 ) -> tuple[int, int] | None:
    """(byte offset in its tensor's row-major stream, the stream's bytes) of a target chunk, or None when the
    chunk is not one run (its tensor is then checked by the slab walk)."""
    start = stream_start(shape, geometry)
    if start is None:
        return None
    isz = itemsize(dtype)
    return start * isz, prod(shape) * isz


def write_hashed(write: Callable[[memoryview], None], raw: memoryview, place: tuple[int, int] | None
                 ) -> tuple[str, list[int]]:
    """Pass ``raw`` (a target chunk at ``place``, see ``target_place``) to ``write`` in slices of about
    ``SLICE`` bytes cut at digest-block boundaries, hashing each slice just before it is written: returns the
    chunk's XXH3-64 (hex) and the values of the whole digest blocks it holds (``digest_piece``'s ``values``).
    ``write`` (a file sink, which hashes the file as well) then reads the slice from cache."""
    chunk = xxhash.xxh3_64()
    values: list[int] = []
    base = place[0] if place is not None else 0
    end = base + len(raw)
    lo, hi = whole_blocks(base, end, place[1]) if place is not None else (end, end)
    cuts = sorted({base, *range(lo, hi, SLICE), hi, end} if lo < hi else {*range(base, end, SLICE), end})
    for a, b in zip(cuts, cuts[1:]):
        piece = raw[a - base:b - base]
        chunk.update(piece)
        if lo <= a < hi:
            values += block_values(raw, base, a, b)
        write(piece)
    return chunk.hexdigest(), values
