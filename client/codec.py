"""Compression as a choice made by measurement, and frames small enough for ranged reads.

Two stored codecs: ``"zstd"`` (zstd level 1 over the chunk's bytes) and ``"blosc2"`` (a Blosc2
chunk: the bytes split into byte planes, byte k of every element together, then zstd level 1;
:func:`codec_for`). Floats compress poorly as a byte stream, their exponent bytes interleaved
with near-random mantissa bytes; as planes, the exponent plane compresses and the others are
stored nearly as they are: on a small trained model, 0.81 of raw for fp32 weights and 0.67 for
bf16, against 0.90 and 0.75 for plain zstd, decoding as fast as zstd or up to 2.4 times faster
(BENCHMARKS.md, Compression). Byte planes need elements of two bytes or more; one-byte dtypes
use plain zstd.

Either compresses at roughly 0.2-0.6 GB/s per core, while a local disk takes durable writes at
over 1 GB/s: there compression only makes a save slower. On a slow store (remote S3) the bytes
saved outweigh the CPU time. :class:`CompressionPolicy` decides per chunk from a timed run of
the chunk's codec on a sample of it and the observed upload throughput of this client.

Cost model: ``_pack`` compresses every chunk before the first byte is uploaded,
so compressing costs its CPU time *plus* the upload of what is left::

    raw:        raw_bytes / store_bw
    compressed: compress_seconds + stored_bytes / store_bw

Compressed chunks are cut into frames of at most :data:`FRAME_BYTES` raw bytes
(:func:`split_frames`), each its own chunk, so a ranged read fetches and decodes
only the frames it overlaps instead of the whole shard.

Every decode is bounded by the chunk's size, numel x itemsize (:func:`decode_frame`): a
frame's own header is never trusted for how much memory to give it.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import zstandard

from ckptd_schemas import ChecksumMismatch, Copy, itemsize

__all__ = ["CODECS", "DEFAULT_STORE_BW", "FRAME_BYTES", "SAMPLE_BYTES", "CompressionPolicy", "Measurement",
           "BLOSC2_OVERHEAD", "blosc2_problem", "codec_for", "compression_of", "decode_frame", "encode", "measure", "measure_zstd",
           "source_bytes", "split_frames"]

CODECS = ("zstd", "blosc2")
"""The compressed codecs a chunk may be stored with (``"raw"`` besides)."""
BLOSC2_OVERHEAD = 32
"""The most a Blosc2 chunk adds to its data (``blosc2.MAX_OVERHEAD``): a longer frame is refused unread."""

FRAME_BYTES = 4 << 20
"""Largest raw size of one compressed chunk: the most a ranged read decodes beyond what it needs."""
SAMPLE_BYTES = 1 << 20
"""Bytes of each chunk (from its middle) compressed to measure speed and ratio."""
DEFAULT_STORE_BW = 1.0e9
"""Upload throughput (bytes/s) assumed until this client has timed an upload: about a local disk's
durable write rate, so the first save compresses only data that compresses well and fast."""
MIN_OBSERVED_BYTES = 8 << 20
"""Uploads smaller than this say more about request latency than throughput; they are not used."""
LEVEL = 1


@dataclass(frozen=True)
class Measurement:
    """zstd on a sample: ``raw`` bytes in, ``stored`` bytes out, in ``seconds`` of CPU/wall time."""

    raw: int
    stored: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.stored / self.raw if self.raw else 1.0

    @property
    def speed(self) -> float:
        """Raw bytes compressed per second (infinite if the clock did not move)."""
        return self.raw / self.seconds if self.seconds > 0 else math.inf


def _sample(data: memoryview, n: int) -> memoryview:
    """Up to ``n`` bytes from the middle: the edges of a tensor (padding, embeddings of rare tokens)
    are the least typical of it."""
    if len(data) <= n:
        return data
    lo = (len(data) - n) // 2
    return data[lo:lo + n]


_LOCAL = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    """One zstd-1 context per thread, kept: a context's first use allocates and faults in its tables
    (several times slower), which would bias every measurement towards raw."""
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
        return _compressor().compress(data)
    if codec == "blosc2":
        import blosc2

        return blosc2.compress2(data, codec=blosc2.Codec.ZSTD, clevel=LEVEL, typesize=itemsize,
                                filters=[blosc2.Filter.SHUFFLE], nthreads=1)
    raise ValueError(f"unknown codec {codec!r}")


def measure(data: memoryview | bytes, codec: str = "zstd", itemsize: int = 1, *, sample_bytes: int = SAMPLE_BYTES,
            clock: Callable[[], float] = time.perf_counter) -> Measurement:
    """Compress a sample of ``data`` with ``codec`` and time it, as the machine is now (other
    threads of the trainer competing for the cores included)."""
    view = memoryview(data).cast("B")
    sample = _sample(view, sample_bytes - sample_bytes % max(itemsize, 1))
    sample = sample[:len(sample) - len(sample) % max(itemsize, 1)]
    if codec == "zstd":
        _compressor()  # the context's first use is not timed (see _compressor)
    t0 = clock()
    stored = len(encode(sample, codec, itemsize))
    return Measurement(len(sample), stored, clock() - t0)


def measure_zstd(data: memoryview | bytes, *, sample_bytes: int = SAMPLE_BYTES,
                 clock: Callable[[], float] = time.perf_counter) -> Measurement:
    """:func:`measure` with plain zstd."""
    return measure(data, "zstd", 1, sample_bytes=sample_bytes, clock=clock)


class CompressionPolicy:
    """Decides per chunk whether zstd makes the save faster; learns the store's throughput.

    Args:
        store_bw: upload throughput (stored bytes/s) to assume until one is observed
            (:data:`DEFAULT_STORE_BW`); pass the known rate of a slow store to compress from the first save.
        margin: compress only if the estimated time is at least this fraction below storing raw
            (measurement noise should not flip decisions back and forth).
        max_ratio: compress only if the sample shrinks below this fraction of its size.
        clock: the timer used by :meth:`measure` (tests inject a fake one).

    ``observe`` is called by the uploader after each upload; the estimate is a moving
    average (half weight to the newest), so a store that slows down is noticed at the next save.
    """

    def __init__(self, store_bw: float = DEFAULT_STORE_BW, *, margin: float = 0.05, max_ratio: float = 0.95,
                 sample_bytes: int = SAMPLE_BYTES, clock: Callable[[], float] = time.perf_counter) -> None:
        if store_bw <= 0:
            raise ValueError(f"store_bw must be positive, not {store_bw}")
        self.store_bw = float(store_bw)
        self.margin, self.max_ratio = margin, max_ratio
        self.sample_bytes, self.clock = sample_bytes, clock
        self.observed = 0  # uploads that fed the estimate

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold one completed upload (bytes stored, wall seconds) into the throughput estimate."""
        if nbytes < MIN_OBSERVED_BYTES or seconds <= 0:
            return
        bw = nbytes / seconds
        self.store_bw = bw if self.observed == 0 else 0.5 * (self.store_bw + bw)
        self.observed += 1

    def decide(self, nbytes: int, m: Measurement) -> bool:
        """True when compressing ``nbytes`` raw bytes, at the speed and ratio of ``m``, is faster."""
        if nbytes == 0 or m.ratio >= self.max_ratio:
            return False
        raw_time = nbytes / self.store_bw
        zstd_time = nbytes / m.speed + nbytes * m.ratio / self.store_bw
        return zstd_time < (1.0 - self.margin) * raw_time

    def measure(self, data: memoryview | bytes, itemsize: int = 1) -> Measurement:
        return measure(data, codec_for(itemsize), itemsize, sample_bytes=self.sample_bytes, clock=self.clock)

    def should_compress(self, data: memoryview | bytes, itemsize: int = 1) -> bool:
        """Measure a sample of ``data`` (elements of ``itemsize`` bytes) with its codec and decide."""
        n = len(memoryview(data).cast("B"))
        return n > 0 and self.decide(n, self.measure(data, itemsize))

    def __repr__(self) -> str:
        return (f"CompressionPolicy(store_bw={self.store_bw / 1e6:.0f} MB/s, observed={self.observed}, "
                f"margin={self.margin}, max_ratio={self.max_ratio})")


