"""Direct reads of a cold file (client/_files.py): fetches read at once by several threads, each through
a descriptor of its own, land byte for byte at any offset and length, cold or warm; a corrupt cold
file fails its block digest; no descriptor outlives the fetch that opened it."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import xxhash

from ckptd_client._files import LocalFiles
from ckptd_client._scatter import fill_buffer, fill_targets
from ckptd_schemas import ChecksumMismatch, Fetch

BLOCK = 1 << 20


def _cold_file(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return str(path)


def _fetch(data: bytes, first_block: int, nblocks: int) -> Fetch:
    start = first_block * BLOCK
    end = min(len(data), start + nblocks * BLOCK)
    blocks = [xxhash.xxh3_64_hexdigest(data[b:min(b + BLOCK, end)]) for b in range(start, end, BLOCK)]
    return Fetch(file="f.bin", start=start, end=end, block_size=BLOCK, first_block=first_block, blocks=blocks)


def _files(path: str, data: bytes) -> LocalFiles:
    return LocalFiles({"f.bin": path}, {"f.bin": len(data)})


def _fetched(files: LocalFiles, f: Fetch) -> bytes:
    """The fetch read from the file into a buffer (the buffered sink), every block verified."""
    return bytes(files.read(f, lambda fill: fill_buffer(f, fill)))


@pytest.fixture
def data() -> bytes:
    return random.Random(7).randbytes(5 * BLOCK + 777)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_cold_file_read_by_fetches_at_once_gives_the_same_bytes(tmp_path, data):
    path = _cold_file(tmp_path / "f.bin", data)
    files = _files(path, data)
    assert files.usable("f.bin")
    before = _open_fds()
    try:
        fetches = [_fetch(data, first, n) for first, n in [(0, 6), (1, 2), (4, 2), (2, 1)]]  # the unaligned end too
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda f: _fetched(files, f), fetches))
        for f, b in zip(fetches, got):
            assert b == data[f.start:f.end]
        assert _open_fds() == before  # each fetch's own descriptor is closed with it
        # targets at unaligned runs (a tensor's bytes inside the fetch): the rest is only hashed
        f = _fetch(data, 0, 6)
        runs = [(3, 4099), (BLOCK + 17, 3 * BLOCK + 5), (5 * BLOCK, 5 * BLOCK + 777)]
        dsts = [bytearray(hi - lo) for lo, hi in runs]
        targets = [(lo, hi, memoryview(d)) for (lo, hi), d in zip(runs, dsts)]
        files.read(f, lambda fill: fill_targets(f, fill, targets))
        for (lo, hi), d in zip(runs, dsts):
            assert bytes(d) == data[lo:hi]
        assert files.bytes_read >= 2 * len(data)
    finally:
        files.close()
    assert _open_fds() == before - 1


def test_a_warm_file_is_read_through_the_cache(tmp_path, data):
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert path.read_bytes() == data  # every page cached now
    files = _files(str(path), data)
    try:
        f = _fetch(data, 0, 6)
        assert bytes(_fetched(files, f)) == data
    finally:
        files.close()


def test_a_corrupt_cold_file_fails_its_block_digest(tmp_path, data):
    bad = bytearray(data)
    bad[2 * BLOCK + 4096 + 5] ^= 0x40
    path = _cold_file(tmp_path / "f.bin", bytes(bad))
    files = _files(path, data)
    try:
        with pytest.raises(ChecksumMismatch) as ei:
            _fetched(files, _fetch(data, 0, 6))
        assert ei.value.details["file"] == "f.bin"
    finally:
        files.close()
