"""Where chunks sit in their tensor's row-major byte stream, for piecewise digests.

A reshard checks that every target tensor's layout-independent digest equals
the source's (``ckptd_schemas.digest``). The executor computes both from
bytes it already holds: the verified source fetches (``SourcePieces``) and the
target chunks it writes (``target_piece``). Only chunks that are one
row-major contiguous run can be placed in the stream this way; tensors with
other chunks (column shards, compressed frames) are left to the slab walk.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from math import prod
from typing import Iterable

from ckptd_schemas import BoxChunk, Chunk, FlatChunk, Manifest, itemsize
from ckptd_schemas.digest import DigestPart, digest_piece
from ckptd_schemas.geometry import Box, is_row_major_contiguous, row_major_strides

__all__ = ["SourcePieces", "stream_start", "target_piece"]


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

    def parts(self, file: str, start: int, data: memoryview) -> list[DigestPart]:
        """Digest parts of every placeable chunk overlapping ``data`` (bytes [start, start+len) of ``file``)."""
        spans = self._spans.get(file)
        if not spans:
            return []
        end = start + len(data)
        out = []
        i = max(0, bisect_right(self._starts[file], start) - 1)
        while i < len(spans) and spans[i].file_offset < end:
            s = spans[i]
            a, b = max(start, s.file_offset), min(end, s.file_offset + s.length)
            if b > a:
                out.append(digest_piece("src", s.tensor, s.nbytes, s.stream_offset + a - s.file_offset,
                                        data[a - start:b - start], file=file, file_offset=a))
            i += 1
        return out


def target_piece(tensor: str, shape: list[int], dtype: str, geometry: tuple[list[int] | None, list[int] | None,
                 int | None], raw: memoryview, *, file: str, file_offset: int) -> DigestPart | None:
    """The digest part of one written target chunk (``raw``: its bytes), or None when it is not one run."""
    start = stream_start(shape, geometry)
    if start is None:
        return None
    isz = itemsize(dtype)
    return digest_piece("dst", tensor, prod(shape) * isz, start * isz, raw, file=file, file_offset=file_offset)
