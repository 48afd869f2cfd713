"""Layout-independent tensor digests that can be computed from pieces. Pure: no I/O.

Definition (``TensorEntry.digest``): split the tensor's row-major bytes (after
any dtype cast) into blocks of ``DIGEST_BLOCK`` bytes, the last one shorter;
the digest is the XXH3-64 of the blocks' XXH3-64 values, each as 8
little-endian bytes. Two copies of a tensor in any layouts have equal digests
iff their values are bit-identical (up to hash collisions).

Why blocks and not one XXH3 over the whole stream: a stream hash must see the
bytes in order, in one place, which forced a second pass over the data to
check a reshard. Block values can be computed wherever a piece of the stream
already sits in memory, in any order, thread or process: the reshard
executor hashes the source bytes it fetches and the target chunks it writes,
and never reads the data again. Only the ragged ends of pieces (at most two
partial blocks per piece) are kept, as references into files (``Edge``), and
``combine`` reads those few bytes to finish their blocks.

Call order: ``digest_piece`` for each piece seen (possibly overlapping, any
order) -> ``combine`` with every part and a reader for edges. For data that
arrives in order, ``StreamHasher`` gives the same value without edges.

Speed: a piece holds hundreds of blocks, so ``digest_piece`` finds its whole
blocks by arithmetic (``whole_blocks``) and hashes them in one comprehension
(``block_values``); only the (at most two) ragged ends are walked block by
block. A caller that already hashed the whole blocks while the bytes were in
cache (the reshard executor's ``write_hashed``) passes their ``values``.
This module is the one place that cuts a stream into digest blocks.
"""

from __future__ import annotations

from array import array
from typing import Callable, Iterable

import xxhash
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DIGEST_BLOCK", "DigestPart", "Edge", "StreamHasher", "block_values", "combine", "digest_of_blocks",
           "digest_piece", "whole_blocks"]

DIGEST_BLOCK = 64 << 10
_B = DIGEST_BLOCK


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class Edge(_M):
    """A partial block: ``length`` bytes at ``at`` within block ``block``, stored at ``file_offset`` of ``file``."""

    block: int = Field(ge=0)
    at: int = Field(ge=0, lt=DIGEST_BLOCK)
    length: int = Field(gt=0, le=DIGEST_BLOCK)
    file: str
    file_offset: int = Field(ge=0)


class DigestPart(_M):
    """What one piece of one tensor's stream contributes: whole blocks hashed, ragged ends referenced.

    ``side`` tells apart the streams being compared (a reshard's ``src`` and ``dst``).
    """

    side: str
    tensor: str
    first: int = Field(ge=0, description="index of the first whole block in ``blocks``")
    blocks: list[int] = Field(description="XXH3-64 of consecutive whole blocks from ``first``")
    edges: list[Edge] = []


