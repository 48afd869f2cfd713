"""Fixtures shared by the attacks on the commit (test_commit_checks.py) and on the ingest (test_ingest.py)."""

from __future__ import annotations

import pytest

from adversary.test_commit_checks import Env
from support import ServerProcess


@pytest.fixture(scope="module")
def commit_server(tmp_path_factory):
    """One ``ckptd serve`` per test module, over a fresh local root."""
    base = tmp_path_factory.mktemp("commit-checks")
    srv = ServerProcess(base / "root", log=base / "server.log").start()
    yield srv
    srv.kill()


@pytest.fixture
def env(commit_server):
    """The module's server, and this test's own run with ``<run>/1`` committed (:class:`Env`)."""
    assert commit_server.proc is not None and commit_server.proc.poll() is None, \
        "the module's server died in an earlier test"
    e = Env(commit_server)
    yield e
    e.close()
