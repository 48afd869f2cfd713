"""Durable local writes around the page cache (ckptd/storage/_direct_io.py), on real files.

The bytes that land must be exactly the bytes written, whatever the piece sizes and wherever the
buffer boundaries fall; the pool's bound must hold (a writer that finds it empty writes buffered,
correctly); buffers come back after commit and after abort; a full disk is a StorageError that
leaves no temp file, whether it hits a direct write or the buffered tail.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading

import pytest

from ckptd.storage import LocalStorage
from ckptd.storage import _direct_io as dio
from ckptd_schemas import StorageError

from test_storage import _unshare_works, raw_names

B = dio.BUFFER_BYTES


def _supports_direct(path) -> bool:
    probe = path / ".direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def _free_buffers() -> int:
    return len(dio._pool._free) + dio._pool._left


@pytest.fixture(autouse=True)
def _direct_on(monkeypatch):
    monkeypatch.setenv("CKPTD_DIRECT_IO", "1")


@pytest.mark.parametrize("size", [0, 1, 4095, B - 1, B, B + 1, 3 * B + 4097])
def test_bytes_land_exactly(tmp_path, size):
    st = LocalStorage(tmp_path / "root")
    rng = random.Random(size)
    data = rng.randbytes(size)
    w = st.open_write("run/ck/data-0")
    at = 0
    while at < size:  # pieces of every size, some far larger than a buffer
        n = min(size - at, rng.choice((1, 4096, 65_537, B // 3, B + 12_345)))
        w.write(memoryview(data)[at:at + n])
        at += n
    w.commit()
    assert st.read("run/ck/data-0") == data
    direct = w._direct  # type: ignore[attr-defined]
    if size == 0:  # nothing written: no buffers taken
        assert direct is None
        return
    assert direct is not None, "a durable writer with the pool free must take the direct path"
    assert direct.direct == (size >= B and _supports_direct(tmp_path)), (size, direct.direct)
    assert raw_names(st, "run/ck") == ["data-0"]


def test_write_parts_and_mixed_inputs(tmp_path):
    st = LocalStorage(tmp_path / "root")
    parts = [os.urandom(n) for n in (10, B - 10, 3, B + 7, 0, 100_000)]
    w = st.open_write("f")
    w.write_parts(parts[:3])  # type: ignore[attr-defined]
    w.write(bytearray(parts[3]))
    w.write_parts(parts[4:])  # type: ignore[attr-defined]
    w.commit()
    assert st.read("f") == b"".join(parts)


def test_durable_false_and_switched_off_stay_buffered(tmp_path, monkeypatch):
    data = os.urandom(2 * B + 5)
    w = LocalStorage(tmp_path / "a", durable=False).open_write("f")
    w.write(data)
    w.commit()
    assert w._direct is None  # type: ignore[attr-defined]
    monkeypatch.setenv("CKPTD_DIRECT_IO", "0")
    st = LocalStorage(tmp_path / "b")
    w = st.open_write("f")
    w.write(data)
    w.commit()
    assert w._direct is None and st.read("f") == data  # type: ignore[attr-defined]


def test_off_unless_asked(tmp_path, monkeypatch):
    """The default is the page cache (BENCHMARKS.md, "Writes around the page cache"): only
    ``CKPTD_DIRECT_IO=1`` (or true/yes/on) takes the direct path."""
    data = os.urandom(2 * B + 5)
    for value, direct in ((None, False), ("", False), ("0", False), ("off", False), ("1", True), ("ON", True)):
        if value is None:
            monkeypatch.delenv("CKPTD_DIRECT_IO", raising=False)
        else:
            monkeypatch.setenv("CKPTD_DIRECT_IO", value)
        assert dio.enabled() is direct, value
        st = LocalStorage(tmp_path / f"root-{value}")
        w = st.open_write("f")
        w.write(data)
        w.commit()
        assert (w._direct is not None) is direct and st.read("f") == data, value  # type: ignore[attr-defined]


def test_pool_bound_and_buffers_returned(tmp_path):
    """With every buffer held by open writers, the next writer writes buffered; commit and abort give
    the buffers back, and a writer after that goes direct again."""
    st = LocalStorage(tmp_path / "root")
    before = _free_buffers()
    holders = []
    for i in range(dio.POOL_BUFFERS // 2):
        w = st.open_write(f"hold-{i}")
        w.write(b"x")
        holders.append(w)
    assert _free_buffers() == before - dio.POOL_BUFFERS
    data = os.urandom(B + 3)
    late = st.open_write("late")
    late.write(data)
    late.commit()
    assert late._direct is None and st.read("late") == data  # type: ignore[attr-defined]
    for i, w in enumerate(holders):
        w.commit() if i % 2 else w.abort()
    assert _free_buffers() == before
    assert st.size("hold-1") == 1 and st.size("hold-0") is None
    again = st.open_write("again")
    again.write(data)
    again.commit()
    assert again._direct is not None and st.read("again") == data  # type: ignore[attr-defined]


def test_concurrent_writers_keep_their_bytes(tmp_path):
    """More writers than the pool serves, on threads, each interleaving small and large pieces."""
    st = LocalStorage(tmp_path / "root")
    blobs = {f"w{i}": random.Random(i).randbytes(B + i * 300_001) for i in range(dio.POOL_BUFFERS)}
    errors: list[BaseException] = []

    def write(name: str) -> None:
        try:
            w = st.open_write(name)
            mv = memoryview(blobs[name])
            for j in range(0, len(mv), 1 << 20):
                w.write(mv[j:j + (1 << 20)])
            w.commit()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(n,)) for n in blobs]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    for name, blob in blobs.items():
        assert st.read(name) == blob, name


@pytest.mark.parametrize("fill_mib", [20, 6])
def test_disk_full_on_direct_and_tail_writes(tmp_path, fill_mib):
    """A real 16 MiB tmpfs (private mount namespace): writing ``fill_mib`` MiB fails with 'disk full' in
    a direct buffer write (20) or in the buffered tail at commit (6 MiB, after 12 MiB of filler), and
    leaves no temp file; a file written before stays readable."""
    if not _unshare_works():
        pytest.skip("cannot mount a private tmpfs here (unshare -rm unavailable)")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    script = textwrap.dedent(
        f"""
        import os, sys
        os.environ["CKPTD_DIRECT_IO"] = "1"
        from ckptd.storage import LocalStorage
        from ckptd_schemas import StorageError
        st = LocalStorage(sys.argv[1])
        st.put("small", b"fits")
        if {fill_mib} < 8:
            st.put("filler", os.urandom(12 << 20))
        w = st.open_write("run/ck/data-1")
        try:
            for _ in range({fill_mib}):
                w.write(os.urandom(1 << 20))
            w.commit()
            print("writer: no error")
        except StorageError as e:
            print("writer:", e.message, e.details.get("errno"))
        print("direct:", w._direct is not None)
        print("left:", sorted(os.listdir(os.path.join(sys.argv[1], "run", "ck"))))
        print("small:", st.read("small").decode())
        """
    )
    r = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=16m none "$1" && exec "$2" -c "$3" "$1"', "sh",
         str(mnt), sys.executable, script],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("writer: storage") and "disk full" in lines[0] and lines[0].endswith(" 28"), r.stdout
    assert "run/ck/data-1" in lines[0]
    assert lines[1] == "direct: True"
    assert lines[2] == "left: []", r.stdout
    assert lines[3] == "small: fits"


def test_io_error_surfaces_and_releases(tmp_path):
    """A direct write that fails (the descriptor closed under it) is raised as a StorageError at the next
    write or the commit, the temp file goes, and the buffers return to the pool."""
    st = LocalStorage(tmp_path / "root")
    before = _free_buffers()
    w = st.open_write("f")
    w.write(os.urandom(B))  # one full buffer handed to the I/O thread
    os.close(w._f.fileno())  # type: ignore[attr-defined]
    with pytest.raises(StorageError, match="'f'"):
        w.write(os.urandom(B))
        w.commit()
    assert _free_buffers() == before
    assert raw_names(st, "") == []


def test_finish_that_raises_still_returns_buffers(tmp_path):
    """``finish`` gives the buffers back even when the write in flight failed: a caller that does not
    abort after a failed commit must not shrink the pool for the life of the process."""
    before = _free_buffers()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    d = dio.DirectWrites.open(fd)
    assert d is not None
    d.write(os.urandom(B) + b"tail")
    os.close(fd)
    with pytest.raises(OSError):
        d.finish()
    assert _free_buffers() == before
