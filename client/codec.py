"""Compression as a choice made by measurement: whether a chunk is stored compressed.

What a compressed chunk is (the ``"zstd"`` and ``"blosc2"`` codecs, frames of at most
``FRAME_BYTES`` raw bytes, the bounded decode) is the byte format's, in
:mod:`ckptd_schemas.format.encoding`. This module holds the writer's choice.

Either codec compresses more slowly per core than a local disk takes durable writes (BENCHMARKS.md,
Compression): there compression only makes a save slower. On a slow store (remote S3) the bytes
saved outweigh the CPU time. :class:`CompressionPolicy` decides per chunk from a timed run of
the chunk's codec (:func:`codec_for`) on a sample of it and the observed upload throughput of
this client.

Cost model: ``_pack`` compresses every chunk before the first byte is uploaded,
so compressing costs its CPU time *plus* the upload of what is left::

    raw:        raw_bytes / store_bw
    compressed: compress_seconds + stored_bytes / store_bw
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from ckptd_schemas.format.encoding import codec_for, compressor, encode

__all__ = ["DEFAULT_STORE_BW", "SAMPLE_BYTES", "CompressionPolicy", "Measurement", "compression_of", "measure"]

SAMPLE_BYTES = 1 << 20
"""Bytes of each chunk (from its middle) compressed to measure speed and ratio."""
DEFAULT_STORE_BW = 1.0e9
"""Upload throughput (bytes/s) assumed until this client has timed an upload: about a local disk's
durable write rate, so the first save compresses only data that compresses well and fast."""
MIN_OBSERVED_BYTES = 8 << 20
"""Uploads smaller than this say more about request latency than throughput; they are not used."""


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


def measure(data: memoryview | bytes, codec: str = "zstd", itemsize: int = 1, *, sample_bytes: int = SAMPLE_BYTES,
            clock: Callable[[], float] = time.perf_counter) -> Measurement:
    """Compress a sample of ``data`` with ``codec`` and time it, as the machine is now (other
    threads of the trainer competing for the cores included)."""
    view = memoryview(data).cast("B")
    sample = _sample(view, sample_bytes - sample_bytes % max(itemsize, 1))
    sample = sample[:len(sample) - len(sample) % max(itemsize, 1)]
    if codec == "zstd":
        compressor()  # the context's first use is not timed (see compressor)
    t0 = clock()
    stored = len(encode(sample, codec, itemsize))
    return Measurement(len(sample), stored, clock() - t0)


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
