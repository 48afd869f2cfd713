"""Nothing a killed upload wrote outlives its session, and a checkpoint's verification sees what is no part of it.

A writer killed mid-upload leaves its temp file in the session. The commit deletes every such file
right after the marker (no upload of a committed session is needed any more, and one is refused
before it writes); an abort or the sweep's reclaim deletes the session with them. ``ckptd verify``
names every file stored in a checkpoint's directory that is no part of it (``STRAY``, and
``strays`` in ``--json`` and the service's record), without failing the checkpoint for it: its
data is intact, and a file someone planted beside it must not make ``RUN/latest`` skip it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch
import xxhash

from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from ckptd_client import CheckpointClient
from ckptd_schemas import AlreadyCommitted, OpenSession, StorageError
from support import ServerProcess, verified

from .staging import data, file_of, put_indexes, stage


def _temps(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob(".*.tmp-*") if p.is_file())


def _killed_upload(store: SessionStore, run: str, name: str, sid: str, rank: int):
    """A write of rank ``rank``'s file that stops halfway and is never heard of again (a killed
    writer: nothing aborts it); its temp file is in the session."""
    sink = store.intake.receive(run, name, sid, file_of(rank))
    sink.write(data(rank)[:500])
    return sink


def test_the_commit_deletes_the_temp_files_of_killed_uploads(tmp_path):
    root = tmp_path / "root"
    store = SessionStore(LocalStorage(root, durable=False))
    store.open("r", "1", OpenSession(session="s1", world_size=2, step=1))
    dead = [_killed_upload(store, "r", "1", "s1", r) for r in (0, 1)]  # the killed process's writes
    session = root / "runs" / "r" / "1" / "sessions" / "s1"
    assert len(_temps(session)) == 2
    stage(store, "r", "1", "s1", world=2)  # the ranks' retries, at another process
    put_indexes(store, "r", "1", "s1", world=2)
    assert (root / "runs" / "r" / "1" / "COMMITTED").exists()
    assert _temps(session) == []
    # A write still going when its session committed lost its temp: it fails, and leaves nothing.
    dead[0].write(data(0)[500:])
    with pytest.raises(StorageError):
        dead[0].finish(xxhash.xxh3_64_hexdigest(data(0)))
    with pytest.raises(AlreadyCommitted):  # a new write into a committed session is refused before it writes
        store.intake.receive("r", "1", "s1", "r000002-0000.bin")
    assert _temps(session) == [] and not (session / "files" / "r000002-0000.bin").exists()
    assert sorted(p.name for p in (session / "files").iterdir()) == [file_of(0), file_of(1)]


def test_the_sweep_deletes_what_a_committer_that_died_after_its_marker_left(tmp_path):
    """The process that created the marker died before it deleted the session's unfinished writes:
    the first sweep that sees the committed session deletes those written before the commit. A temp
    written since (a write that began before the marker and may still be going) is left for the
    sweep a TTL after the commit."""
    root = tmp_path / "root"
    store = SessionStore(LocalStorage(root, durable=False))
    stage(store, "r", "1", "s1", world=1)
    put_indexes(store, "r", "1", "s1", world=1)
    committed = json.loads((root / "runs" / "r" / "1" / "COMMITTED").read_text())["committed_at"]
    at = datetime.fromisoformat(committed).timestamp()
    files = root / "runs" / "r" / "1" / "sessions" / "s1" / "files"
    before, since = files / ".r000001-0000.bin.tmp-0123456789ab", files / ".r000002-0000.bin.tmp-aaaaaaaaaaaa"
    for p, t in ((before, at - 5), (since, at + 5)):
        p.write_bytes(b"half a write")
        os.utime(p, (t, t))
    other = SessionStore(LocalStorage(root, durable=False))  # a restarted service, or another replica
    assert other.sweeper.reclaim_stale(3600.0) == []
    assert not before.exists() and since.exists()
    other.sweeper.reclaim_stale(3600.0, now=at + 3700)
    assert _temps(root) == []


def test_abort_and_the_sweep_delete_the_temp_files_of_killed_uploads(tmp_path):
    root = tmp_path / "root"
    store = SessionStore(LocalStorage(root, durable=False), dead_after=60.0)
    stage(store, "r", "1", "a", world=2, ranks=[0])
    _killed_upload(store, "r", "1", "a", 1)
    stage(store, "r", "2", "b", world=2, ranks=[0])
    _killed_upload(store, "r", "2", "b", 1)
    assert len(_temps(root)) == 2
    store.sweeper.abort("r", "1", "a")
    assert not (root / "runs" / "r" / "1" / "sessions" / "a").exists()
    assert store.sweeper.reclaim_stale(3600.0, now=time.time() + 120) == ["r/2/b"]
    assert _temps(root) == [] and not (root / "runs" / "r" / "2" / "sessions" / "b").exists()


def _verify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", *args], capture_output=True, text=True,
                          timeout=120)


def test_verify_names_every_file_in_a_checkpoint_that_is_no_part_of_it(tmp_path):
    root = tmp_path / "root"
    srv = ServerProcess(root, log=tmp_path / "server.log").start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save({"w": torch.arange(4096.0)}, "t/1").wait()
        verified(srv.url, "t/1")  # the re-read's record is written (its temp file is no stray of the checkpoint)
        ckpt = root / "runs" / "t" / "1"
        (session,) = (ckpt / "sessions").iterdir()
        # What a checkpoint legitimately holds (marker, records, manifest, indexes, digests, the
        # session's records) is no stray; nor is another save attempt's staging, the sweep's.
        other = ckpt / "sessions" / "0123456789abcdef0123456789abcdef" / "files"
        other.mkdir(parents=True)
        (other / "r000000-0000.bin").write_bytes(b"a losing attempt's upload")
        out = _verify("t/1", "--root", str(root))
        assert out.returncode == 0 and out.stdout.startswith("OK t/1") and "STRAY" not in out.stdout, out.stdout

        planted = {session / "files" / ".r000000-0000.bin.tmp-0123456789ab": b"half a write" * 100,
                   session / "files" / "extra.bin": b"x" * 4096,
                   session / "digests" / "extra.bin": b"{}",
                   session / "ranks" / "0000007.json": b"{}",
                   ckpt / "notes.txt": b"someone's notes"}
        for p, raw in planted.items():
            p.write_bytes(raw)
        sizes = {str(p.relative_to(root)): len(raw) for p, raw in planted.items()}
        keys = sorted(sizes)
        out = _verify("t/1", "--root", str(root))
        assert out.returncode == 0, out.stdout + out.stderr  # the data is intact: not a failure
        assert out.stdout.startswith("OK t/1") and "STRAY t/1: 5 files in its directory" in out.stdout, out.stdout
        for k in keys:
            assert f"  - {k} (" in out.stdout, (k, out.stdout)
        rep = json.loads(_verify("t/1", "--root", str(root), "--json").stdout)
        assert rep["ok"] and {s["key"]: s["size"] for s in rep["strays"]} == sizes
        # The service's own verification (recorded) names them too, and still records the checkpoint good.
        out = _verify("t/1", "--server", srv.url, "--in-service", "--json")
        rep = json.loads(out.stdout)
        assert out.returncode == 0 and rep["ok"] and sorted(s["key"] for s in rep["strays"]) == keys, out.stdout
        record = json.loads((ckpt / "VERIFIED.json").read_text())
        assert record["ok"] and sorted(s["key"] for s in record["strays"]) == keys
    finally:
        srv.stop()
