"""The sweep removes what writers killed mid-write left inside a committed session, and nothing else.

A replica SIGKILLed while it writes an upload, a digest record or a rank index leaves a hidden
``.NAME.tmp-XXXXXXXXXXXX`` file in the session. The commit deletes those it finds right after the
marker (test_unfinished_writes.py); for one killed after that (a write that began before the
marker), the sweep (which never touches a committed session's data) deletes such files once they
are older than the stale-session TTL, once a TTL has passed since the commit (no write comes into a
committed session, so the sweep walks each one once). Files that are not unfinished writes (the
direct-write probe, data, records) and recent temp files stay; the checkpoint verifies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from ckptd_client import CheckpointClient
from support import ServerProcess


def test_the_sweep_removes_stale_temp_files_from_a_committed_session(tmp_path):
    root = tmp_path / "root"
    srv = ServerProcess(root, log=tmp_path / "server.log").start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save({"w": torch.arange(4096.0)}, "t/1").wait()
    finally:
        srv.stop()
    (session,) = (root / "runs" / "t" / "1" / "sessions").iterdir()
    now = time.time() + 3700  # the sweep runs a TTL (3,600 s) after the commit
    old = now - 7200
    left = [session / "files" / ".r000000-0000.bin.tmp-0123456789ab", session / "digests" / ".r.bin.tmp-0a1b2c3d4e5f",
            session / "ranks" / ".0000000.json.tmp-ffffffffffff"]
    for p in left:
        p.write_bytes(b"half a write")
        os.utime(p, (old, old))
    recent = session / "files" / ".r000001-0000.bin.tmp-aaaaaaaaaaaa"  # a write in progress
    recent.write_bytes(b"being written")
    os.utime(recent, (now - 60, now - 60))
    lookalike = session / "files" / ".notes.tmp-xyz"  # not a name a writer makes
    lookalike.write_bytes(b"someone else's")
    os.utime(lookalike, (old, old))
    kept = sorted(p for p in session.rglob("*") if p.is_file() and p not in left)
    store = SessionStore(LocalStorage(root))
    store.sweeper.reclaim_stale(3600.0, now=now)
    assert not any(p.exists() for p in left)
    assert sorted(p for p in session.rglob("*") if p.is_file()) == kept
    assert recent.exists() and lookalike.exists()
    later = session / "files" / ".r000002-0000.bin.tmp-bbbbbbbbbbbb"  # a committed session is walked once
    later.write_bytes(b"x")
    os.utime(later, (old, old))
    store.sweeper.reclaim_stale(3600.0, now=now + 600)
    assert later.exists()
    out = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", "t/1", "--root", str(root)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
