"""The co-located uploads' wire as both sides read it (:mod:`ckptd_schemas.handover`).

* :func:`boot_id` is this host's kernel as ``/proc/sys/kernel/random/boot_id`` names it, stripped;
  read once per process (a later call does not read the file again); None where the file cannot be
  read or is empty, so a rank on a host without one never hands a file over;
* :data:`SEALS` are exactly the seals that make a memory file immutable: a file carrying them
  refuses a write, a shrink and a growth, and still reads;
* :data:`HEADER_BYTES` bounds a header line: a header of the largest names and a token fits in it.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

import ckptd_schemas.handover as handover
from ckptd_schemas import check_file, check_name, check_run, check_session
from ckptd_schemas.handover import HEADER_BYTES, SEALS, boot_id

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@pytest.fixture
def fresh_boot_id():
    """``boot_id``'s cache emptied before and after the test (the process's own answer stays right)."""
    boot_id.cache_clear()
    yield
    boot_id.cache_clear()


def _opener(text: str | None, calls: list[str]):
    """An ``open`` for the module that answers ``text`` (None: the file cannot be read), counting calls."""
    class _File:
        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

        def read(self) -> str:
            return text or ""

    def fake_open(path, *args, **kwargs):
        calls.append(str(path))
        if text is None:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return _File()
    return fake_open


@pytest.mark.skipif(not _BOOT_ID.exists(), reason="this kernel has no boot_id")
def test_boot_id_is_the_kernels_stripped(fresh_boot_id):
    want = _BOOT_ID.read_text().strip()
    assert want and boot_id() == want
    assert boot_id() is boot_id()  # the one answer of the process


def test_boot_id_is_read_once_per_process(fresh_boot_id, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(handover, "open", _opener("  1234-abcd\n", calls), raising=False)
    assert boot_id() == "1234-abcd"
    assert boot_id() == "1234-abcd"
    assert calls == [str(_BOOT_ID)]  # the second call did not read the file again


@pytest.mark.parametrize("text", [None, "", " \n"])
def test_no_boot_id_where_the_file_is_missing_or_empty(fresh_boot_id, monkeypatch, text):
    calls: list[str] = []
    monkeypatch.setattr(handover, "open", _opener(text, calls), raising=False)
    assert boot_id() is None and calls == [str(_BOOT_ID)]


def test_seals_are_write_shrink_and_grow():
    assert SEALS == fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    assert not SEALS & fcntl.F_SEAL_SEAL  # the sender adds that one itself (ckptd_client._handover)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")
def test_a_memory_file_with_the_seals_cannot_change_but_reads():
    fd = os.memfd_create("ckptd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, b"0123456789")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)  # no write
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4)  # no shrink
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)  # no growth
        assert os.pread(fd, 10, 0) == b"0123456789" and os.fstat(fd).st_size == 10
    finally:
        os.close(fd)


def test_a_header_of_the_longest_names_fits_the_bound():
    header = {"token": "t" * 4096, "run": check_run("r" * 128), "name": check_name("n" * 128),
              "session": check_session("s" * 64), "file": check_file("f" * 128), "xxh3": "0" * 16}
    line = json.dumps(header).encode() + b"\n"
    assert len(line) < HEADER_BYTES == 16 << 10