def whole_blocks(offset: int, end: int, nbytes: int) -> tuple[int, int]:
    """[lo, hi): the whole digest blocks inside bytes [offset, end) of an ``nbytes`` stream (none: lo == hi).
    The stream's last block may be short; it is whole when the piece reaches the stream's end."""
    lo = -(-offset // _B) * _B
    hi = end if end == nbytes else end // _B * _B
    return lo, max(lo, hi)


def block_values(data: memoryview | bytes, base: int, a: int, b: int) -> list[int]:
    """XXH3-64 of the blocks starting at stream positions a, a + DIGEST_BLOCK, ... below b (``data`` holds the
    stream from position ``base``; a and b are block bounds, b possibly the short last block's end)."""
    h = xxhash.xxh3_64_intdigest
    mv = memoryview(data)[a - base:b - base]  # slices past its end stop at b: no min() per block
    return [h(mv[x:x + _B]) for x in range(0, len(mv), _B)]


def digest_piece(side: str, tensor: str, nbytes: int, offset: int, data: memoryview | bytes, *, file: str,
                 file_offset: int, values: list[int] | None = None) -> DigestPart:
    """Hash the whole blocks inside ``data`` (bytes [offset, offset+len) of a ``nbytes`` stream, stored at
    ``file_offset`` of ``file``); reference the partial ones.

    ``values``: the whole blocks' XXH3-64 when the caller already computed them (``block_values`` over the
    same bytes, e.g. while writing them); they are taken as given, only their count is checked."""
    mv = memoryview(data).cast("B")
    end = offset + len(mv)
    if not 0 <= offset <= end <= nbytes:
        raise ValueError(f"piece [{offset}, {end}) of tensor {tensor!r} outside its {nbytes} bytes")
    lo, hi = whole_blocks(offset, end, nbytes)
    count = -(-(hi - lo) // _B)
    if values is not None and len(values) != count:
        raise ValueError(f"piece [{offset}, {end}) of tensor {tensor!r} holds {count} whole blocks, "
                         f"{len(values)} values given")
    edges: list[Edge] = []
    for a, b in ((offset, lo), (hi, end)) if lo < hi else ((offset, end),):
        while a < b:  # ragged ends: within one block each, or within two when the piece holds no whole block
            i = a // _B
            c = min((i + 1) * _B, b)
            edges.append(Edge(block=i, at=a - i * _B, length=c - a, file=file, file_offset=file_offset + a - offset))
            a = c
    blocks = values if values is not None else block_values(mv, offset, lo, hi)
    return DigestPart(side=side, tensor=tensor, first=lo // _B if count else 0, blocks=blocks, edges=edges)


def digest_of_blocks(values: Iterable[int]) -> str:
    return xxhash.xxh3_64_hexdigest(array("Q", values).tobytes() if _LITTLE else _le(values))


def combine(parts: Iterable[DigestPart], nbytes: dict[tuple[str, str], int],
            read: Callable[[str, str, int, int], bytes]) -> dict[tuple[str, str], str]:
    """Digests of every (side, tensor) in ``nbytes`` whose blocks the parts cover; others are left out.

    ``read(side, file, start, end)`` returns stored bytes for an edge. Overlapping parts are fine
    (a block seen twice has one value); edges are read only for blocks no part hashed whole.
    """
    whole: dict[tuple[str, str], dict[int, int]] = {k: {} for k in nbytes}
    edges: dict[tuple[str, str], dict[int, list[Edge]]] = {k: {} for k in nbytes}
    for p in parts:
        key = (p.side, p.tensor)
        if key not in whole:
            continue
        got = whole[key]
        for j, v in enumerate(p.blocks):
            got[p.first + j] = v
        for e in p.edges:
            edges[key].setdefault(e.block, []).append(e)
    out: dict[tuple[str, str], str] = {}
    for key, n in nbytes.items():
        got = whole[key]
        count = -(-n // _B)
        for i in range(count):
            if i not in got:
                v = _finish(key[0], i, min(_B, n - i * _B), edges[key].get(i, []), read)
                if v is None:
                    break
                got[i] = v
        else:
            out[key] = digest_of_blocks(got[i] for i in range(count))
    return out


def _finish(side: str, block: int, size: int, edges: list[Edge], read: Callable[[str, str, int, int], bytes]
            ) -> int | None:
    """One block from the edges that cover it, or None if they leave a gap."""
    buf = bytearray(size)
    covered = 0  # edges sorted by start: the covered prefix grows or there is a gap
    for e in sorted(edges, key=lambda e: e.at):
        if e.at > covered:
            return None
        if e.at + e.length <= covered:
            continue
        data = read(side, e.file, e.file_offset, e.file_offset + e.length)
        if len(data) != e.length:
            return None
        buf[e.at:e.at + e.length] = data
        covered = e.at + e.length
    return xxhash.xxh3_64_intdigest(bytes(buf)) if covered >= size else None


class StreamHasher:
    """The digest of a stream fed in order (``update`` any sizes), with one partial block buffered."""

    def __init__(self) -> None:
        self._values: list[int] = []
        self._pending = bytearray()

    def update(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        if self._pending:
            take = min(_B - len(self._pending), len(mv))
            self._pending += mv[:take]
            mv = mv[take:]
            if len(self._pending) < _B:
                return
            self._values.append(xxhash.xxh3_64_intdigest(bytes(self._pending)))
            self._pending = bytearray()
        whole = len(mv) - len(mv) % _B
        self._values += block_values(mv, 0, 0, whole)
        self._pending += mv[whole:]

    def hexdigest(self) -> str:
        tail = [xxhash.xxh3_64_intdigest(bytes(self._pending))] if self._pending else []
        return digest_of_blocks([*self._values, *tail])


_LITTLE = array("Q", [1]).tobytes()[0] == 1


def _le(values: Iterable[int]) -> bytes:
    return b"".join(v.to_bytes(8, "little") for v in values)
