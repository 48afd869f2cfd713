"""The stored codecs: how a chunk's bytes are compressed, cut into frames and decoded, on both sides.

Two stored codecs besides ``"raw"``: ``"zstd"`` (zstd level 1 over the chunk's bytes) and
``"blosc2"`` (a Blosc2 chunk: the bytes split into byte planes, byte k of every element together,
then zstd level 1; :func:`codec_for`). Floats compress poorly as a byte stream, their exponent
bytes interleaved with near-random mantissa bytes; as planes, the exponent plane compresses and
the others are stored nearly as they are: on a small trained model, 0.81 of raw for fp32 weights
and 0.67 for bf16, against 0.90 and 0.75 for plain zstd, decoding as fast as zstd or up to 2.4
times faster (BENCHMARKS.md, Compression). Byte planes need elements of two bytes or more;
one-byte dtypes use plain zstd.

Whether a chunk is compressed at all is the writer's choice (``ckptd_client.codec.CompressionPolicy``);
what it stores is decided here. Compressed chunks are cut into frames of at most
:data:`FRAME_BYTES` raw bytes (:func:`split_frames`), each its own chunk, so a ranged read fetches
and decodes only the frames it overlaps instead of the whole shard.

Every decode is bounded by the chunk's size, numel x itemsize (:func:`decode_frame`,
:func:`blosc2_problem`): a frame's own header is never trusted for how much memory to give it.
Readers (``CheckpointClient.load``, the service's reshard engines and export) take a copy's bytes
out of a verified fetch with :func:`source_bytes`; the commit checks frames as they stream
(:mod:`ckptd_schemas.format.frames`).
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Iterator

import zstandard

from ..dtypes import itemsize
from ..errors import ChecksumMismatch
from .frames import BLOSC2_OVERHEAD, FrameCheck, blosc2_problem

if TYPE_CHECKING:
    from ..readplan import Copy

__all__ = ["BLOSC2_OVERHEAD", "CODECS", "FRAME_BYTES", "LEVEL", "blosc2_problem", "codec_for", "compressor",
           "decode_frame", "encode", "source_bytes", "split_frames"]

CODECS = ("zstd", "blosc2")
"""The compressed codecs a chunk may be stored with (``"raw"`` besides)."""
FRAME_BYTES = 4 << 20
"""Largest raw size of one compressed chunk: the most a ranged read decodes beyond what it needs."""
LEVEL = 1
"""The zstd level of both codecs."""

_LOCAL = threading.local()


def compressor() -> zstandard.ZstdCompressor:
    """This thread's zstd-1 context, kept: a context's first use allocates and faults in its tables
    (several times slower), which would bias every timed compression towards raw."""
    c = getattr(_LOCAL, "cctx", None)
    if c is None:
        c = _LOCAL.cctx = zstandard.ZstdCompressor(level=LEVEL)
    return c


def codec_for(itemsize: int) -> str:
    """The codec a compressed chunk of elements of ``itemsize`` bytes is stored with: byte planes
    (``"blosc2"``) for two bytes or more, plain ``"zstd"`` for one."""
    return "blosc2" if itemsize >= 2 else "zstd"


def encode(data: memoryview | bytes, codec: str, itemsize: int) -> bytes:
    """``data`` compressed with ``codec`` (one of :data:`CODECS`), as one independently decodable frame."""
    if codec == "zstd":
        return compressor().compress(data)
    if codec == "blosc2":
        import blosc2

        return blosc2.compress2(data, codec=blosc2.Codec.ZSTD, clevel=LEVEL, typesize=itemsize,
                                filters=[blosc2.Filter.SHUFFLE], nthreads=1)
    raise ValueError(f"unknown codec {codec!r}")


Box = tuple[list[int], list[int]]


def split_frames(itemsize: int, box: Box | None, flat: tuple[int, int] | None,
                 limit: int = FRAME_BYTES) -> Iterator[tuple[int, int, Box | None, tuple[int, int] | None]]:
    """Cut a chunk into pieces of at most ``limit`` raw bytes, each one row-major run of the chunk.

    Yields ``(first, count, box, flat)``: the piece's elements ``[first, first + count)`` of the
    chunk's own flattening and its region in the tensor. Box chunks are cut along dimension 0 at row
    boundaries (a single row larger than ``limit`` stays whole); flat chunks into consecutive ranges.
    """
    if flat is not None:
        start, length = flat
        step = max(1, limit // itemsize)
        for lo in range(0, length, step):
            n = min(step, length - lo)
            yield lo, n, None, (start + lo, n)
        return
    assert box is not None
    offsets, sizes = box
    numel = math.prod(sizes)
    if not sizes or numel * itemsize <= limit:
        yield 0, numel, box, None
        return
    row = math.prod(sizes[1:])
    rows = max(1, limit // (row * itemsize))
    for r0 in range(0, sizes[0], rows):
        n = min(rows, sizes[0] - r0)
        yield r0 * row, n * row, ([offsets[0] + r0, *offsets[1:]], [n, *sizes[1:]]), None


def decode_frame(frame: bytes | bytearray | memoryview, raw_length: int, what: str,
                 codec: str = "zstd") -> bytearray:
    """The ``codec`` ``frame`` decoded into exactly ``raw_length`` bytes, never more.

    ``"blosc2"``: checked by :func:`blosc2_problem` while it decodes into the result. ``"zstd"``:
    decoded by the commit's own check (:class:`~ckptd_schemas.format.frames.FrameCheck`, keeping its
    output): exactly one plain frame declaring ``raw_length`` as its content size, decoding to exactly
    that; output past it is never written (a decompression bomb costs one write piece). Anything else
    is refused ``ChecksumMismatch`` naming ``what``, so readers (load, reshard, export) accept exactly
    the frames the commit and ``ckptd verify`` accept.
    """
    if codec == "blosc2":
        out = bytearray(raw_length)
        why = blosc2_problem(frame, raw_length, out)
        if why is not None:
            raise ChecksumMismatch(f"{what}: {why}", length=raw_length)
        return out
    out = bytearray(raw_length)
    check = FrameCheck(raw_length, memoryview(out))
    check.feed(frame)
    why = check.problem()
    if why is not None:
        raise ChecksumMismatch(f"{what}: {why}", length=raw_length)
    return out


def source_bytes(buf: bytes | bytearray | memoryview, c: Copy, file: str | None = None) -> memoryview:
    """The raw bytes of ``c``'s source positions ``[pos0, pos0 + npos)``: a view into the verified fetch
    ``buf`` when stored raw, the decoded frame (writable, its own memory) when compressed, decoded
    to at most the chunk's size (``npos`` x itemsize of its dtype; :func:`decode_frame`)."""
    mv = memoryview(buf)[c.byte_start:c.byte_start + c.byte_length]
    if c.codec != "raw":
        where = f"file {file!r}, " if file else ""
        what = f"tensor {c.tensor!r} ({where}chunk {c.chunk_xxh3} at byte {c.byte_start} of fetch {c.fetch})"
        return memoryview(decode_frame(mv, c.npos * itemsize(c.dtype), what, c.codec))
    return mv
