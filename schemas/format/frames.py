"""A compressed chunk checked as its bytes pass, in bounded memory: the commit's codec check.

:func:`frame_check` gives the check for a chunk's codec: :class:`FrameCheck` for zstd,
:class:`Blosc2Check` for blosc2 (byte planes; :mod:`ckptd_schemas.format.encoding`).

:class:`FrameCheck` is fed a compressed chunk's stored bytes in order (``feed``), then asked
``problem()``. It holds when the bytes are exactly one complete zstd frame, without a
dictionary, whose header declares ``raw_length`` as its content size (a reader decodes the frame
in one call sized by that header) and which decodes to exactly ``raw_length`` bytes.

Two readers of the same bytes, so neither has to trust the other:

* the frame's structure (header, then block headers, then the optional checksum; RFC 8878 §3.1.1)
  is walked from the 3-byte block headers alone: where the frame ends, and whether bytes follow it;
* a streaming decoder writes its output in pieces of at most :data:`WRITE_SIZE` bytes into a
  counter that stops the decode once it passes ``raw_length``, so a frame that decodes to more than
  it declares (or a decompression bomb: zstd can expand 4 bytes into 128 KiB) costs at most
  ``raw_length + WRITE_SIZE`` bytes of output, all of it counted and dropped.

Memory is bounded whatever a writer declares: a compressed chunk holds at most :data:`FRAME_BYTES`
raw bytes (the writer cuts its chunks there, ``ckptd_schemas.format.encoding.split_frames``), and a
chunk declaring more is refused by :func:`frame_check` (and by every reader's decode) before
anything is allocated for it, so no header or index can make a check allocate more than one frame;
the zstd decoder refuses a window over :data:`FRAME_BYTES` too. :meth:`FrameCheck.problem` frees its
decoder once it has its verdict.
"""

from __future__ import annotations

from typing import Callable, Union

import zstandard


__all__ = ["BLOSC2_OVERHEAD", "FRAME_BYTES", "WRITE_SIZE", "Blosc2Check", "ChunkCheck", "FrameCheck",
           "blosc2_problem", "frame_check", "frame_limit_problem"]

FRAME_BYTES = 4 << 20
"""Largest raw size of one compressed chunk (the frame limit): the most any decode of one chunk
allocates, and the most a ranged read decodes beyond what it needs."""

BLOSC2_OVERHEAD = 32
"""The most a Blosc2 chunk adds to its data (``blosc2.MAX_OVERHEAD``): a longer frame is refused unread."""

WRITE_SIZE = 1 << 17
_MAGIC = 0xFD2FB528
_DICT_ID_BYTES = (0, 1, 2, 4)
_FCS_BYTES = (0, 2, 4, 8)  # FCS_flag 0 means 1 byte when the frame is a single segment


def frame_limit_problem(codec: str, raw_length: int) -> str | None:
    """Why a ``codec`` chunk of ``raw_length`` raw bytes may not be decoded at all, or None: more
    than :data:`FRAME_BYTES` (or a negative size). Asked before anything is allocated for it."""
    if 0 <= raw_length <= FRAME_BYTES:
        return None
    return (f"{codec} chunk of {raw_length} raw bytes is over the {FRAME_BYTES}-byte frame limit of a compressed "
            f"chunk")


class _TooLong(Exception):
    pass


class _Counter:
    """The decoder's output: counted, and kept only where ``out`` is given (a reader's buffer of the
    chunk's ``limit`` bytes); output past the limit is never written anywhere."""

    def __init__(self, limit: int, out: memoryview | None = None) -> None:
        self.limit, self.n, self.out = limit, 0, out

    def write(self, data: bytes) -> int:
        start = self.n
        self.n += len(data)
        if self.n > self.limit:
            raise _TooLong
        if self.out is not None:
            self.out[start:self.n] = data
        return len(data)


