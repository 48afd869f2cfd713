"""A chunk's stored encoding: how its bytes are compressed, cut into frames and decoded, on both sides.

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
:func:`blosc2_problem`), and that by :data:`FRAME_BYTES` (the frame limit, refused before anything is
allocated: :func:`~ckptd_schemas.format.frames.frame_limit_problem`): neither a frame's own header nor
an index's declared size is trusted for how much memory to give it.
Readers (``CheckpointClient.load``, the service's reshard engines and export) take a copy's bytes
out of a verified fetch with :func:`source_bytes`; the commit checks frames as they stream
(:mod:`ckptd_schemas.format.frames`).
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import TYPE_CHECKING, Iterator

import zstandard

from ..dtypes import itemsize
from ..errors import ChecksumMismatch
from .frames import BLOSC2_OVERHEAD, FRAME_BYTES, FrameCheck, blosc2_problem, frame_limit_problem

if TYPE_CHECKING:
    from ..readplan import Copy

__all__ = ["BLOSC2_OVERHEAD", "FRAME_BYTES", "LEVEL", "blosc2_problem", "codec_for", "compressor",
           "decode_frame", "encode", "source_bytes", "split_frames"]

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
    """``data`` compressed with ``codec`` (``"zstd"`` or ``"blosc2"``), as one independently decodable frame."""
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
    chunk's own flattening and its region in the tensor, in order. Flat chunks are cut into
    consecutive ranges. Box chunks are cut along the outermost dimension ``d`` whose trailing block
    (one index of ``d``: dimensions ``d + 1`` on) fits ``limit``: dimension 0 at row boundaries when a
    row fits, else each index of dimensions before ``d`` on its own, so no piece is over ``limit``
    (the frame limit every decoder enforces) while an element fits it.
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
    d = next((d for d in range(len(sizes)) if math.prod(sizes[d + 1:]) * itemsize <= limit), len(sizes) - 1)
    inner = math.prod(sizes[d + 1:])
    step = max(1, limit // (inner * itemsize))
    for lead, outer in enumerate(itertools.product(*map(range, sizes[:d]))):
        for r0 in range(0, sizes[d], step):
            n = min(step, sizes[d] - r0)
            at = [o + i for o, i in zip(offsets, outer)] + [offsets[d] + r0, *offsets[d + 1:]]
            yield (lead * sizes[d] + r0) * inner, n * inner, (at, [1] * d + [n, *sizes[d + 1:]]), None


def decode_frame(frame: bytes | bytearray | memoryview, raw_length: int, what: str,
                 codec: str = "zstd") -> bytearray:
    """The ``codec`` ``frame`` decoded into exactly ``raw_length`` bytes, never more.

    A ``raw_length`` over :data:`FRAME_BYTES` is refused before anything is allocated (a reader is
    never made to allocate more than one frame, whatever the manifest declares).

    ``"blosc2"``: checked by :func:`blosc2_problem` while it decodes into the result. ``"zstd"``:
    decoded by the commit's own check (:class:`~ckptd_schemas.format.frames.FrameCheck`, keeping its
    output): exactly one plain frame declaring ``raw_length`` as its content size, decoding to exactly
    that; output past it is never written (a decompression bomb costs one write piece). Anything else
    is refused ``ChecksumMismatch`` naming ``what``, so readers (load, reshard, export) accept exactly
    the frames the commit and ``ckptd verify`` accept.
    """
    if (why := frame_limit_problem(codec, raw_length)) is None:
        out = bytearray(raw_length)
        if codec == "blosc2":
            why = blosc2_problem(frame, raw_length, out)
        else:
            check = FrameCheck(raw_length, memoryview(out))
            check.feed(frame)
            why = check.problem()
    if why is not None:
        raise ChecksumMismatch(f"{what}: {why}", length=raw_length)
    return out


def source_bytes(buf: bytes | bytearray | memoryview, c: Copy) -> memoryview:
    """The raw bytes of ``c``'s source positions ``[pos0, pos0 + npos)``: a view into the verified fetch
    ``buf`` when stored raw, the decoded frame (writable, its own memory) when compressed, decoded
    to at most the chunk's size (``npos`` x itemsize of its dtype, at most :data:`FRAME_BYTES`;
    :func:`decode_frame`)."""
    mv = memoryview(buf)[c.byte_start:c.byte_start + c.byte_length]
    if c.codec != "raw":
        what = f"tensor {c.tensor!r} (chunk {c.chunk_xxh3} at byte {c.byte_start} of fetch {c.fetch})"
        return memoryview(decode_frame(mv, c.npos * itemsize(c.dtype), what, c.codec))
    return mv
