"""Readiness (:mod:`ckptd.service.readiness`) as a unit, over a real local root and no server.

* a root that lists and takes writes is ready, for writes and for reads; the probe's object is gone;
* one probe's outcome answers for ``seconds``, and a fresh probe sees a root that changed;
* a root that cannot be written is not ready for writes (503, the typed error of the failing write
  in the body, the reason said) but is ready for reads, and the body still says why it cannot be
  written; a root that cannot be listed is ready for nothing;
* every failed part of a probe is counted once (``on_failure``), and :meth:`Readiness.announce`
  says it in the log;
* a read-only filesystem (EROFS, a bind mount; root only) is the permanent ``StorageReadOnly``.

The whole service answering ``/readyz`` is in tests/system/test_unwritable_root.py.
"""

from __future__ import annotations

import logging
import shutil

from ckptd.storage import LocalStorage
from ckptd.service.readiness import Readiness, answer
from ckptd_schemas import StorageError, StorageReadOnly
from support import read_only_view


def _break_writes(storage: LocalStorage) -> None:
    """The root's directory replaced by a file: listing ``runs`` finds nothing, every write fails."""
    shutil.rmtree(storage.root)
    storage.root.write_bytes(b"not a directory")


def _break_listing(storage: LocalStorage) -> None:
    """``runs`` a symlink to itself: listing it fails (ELOOP)."""
    (storage.root / "runs").symlink_to(storage.root / "runs")


def test_a_root_that_lists_and_takes_writes_is_ready(tmp_path):
    storage = LocalStorage(tmp_path / "root", durable=False)
    probe = Readiness(storage).check()
    assert probe.readable and probe.writable and probe.read_error is None and probe.write_error is None
    assert list((tmp_path / "root").iterdir()) == []  # the probe's object is deleted again
    for need in ("writes", "reads"):
        status, body = answer(probe, storage.url, need, request_id="req-1")
        assert status == 200
        assert body == {"status": "ready", "for": need, "storage": storage.url, "readable": True, "writable": True}


def test_one_probe_answers_for_its_seconds_and_a_fresh_one_sees_the_change(tmp_path):
    storage = LocalStorage(tmp_path / "root", durable=False)
    cached = Readiness(storage, seconds=3600)
    first = cached.check()
    _break_writes(storage)
    assert cached.check() is first  # the same outcome, no second probe
    assert not Readiness(storage, seconds=0).check().writable
    always = Readiness(storage, seconds=0)
    a = always.check()
    assert always.check() is not a  # seconds=0: every check probes


def test_a_root_that_cannot_be_written_is_ready_for_reads_only_and_says_why(tmp_path):
    storage = LocalStorage(tmp_path / "root", durable=False)
    failures: list[StorageError] = []
    readiness = Readiness(storage, on_failure=failures.append)
    _break_writes(storage)
    probe = readiness.check()
    assert probe.readable and not probe.writable
    assert isinstance(probe.write_error, StorageError) and failures == [probe.write_error]
    assert ".ckptd-ready-" in probe.write_error.message  # names the object it could not write

    status, body = answer(probe, storage.url, "writes", request_id="req-1")
    assert status == 503 and body["status"] == "not ready" and body["writable"] is False
    assert body["reason"] == probe.write_error.message
    assert body["error"]["code"] == probe.write_error.code and body["error"]["request_id"] == "req-1"

    status, body = answer(probe, storage.url, "reads")
    assert status == 200 and body["status"] == "ready" and body["for"] == "reads"
    assert body["writable"] is False and body["reason"] == probe.write_error.message and "error" not in body


def test_a_root_that_cannot_be_listed_is_ready_for_nothing(tmp_path):
    storage = LocalStorage(tmp_path / "root", durable=False)
    failures: list[StorageError] = []
    _break_listing(storage)
    probe = Readiness(storage, on_failure=failures.append).check()
    assert not probe.readable and probe.writable and failures == [probe.read_error]
    assert "runs" in probe.read_error.message
    for need in ("writes", "reads"):
        status, body = answer(probe, storage.url, need)
        assert status == 503 and body["readable"] is False and body["reason"] == probe.read_error.message
        assert body["error"]["code"] == probe.read_error.code


def test_announce_logs_a_root_that_cannot_be_written(tmp_path, caplog):
    storage = LocalStorage(tmp_path / "root", durable=False)
    _break_writes(storage)
    with caplog.at_level(logging.WARNING, logger="ckptd.service"):
        Readiness(storage).announce(wait=60)
    [line] = [r.getMessage() for r in caplog.records if r.name == "ckptd.service"]
    assert storage.url in line and "could not be written just now" in line


def test_a_read_only_filesystem_is_permanent_and_announced_as_serving_loads_only(tmp_path, caplog):
    src = tmp_path / "src"
    LocalStorage(src, durable=False).put("runs/r/keep", b"x")
    unmount = read_only_view(src, tmp_path / "ro")
    try:
        storage = LocalStorage(tmp_path / "ro", durable=False)
        probe = Readiness(storage).check()
        assert probe.readable and isinstance(probe.write_error, StorageReadOnly)
        assert answer(probe, storage.url, "writes")[1]["error"]["code"] == "storage_read_only"
        with caplog.at_level(logging.WARNING, logger="ckptd.service"):
            Readiness(storage).announce(wait=60)
        assert any("serving loads only" in r.getMessage() for r in caplog.records)
    finally:
        unmount()