class FrameCheck:
    """One compressed chunk's bytes, fed in order; ``problem()`` says what is wrong, or None. With
    ``out`` (``raw_length`` writable bytes) the decoded bytes are kept there: readers decode through
    this same check (:func:`ckptd_schemas.format.encoding.decode_frame`), so a frame the commit refuses
    is refused by every reader too."""

    def __init__(self, raw_length: int, out: memoryview | None = None) -> None:
        self.raw_length = raw_length
        self._out = _Counter(raw_length, out)
        self._error = frame_limit_problem("zstd", raw_length)  # refused before a decoder is made
        self._decoder = None if self._error else zstandard.ZstdDecompressor(max_window_size=FRAME_BYTES).stream_writer(
            self._out, write_size=WRITE_SIZE, write_return_read=True, closefd=False)
        self._pos = 0             # bytes fed
        self._state = "header"    # header -> block (-> checksum) -> done
        self._want = 5            # bytes of the structure being collected (magic + frame header descriptor)
        self._buf = bytearray()
        self._skip = 0            # bytes of block content (or checksum) still to pass over
        self._last = False
        self._checksum = False
        self._after = 0           # bytes fed after the end of the frame

    # -- feeding ------------------------------------------------------------------------------
    def feed(self, data: memoryview | bytes) -> None:
        if self._error is not None or self._decoder is None:
            return
        view = memoryview(data)
        used = self._walk(view)
        if self._error is None and used:
            self._decode(self._decoder.write, view[:used])

    def _decode(self, step: Callable[..., object], *args: memoryview) -> None:
        """One step of the decoder (a write, or the final flush), its failure kept as the verdict."""
        try:
            step(*args)
        except _TooLong:
            self._error = f"zstd frame decodes to more than the {self.raw_length} bytes it should hold"
        except zstandard.ZstdError as e:
            self._error = f"zstd frame does not decode: {e}"

    def _walk(self, view: memoryview) -> int:
        """Advance the structure walk over ``view``; return how many of its bytes belong to the frame."""
        i, n = 0, len(view)
        while i < n and self._error is None:
            if self._state == "done":
                self._after += n - i
                self._pos += n - i
                return i
            if self._skip:
                take = min(self._skip, n - i)
                self._skip -= take
                i += take
                self._pos += take
                if not self._skip:
                    self._skipped()
                continue
            take = min(self._want - len(self._buf), n - i)
            self._buf += view[i:i + take]
            i += take
            self._pos += take
            if len(self._buf) == self._want:
                self._parse()
        return i

    def _parse(self) -> None:
        buf = bytes(self._buf)
        if self._state == "header":
            if int.from_bytes(buf[:4], "little") != _MAGIC:
                self._error = f"not a zstd frame (starts with {buf[:4].hex()})"
                return
            fhd = buf[4]
            single = (fhd >> 5) & 1
            if (fhd >> 3) & 1:
                self._error = "zstd frame header has its reserved bit set"
                return
            size = (5 + (0 if single else 1) + _DICT_ID_BYTES[fhd & 3]
                    + (_FCS_BYTES[fhd >> 6] or (1 if single else 0)))
            if len(buf) < size:
                self._want = size
                return
            try:
                params = zstandard.get_frame_parameters(buf)
            except zstandard.ZstdError as e:
                self._error = f"zstd frame header does not parse: {e}"
                return
            if params.dict_id:
                self._error = f"zstd frame needs dictionary {params.dict_id}"
            elif params.content_size != self.raw_length:
                said = "no content size" if params.content_size == zstandard.CONTENTSIZE_UNKNOWN else \
                    f"content size {params.content_size}"
                self._error = f"zstd frame header declares {said}, the chunk holds {self.raw_length} bytes"
            self._checksum = bool(params.has_checksum)
            self._state, self._want = "block", 3
        else:  # a block header: bit 0 last block, bits 1-2 type, bits 3-23 size
            h = int.from_bytes(buf, "little")
            kind, size = (h >> 1) & 3, h >> 3
            if kind == 3:
                self._error = f"zstd block of reserved type at byte {self._pos - 3} of the frame"
                return
            self._last = bool(h & 1)
            self._skip = 1 if kind == 1 else size  # RLE: one byte, repeated
            if not self._skip:
                self._skipped()
        self._buf.clear()

    def _skipped(self) -> None:
        """The content of a block (or the checksum) has passed."""
        if self._state == "checksum" or (self._last and not self._checksum):
            self._state = "done"
        elif self._last:
            self._state, self._skip = "checksum", 4

    # -- verdict ---------------------------------------------------------------------------------
    def problem(self) -> str | None:
        """The verdict, once every byte is fed; the decoder (up to a window of buffers) is freed."""
        if self._decoder is None:
            return self._error
        if self._error is None and self._state != "done":
            self._error = f"zstd frame is incomplete: its {self._pos} bytes end inside the frame"
        if self._error is None and self._after:
            self._error = f"{self._after} bytes follow the end of the zstd frame"
        if self._error is None:
            self._decode(self._decoder.flush)
        if self._error is None and self._out.n != self.raw_length:
            self._error = f"zstd frame decodes to {self._out.n} bytes, the chunk holds {self.raw_length}"
        self._decoder = None
        return self._error


