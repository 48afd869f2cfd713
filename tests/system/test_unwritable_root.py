"""A storage root the service cannot write (issue 39): permanent errors are final at once, and reads go on.

Two real roots, each holding a checkpoint committed while it could still be written: a read-only
bind mount (EROFS, even for root) and a root-owned directory served by ``ckptd serve`` running as an
unprivileged user (EACCES, as a root-owned bind mount in a container is). Both need root to set up
and skip otherwise. Through the real server:

* ``ckptd serve`` says in its first lines that the root cannot be written;
* ``/readyz`` answers 503 naming the cause, and ``/readyz?for=reads`` answers ready (a service meant
  to serve loads from a read-only root) while still saying that the root cannot be written;
* a save fails at session open with ``StorageReadOnly`` naming the root's cause, at once (a
  client with a 120 s retry budget gets it well inside a deadline far below that), and so does
  ``ckptd import dcp`` through the service and offline (exit 2, one line, no traceback); nothing
  is written;
* a load of the checkpoint committed before still works (``RUN/1`` and ``RUN/latest``), and so does
  ``ckptd verify`` through the service and offline.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ckptd_client import CheckpointClient, StorageError, StorageReadOnly
from support import REPO, ServerProcess, as_user, make_state, read_only_view, scaled
from .test_crash import RUN, SD1, assert_loads

NOBODY = 65534


@dataclass
class Unwritable:
    """A server (not started) over a root it cannot write, and how that root refuses."""

    server: ServerProcess
    root: Path
    user: int | None  # the uid the service runs as (None: this process's, root)
    errno: int
    cause: str  # a phrase of every refusal's message that names the root's cause


def _tree(root: Path) -> dict[str, int]:
    """Every file under ``root`` (hidden ones too) and its size."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(params=["read-only mount", "root-owned, served unprivileged"])
def unwritable(request, good_root, tmp_path) -> Iterator[Unwritable]:
    if os.geteuid() != 0:
        pytest.skip("a read-only mount, or a directory its server may not write, needs root to set up")
    base = Path(tempfile.mkdtemp(prefix="ckptd-unwritable-", dir="/tmp"))  # outside pytest's 0700 directory
    undo: Callable[[], None] = lambda: None  # noqa: E731
    try:
        base.chmod(0o755)
        shutil.copytree(good_root, base / "src")  # RUN/1 = SD1, committed while the root could be written
        subprocess.run(["chmod", "-R", "a+rX", str(base / "src")], check=True, timeout=30)
        if request.param == "read-only mount":
            undo = read_only_view(base / "src", base / "ro")
            root = base / "ro"
            case = Unwritable(ServerProcess(root, log=tmp_path / "server.log"), root, None, errno.EROFS,
                              f"the storage root {root} is read-only")
        else:
            root = base / "src"
            case = Unwritable(ServerProcess(root, log=tmp_path / "server.log", env={"HOME": str(base)}, user=NOBODY),
                              root, NOBODY, errno.EACCES, f"(uid {NOBODY}) may not write under the storage root {root}")
        yield case
        case.server.kill()
    finally:
        undo()
        shutil.rmtree(base, ignore_errors=True)


def _dcp_dir(path: Path) -> Path:
    dcp.save({"model": {"w": torch.arange(64, dtype=torch.float32)}}, storage_writer=FileSystemWriter(str(path)),
             no_dist=True)
    subprocess.run(["chmod", "-R", "a+rX", str(path.parent)], check=True, timeout=30)
    return path


def _cli(*args: str, user: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(as_user(user, [sys.executable, "-m", "ckptd.cli.main", *args]), capture_output=True,
                          text=True, timeout=scaled(90), cwd=REPO)


def test_a_save_to_a_root_that_cannot_be_written_fails_at_once_naming_its_cause(unwritable):
    u = unwritable
    srv = u.server.start()
    before = _tree(u.root)

    # The first lines of `ckptd serve` say so.
    assert f"storage root {u.root} cannot be written" in srv.log.read_text(), srv.log.read_text()[-3000:]

    # Readiness: not ready to save, naming the cause; ready to serve loads when asked for reads only.
    r = httpx.get(f"{srv.url}/readyz", timeout=scaled(10))
    body = r.json()
    assert r.status_code == 503, r.text
    assert body["status"] == "not ready" and body["readable"] is True and body["writable"] is False, body
    assert u.cause in body["reason"], body
    assert body["error"]["code"] == "storage_read_only" and body["error"]["details"]["errno"] == u.errno, body
    r = httpx.get(f"{srv.url}/readyz", params={"for": "reads"}, timeout=scaled(10))
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ready" and r.json()["writable"] is False and u.cause in r.json()["reason"]

    # A save: the typed error at session open, at once, although the client would retry for 120 s.
    with CheckpointClient(srv.url, retry_seconds=120) as client:
        t0 = time.monotonic()
        with pytest.raises(StorageReadOnly) as ei:
            client.save(make_state(2), f"{RUN}/2").wait(timeout=scaled(60))
        assert time.monotonic() - t0 < scaled(30), "a permanent storage error was retried as if transient"
    err = ei.value
    assert isinstance(err, StorageError) and err.status == 507
    assert u.cause in err.message, err.message
    assert err.details["errno"] == u.errno and err.details["root"] == str(u.root), err.details
    assert err.details["key"].startswith(f"runs/{RUN}/2/sessions/"), err.details

    # The CLI: through the service and offline, exit 2 with one line naming the cause, no traceback.
    dcp_dir = _dcp_dir(Path(tempfile.mkdtemp(prefix="ckptd-dcp-", dir="/tmp")) / "dcp")
    try:
        for where in (["--server", srv.url], ["--root", str(u.root)]):
            out = _cli("import", "dcp", str(dcp_dir), f"{RUN}/3", *where, user=u.user)
            assert out.returncode == 2, (where, out.returncode, out.stdout, out.stderr)
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("ckptd: ") and u.cause in lines[0], (where, out.stderr)
            assert "Traceback" not in out.stderr
    finally:
        shutil.rmtree(dcp_dir.parent, ignore_errors=True)

    # Nothing was written, the service still answers, and RUN/1 is still the only checkpoint.
    assert _tree(u.root) == before
    assert srv.proc is not None and srv.proc.poll() is None
    assert httpx.get(f"{srv.url}/healthz", timeout=scaled(10)).status_code == 200
    with CheckpointClient(srv.url, retry_seconds=scaled(10)) as client:
        assert [c.name for c in client.list_checkpoints(RUN)] == ["1"]


def test_a_root_that_cannot_be_written_still_serves_loads(unwritable):
    srv = unwritable.server.start()
    with CheckpointClient(srv.url, retry_seconds=scaled(10)) as client:
        assert_loads(client, f"{RUN}/1", SD1)
        assert_loads(client, f"{RUN}/latest", SD1)
    out = _cli("show", f"{RUN}/1", "--server", srv.url)
    assert out.returncode == 0, out.stderr
    # A tool reading every byte, through the service and offline (as the service's user): its lease
    # cannot be written there, and nothing can delete the checkpoint there either.
    for where in (["--server", srv.url], ["--root", str(unwritable.root)]):
        out = _cli("verify", f"{RUN}/1", *where, user=unwritable.user)
        assert out.returncode == 0, (where, out.stdout, out.stderr)
    assert srv.proc is not None and srv.proc.poll() is None
