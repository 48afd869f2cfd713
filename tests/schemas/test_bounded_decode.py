"""The stored codecs decode in bounded memory whatever a writer declares (``ckptd_schemas.format``).

Pure: no service. A chunk over the frame limit (``FRAME_BYTES``, 4 MiB raw) is refused by every
decoder before anything is allocated for it: the readers' ``decode_frame`` (load, reshard, export)
and the commit's ``frame_check``; a zstd frame asking for a window over the limit is refused; the
writer never cuts a frame over the limit, even from one row larger than it; an honest frame at the
limit still decodes. Memory is measured twice: Python's allocations (``tracemalloc``, where a
``bytearray`` of the declared size would show) and this process's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``, where the codec libraries' own buffers would show).
"""

from __future__ import annotations

import tracemalloc
from math import prod
from pathlib import Path

import pytest

from adversary.test_decompression_bombs import blosc2_zeros, zstd_zeros
from ckptd_schemas import ChecksumMismatch
from ckptd_schemas.format.encoding import FRAME_BYTES, decode_frame, encode, split_frames
from ckptd_schemas.format.frames import frame_check

MiB, GiB = 1 << 20, 1 << 30


def _hwm_mib() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


class _Peak:
    """Python's peak allocation and the growth of this process's peak RSS inside the block (MiB)."""

    def __enter__(self) -> "_Peak":
        Path("/proc/self/clear_refs").write_text("5")
        self.rss0 = _hwm_mib()
        tracemalloc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.python = tracemalloc.get_traced_memory()[1] / MiB
        tracemalloc.stop()
        self.rss = _hwm_mib() - self.rss0


BOMBS = {  # codec -> a few bytes that decode to 1 GiB of zeros, declaring it
    "blosc2": lambda: blosc2_zeros(GiB),
    "zstd": lambda: zstd_zeros(GiB, 27),
}


@pytest.mark.parametrize("codec", sorted(BOMBS))
def test_readers_refuse_a_bomb_over_the_frame_limit_without_allocating_it(codec):
    bomb = BOMBS[codec]()
    assert len(bomb) < 64 << 10
    with _Peak() as peak, pytest.raises(ChecksumMismatch, match=r"tensor 'model.b': .*frame limit") as err:
        decode_frame(bomb, GiB, "tensor 'model.b'", codec)
    assert err.value.details["length"] == GiB
    assert peak.python < 1, f"decode_frame allocated {peak.python:.0f} MiB for a {len(bomb)}-byte {codec} chunk"
    assert peak.rss < 64, f"the peak RSS grew by {peak.rss:.0f} MiB for a {len(bomb)}-byte {codec} chunk"


@pytest.mark.parametrize("codec", sorted(BOMBS))
def test_the_commit_s_check_refuses_a_bomb_over_the_frame_limit_without_a_decoder(codec):
    bomb = BOMBS[codec]()
    with _Peak() as peak:
        check = frame_check(codec, GiB)
        check.feed(bomb)
        why = check.problem()
    assert why is not None and "frame limit" in why and str(GiB) in why, why
    assert peak.python < 1 and peak.rss < 64, (peak.python, peak.rss)


@pytest.mark.parametrize("codec", sorted(BOMBS))
def test_a_frame_at_the_limit_still_decodes(codec):
    raw = bytes(range(256)) * (FRAME_BYTES // 256)
    assert bytes(decode_frame(encode(raw, codec, 4), FRAME_BYTES, "tensor 'model.w'", codec)) == raw
    check = frame_check(codec, FRAME_BYTES)
    check.feed(encode(raw, codec, 4))
    assert check.problem() is None


def test_a_zstd_window_over_the_frame_limit_is_refused():
    """A frame of 4 MiB that asks for a 128 MiB window: the decoder would allocate by the window."""
    frame = zstd_zeros(FRAME_BYTES, 27)
    with pytest.raises(ChecksumMismatch, match="does not decode"):
        decode_frame(frame, FRAME_BYTES, "tensor 'model.w'", "zstd")
    check = frame_check("zstd", FRAME_BYTES)
    check.feed(frame)
    assert "does not decode" in (check.problem() or "")
    assert bytes(decode_frame(zstd_zeros(FRAME_BYTES, 22), FRAME_BYTES, "tensor 'model.w'", "zstd")) == \
        bytes(FRAME_BYTES)


def test_a_zstd_bomb_under_the_limit_stops_at_the_declared_size():
    """Declared as 64 bytes, decoding to 1 GiB: stopped once past 64 bytes, in one write piece."""
    bomb = bytearray(zstd_zeros(GiB, 22))
    bomb[6:14] = (64).to_bytes(8, "little")  # the content size, after the descriptor and window bytes
    with _Peak() as peak, pytest.raises(ChecksumMismatch, match="more than the 64 bytes|does not decode"):
        decode_frame(bytes(bomb), 64, "tensor 'model.b'", "zstd")
    assert peak.python < 1 and peak.rss < 64, (peak.python, peak.rss)


@pytest.mark.parametrize("itemsize, sizes", [
    (4, [3, 2 * MiB]),            # rows of 8 MiB: cut within each row
    (4, [2, 3, 3 * MiB // 2]),    # 6 MiB rows of a 3-D chunk
    (8, [5, 7, 300_000]),         # 2.4 MiB rows, 16.8 MiB planes: cut at rows
    (2, [1, 1, 5 * MiB]),         # one 10 MiB row behind two unit dimensions
    (4, [2500, 1024]),            # rows fit: cut along dimension 0, as always
    (4, [1 << 20]),               # exactly the limit: one frame
])
def test_the_writer_never_cuts_a_frame_over_the_limit(itemsize, sizes):
    """Every frame is at most ``FRAME_BYTES``; the frames are the chunk's row-major runs, in order,
    and each one's box holds exactly its elements."""
    offsets = [3] * len(sizes)
    pieces = list(split_frames(itemsize, (offsets, sizes), None))
    at = 0
    strides = [prod(sizes[d + 1:]) for d in range(len(sizes))]
    for first, count, box, flat in pieces:
        assert flat is None and first == at and count * itemsize <= FRAME_BYTES
        o, s = box
        assert prod(s) == count
        assert sum((a - b) * st for a, b, st in zip(o, offsets, strides)) == first  # the box starts at ``first``
        at += count
    assert at == prod(sizes)