class Blosc2Check:
    """One blosc2 chunk's bytes, fed in order; ``problem()`` as :class:`FrameCheck`'s. A Blosc2 frame
    is at most :data:`FRAME_BYTES` of raw data plus its header: it is collected (refused as soon
    as it is longer than any frame of ``raw_length`` bytes can be) and checked by
    :func:`blosc2_problem`: header sizes first, then a decode into ``raw_length``
    bytes. The collected bytes are freed with the verdict."""

    def __init__(self, raw_length: int) -> None:
        self.raw_length, self._limit = raw_length, raw_length + BLOSC2_OVERHEAD
        self._why = frame_limit_problem("blosc2", raw_length)  # refused before a byte is collected
        self._buf: bytearray | None = None if self._why else bytearray()
        self._too_long = False

    def feed(self, data: memoryview | bytes) -> None:
        if self._buf is not None and not self._too_long:
            self._buf += memoryview(data)[:self._limit + 1 - len(self._buf)]  # never more than one byte over
            self._too_long = len(self._buf) > self._limit

    def problem(self) -> str | None:
        if self._buf is not None:  # the first call judges and frees the collected bytes
            self._why = (f"Blosc2 frame is longer than any frame of {self.raw_length} bytes" if self._too_long
                         else blosc2_problem(self._buf, self.raw_length))
            self._buf = None
        return self._why


ChunkCheck = Union[FrameCheck, Blosc2Check]
"""What :func:`frame_check` gives: ``feed(bytes)`` in order, then ``problem()``."""


def frame_check(codec: str, raw_length: int) -> ChunkCheck:
    """The check of a chunk stored with ``codec`` (not raw) that must decode to ``raw_length`` bytes;
    a chunk over the frame limit is refused without a decoder or a buffer."""
    return Blosc2Check(raw_length) if codec == "blosc2" else FrameCheck(raw_length)


def blosc2_problem(frame: bytes | bytearray | memoryview, raw_length: int,
                   out: bytearray | None = None) -> str | None:
    """What is wrong with a ``"blosc2"`` frame that must decode to ``raw_length`` bytes, or None.

    Its header must declare exactly ``raw_length`` bytes and exactly the frame's own length (so
    nothing follows it) before anything is decoded, and the decode goes into a buffer of
    ``raw_length`` bytes (``out``, or a scratch one), never over :data:`FRAME_BYTES`: no header is
    trusted for how much memory to give it."""
    import blosc2

    if (why := frame_limit_problem("blosc2", raw_length)) is not None:
        return why
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