def compression_of(option: "str | CompressionPolicy | None") -> "str | CompressionPolicy | None":
    """The client option as the uploader takes it: ``"auto"`` becomes a fresh policy; ``"zstd"``
    (always plain zstd) and ``"planes"`` (always :func:`codec_for`'s codec) stay as they are."""
    if option == "auto":
        return CompressionPolicy()
    if option is None or option in ("zstd", "planes") or isinstance(option, CompressionPolicy):
        return option
    raise ValueError(f"compression must be None, 'zstd', 'planes', 'auto' or a CompressionPolicy, not {option!r}")


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


_LOCAL = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    """One decompressor per thread: a ZstdDecompressor must not be used by two threads at once
    (loads decode frames on several fetch threads; a shared one corrupts its output)."""
    d = getattr(_LOCAL, "dctx", None)
    if d is None:
        d = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return d


def blosc2_problem(frame: bytes | bytearray | memoryview, raw_length: int,
                   out: bytearray | None = None) -> str | None:
    """What is wrong with a ``"blosc2"`` frame that must decode to ``raw_length`` bytes, or None.

    Its header must declare exactly ``raw_length`` bytes and exactly the frame's own length (so
    nothing follows it) before anything is decoded, and the decode goes into a buffer of
    ``raw_length`` bytes (``out``, or a scratch one): no header is trusted for how much memory to
    give it."""
    import blosc2

    view = memoryview(frame)
    if len(view) < 16 or len(view) > raw_length + BLOSC2_OVERHEAD:
        return f"Blosc2 frame of {len(view)} bytes cannot hold {raw_length} bytes"
    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(view)
    except (ValueError, RuntimeError) as e:
        return f"Blosc2 frame header does not parse: {e}"
    if nbytes != raw_length or cbytes != len(view):
        return (f"Blosc2 frame header says {nbytes} bytes in {cbytes}, its chunk holds {raw_length} bytes in "
                f"{len(view)}")
    try:
        blosc2.decompress2(view, dst=out if out is not None else bytearray(raw_length), nthreads=1)
    except (ValueError, RuntimeError) as e:
        return f"Blosc2 frame does not decode: {e}"
    return None


