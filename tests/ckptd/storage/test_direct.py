"""ckptd.storage.direct: bytes written and read past the page cache are the bytes given, at every
size around the alignment and the window, in any pieces; where the filesystem refuses O_DIRECT the
same bytes go through the page cache."""

from __future__ import annotations

import errno
import mmap
import os
import random

import pytest

from ckptd.storage import direct
from ckptd.storage.direct import ALIGN, WINDOW
from ckptd.storage.local import LocalStorage

SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 3 * ALIGN + 7]


def _pieces(data: bytes, rng: random.Random) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        n = rng.choice([1, 100, ALIGN - 3, 65536, 262144, WINDOW + 11])
        out.append(data[pos:pos + n])
        pos += n
    return out


@pytest.mark.parametrize("size", SIZES)
def test_a_durable_local_write_stores_exactly_the_bytes_given_in_any_pieces(tmp_path, size):
    rng = random.Random(size)
    data = rng.randbytes(size)
    st = LocalStorage(tmp_path)
    w = st.open_write("f/data.bin", once=True)
    w.write_parts(_pieces(data, rng))
    assert w.commit()
    assert st.read("f/data.bin") == data
    assert [p.name for p in (tmp_path / "f").iterdir()] == ["data.bin"]  # no temp left


def test_windows_go_past_the_page_cache_and_the_tail_through_it(tmp_path, monkeypatch):
    """The writer asks for O_DIRECT and writes whole aligned windows with it; only the unaligned tail
    clears it (where the filesystem refused, every write goes through the cache instead)."""
    flags_at_write: list[bool] = []
    real_write = os.write

    def spy(fd, data):
        import fcntl
        flags_at_write.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    st = LocalStorage(tmp_path)
    w = st.open_write("x.bin")
    w.write(b"\1" * (WINDOW + ALIGN + 5))
    w.commit()
    probe = tmp_path / "probe"
    fd, took = direct.open_direct(probe, os.O_WRONLY | os.O_CREAT)
    os.close(fd)
    if not took:
        pytest.skip("this filesystem refuses O_DIRECT: the page cache fallback is tested below")
    assert flags_at_write == [True, True, False]  # the window, the aligned head of the rest, the 5-byte tail


def test_where_o_direct_is_refused_the_same_bytes_go_through_the_page_cache(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refusing_open)
    data = random.Random(1).randbytes(WINDOW + 12345)
    st = LocalStorage(tmp_path)
    w = st.open_write("y.bin")
    w.write(data)
    assert w.commit()
    buf = memoryview(mmap.mmap(-1, 2 * WINDOW))
    assert st.read_into("y.bin", 0, buf, uncached=True) == len(data)
    assert bytes(buf[:len(data)]) == data


def test_a_device_that_refuses_a_direct_write_gets_the_bytes_through_the_page_cache(tmp_path, monkeypatch):
    """O_DIRECT accepted at open but a write refused (EINVAL: the device wants a larger alignment):
    the writer clears it and writes the same window through the cache."""
    real_write = os.write
    refused = []

    def picky(fd, data):
        import fcntl
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", picky)
    data = random.Random(2).randbytes(2 * WINDOW + 99)
    st = LocalStorage(tmp_path)
    w = st.open_write("z.bin")
    w.write(data)
    w.commit()
    assert st.read("z.bin") == data
    assert len(refused) <= 1  # refused once, then through the cache for the rest of the file


@pytest.mark.parametrize("start,length", [(0, WINDOW), (ALIGN, 3 * ALIGN), (0, 5 * ALIGN + 17), (17, ALIGN),
                                          (WINDOW, WINDOW), (2 * WINDOW - ALIGN, 2 * ALIGN)])
def test_uncached_reads_return_the_stored_bytes_aligned_or_not(tmp_path, start, length):
    """Aligned view and offset: past the cache; an unaligned length's tail, an unaligned offset or a
    view that is not page-aligned: through it. Near the end of the file, what is there."""
    data = random.Random(3).randbytes(2 * WINDOW + 1000)
    (tmp_path / "d.bin").write_bytes(data)
    st = LocalStorage(tmp_path)
    want = data[start:start + length]
    aligned = memoryview(mmap.mmap(-1, length + ALIGN))[:length]
    assert st.read_into("d.bin", start, aligned, uncached=True) == len(want)
    assert bytes(aligned[:len(want)]) == want
    skewed = memoryview(bytearray(length + 1))[1:]  # never page-aligned
    assert st.read_into("d.bin", start, skewed, uncached=True) == len(want)
    assert bytes(skewed[:len(want)]) == want


def test_windows_are_reused_not_mapped_per_file(tmp_path):
    st = LocalStorage(tmp_path)
    for i in range(3):
        w = st.open_write(f"w{i}.bin")
        w.write(b"x" * 10)
        w.commit()
    assert 1 <= len(direct._pool) <= direct._POOL_MAX
    first = direct.take_window()
    direct._give_window(first)
    again = direct.take_window()
    direct._give_window(again)
    assert again is first
