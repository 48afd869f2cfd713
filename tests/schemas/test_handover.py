"""The co-located uploads' wire as both sides read it (:mod:`ckptd_schemas.handover`).

* :func:`boot_id` is this host's kernel as ``/proc/sys/kernel/random/boot_id`` names it, stripped;
  read once per process (a later call does not read the file again); None where the file cannot be
  read or is empty, so a rank on a host without one never hands a file over;
* :data:`SEALS` are exactly the seals that make a memory file immutable: a file carrying them
  refuses a write, a shrink and a growth, and still reads;
* :data:`HEADER_BYTES` bounds what a rank sends: a hello and a header of the longest names fit in it;
* the session key (:func:`session_key`) is one per secret, principal, run, name and session, and
  :func:`split_key` gives back its principal (a name with ``:`` too) and key; anything else is no key;
* a proof (:func:`prove`) holds for its key, role and nonce only (:func:`proven`): one side's answer
  is never the other's, and a proof under another session's key, or not a string, is no proof.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

import ckptd_schemas.handover as handover
from ckptd_schemas import check_file, check_name, check_run, check_session
from ckptd_schemas.handover import (
    HEADER_BYTES, SEALS, boot_id, is_nonce, new_nonce, prove, proven, session_key, split_key,
)

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


def test_a_hello_and_header_of_the_longest_names_fit_the_bound():
    run, name, sid = check_run("r" * 128), check_name("n" * 128), check_session("s" * 64)
    key = split_key(session_key(b"x" * 32, "p" * 64, run, name, sid))
    assert key is not None
    hello = {"principal": "p" * 64, "run": run, "name": name, "session": sid, "nonce": new_nonce()}
    header = {"proof": prove(key[1], "rank", new_nonce()), "file": check_file("f" * 128), "size": 1 << 62,
              "xxh3": "0" * 16}
    sent = sum(len(json.dumps(m).encode()) + 1 for m in (hello, header))
    assert sent < HEADER_BYTES == 16 << 10


def test_a_session_key_is_one_per_secret_principal_and_session():
    coords = ("trainer", "gpt", "100", "a" * 16)
    key = session_key(b"s" * 32, *coords)
    assert key == session_key(b"s" * 32, *coords)  # the service derives it again from a hello
    others = {session_key(b"t" * 32, *coords), session_key(b"s" * 32, "other", *coords[1:]),
              session_key(b"s" * 32, "trainer", "gpt2", "100", "a" * 16),
              session_key(b"s" * 32, "trainer", "gpt", "101", "a" * 16),
              session_key(b"s" * 32, "trainer", "gpt", "100", "b" * 16),
              session_key(b"s" * 32, "trainer", "gpt1", "00", "a" * 16)}  # the fields cannot slide into each other
    assert len({split_key(k)[1] for k in others | {key}}) == 7
    assert split_key(key)[0] == "trainer" and len(split_key(key)[1]) == 64
    assert split_key(session_key(b"s" * 32, "team:ci", *coords[1:]))[0] == "team:ci"
    for bad in ("", "trainer", ":" + "0" * 64, "trainer:" + "0" * 63, "trainer:" + "G" * 64):
        assert split_key(bad) is None, bad


def test_a_proof_holds_for_its_key_role_and_nonce_only():
    key = split_key(session_key(b"s" * 32, "trainer", "gpt", "100", "a" * 16))[1]
    other = split_key(session_key(b"s" * 32, "trainer", "gpt", "100", "b" * 16))[1]
    nonce = new_nonce()
    assert is_nonce(nonce) and nonce != new_nonce() and not is_nonce("0" * 63) and not is_nonce(None)
    assert proven(key, "service", nonce, prove(key, "service", nonce))
    assert not proven(key, "rank", nonce, prove(key, "service", nonce))  # the service's answer is not the rank's
    assert not proven(key, "service", nonce, prove(other, "service", nonce))
    assert not proven(key, "service", new_nonce(), prove(key, "service", nonce))
    for bad in (None, 0, "", "0" * 64, prove(key, "service", nonce).upper(), "é" * 64):
        assert not proven(key, "service", nonce, bad), bad