def decode_frame(frame: bytes | bytearray | memoryview, raw_length: int, what: str,
                 codec: str = "zstd") -> bytearray:
    """The ``codec`` ``frame`` decoded into exactly ``raw_length`` bytes, never more.

    ``"blosc2"``: checked by :func:`blosc2_problem` while it decodes into the result. ``"zstd"``:

    Streamed into a buffer of ``raw_length`` + 1 bytes: a frame that decodes to more (a
    decompression bomb, or a declared length that lies) costs at most that buffer, whatever its
    header claims (``decompress(max_output_size=...)`` trusts the header's content size), and is
    refused ``ChecksumMismatch`` naming ``what``; as is one that decodes to less or not at all.
    """
    if codec == "blosc2":
        out = bytearray(raw_length)
        why = blosc2_problem(frame, raw_length, out)
        if why is not None:
            raise ChecksumMismatch(f"{what}: {why}", length=raw_length)
        return out
    out = bytearray(raw_length + 1)
    view = memoryview(out)
    got = 0
    try:
        reader = _dctx().stream_reader(frame, read_across_frames=False)
        while got <= raw_length:
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
    except zstandard.ZstdError as e:
        raise ChecksumMismatch(f"{what}: zstd frame does not decode: {e}", length=raw_length) from None
    finally:
        view.release()
    if got != raw_length:
        how = "more than" if got > raw_length else f"{got} bytes, not"
        raise ChecksumMismatch(f"{what}: zstd frame decodes to {how} the {raw_length} bytes its chunk holds",
                               length=raw_length)
    del out[raw_length:]
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
