"""Fixtures shared by the crash tests (test_crash.py) and the fault matrix (test_faults.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptd_client import CheckpointClient
from support import ServerProcess, make_state, verified
from .test_crash import RUN, SMALL_BATCH, marker_bytes


@pytest.fixture(scope="module")
def good_root(tmp_path_factory) -> Path:
    """A storage root holding RUN/1 = SD1, committed once per module by a real server.

    Tests copy it (a committed checkpoint is plain files), which saves a server
    start per test; starting ``ckptd serve`` costs seconds.
    """
    root = tmp_path_factory.mktemp("good") / "root"
    srv = ServerProcess(root).start()
    try:
        with CheckpointClient(srv.url, retry_seconds=10) as client:
            assert client.save(make_state(1), f"{RUN}/1").wait(timeout=60).state == "committed"
        verified(srv.url, f"{RUN}/1")  # re-read and recorded: no server on a copy re-reads it under a test
    finally:
        srv.stop()
    return root


@pytest.fixture
def srv(tmp_path, good_root):
    """A server (not started) over a root that already holds the committed RUN/1."""
    shutil.copytree(good_root, tmp_path / "root")
    s = ServerProcess(tmp_path / "root", env=SMALL_BATCH)
    assert marker_bytes(tmp_path / "root", "1") is not None
    yield s
    s.kill()
