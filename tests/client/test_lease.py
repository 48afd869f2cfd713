"""A client's own read leases (:mod:`ckptd_client._lease`) against a real ``ckptd serve``.

The service grants 3 s leases here (``CKPTD_READ_LEASE_SECONDS``), so a holder renews every second.

* ``read_lease`` on ``RUN/latest`` resolves it once: the block receives the checkpoint it holds, and
  the lease stays there when a newer checkpoint commits meanwhile; it is renewed while the block
  runs and released when it ends (nothing of it left under the root);
* every request of the block under that checkpoint names the lease, so the service leases nothing
  on its own account for a byte read there (the same read outside the block does);
* a lease the service refuses (a checkpoint that is not there) leaves the block as it was: it
  receives None, and nothing is written;
* ``LoadLease`` holds nothing until ``hold`` says where (the checkpoint a manifest resolved), names
  its lease on the block's reads there, and releases it at ``close`` (later reads name nothing);
  taken beside another request (``wait=False``), it is held once ``held`` returns, and a load that
  closes without waiting for it still releases it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from ckptd.storage import open_storage
from ckptd.store import SessionStore
from stored_tensors import write_tensors
from ckptd_client._lease import LoadLease, read_lease
from ckptd_client.transport import Transport
from support import ServerProcess, scaled

FILE = "r000000-0000.bin"


def _commit(root: Path, ref: str, step: int) -> None:
    write_tensors(SessionStore(open_storage(str(root))), ref, {"model.w": torch.full((4, 4), float(step))}, step=step)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("lease") / "root"
    for step in (1, 2, 3, 4):  # one checkpoint per test: the service's own lease is rewritten at most every
        _commit(root, f"ls/{step}", step)  # 0.3 s per checkpoint, so no test reads where another just did
    s = ServerProcess(root, env={"CKPTD_READ_LEASE_SECONDS": "3"}).start()
    yield s
    s.stop()


@pytest.fixture
def transport(srv):
    t = Transport(srv.url, retry_seconds=10.0, token="")
    yield t
    t.close()


def _leases(srv) -> dict[str, dict]:
    """Every lease record under the root: ``RUN/NAME/HOLDER`` -> the record."""
    base = Path(srv.root) / "leases"
    return {str(p.relative_to(base).with_suffix("")): json.loads(p.read_text()) for p in base.rglob("*.json")}


def _clear_leases(srv) -> None:
    for p in (Path(srv.root) / "leases").rglob("*.json"):
        p.unlink()


def _read_bytes(transport: Transport, ref: str) -> bytes:
    return transport.request("GET", f"/v1/checkpoints/{ref}/files/{FILE}", headers={"Range": "bytes=0-15"},
                             sink=lambda r: r.read())


def test_latest_is_resolved_once_held_renewed_and_released(srv, transport):
    _clear_leases(srv)
    with read_lease(transport, "/v1/checkpoints/ls/latest", "h-latest") as ref:
        assert ref == "ls/4"
        first = _leases(srv)
        assert list(first) == ["ls/4/client-h-latest"]
        _commit(Path(srv.root), "ls/9", 9)  # a newer checkpoint: the lease stays on the one resolved
        deadline = time.monotonic() + scaled(30)
        while _leases(srv)["ls/4/client-h-latest"]["expires_at"] <= first["ls/4/client-h-latest"]["expires_at"]:
            assert time.monotonic() < deadline, "the lease was not renewed"
            time.sleep(0.1)
        assert list(_leases(srv)) == ["ls/4/client-h-latest"]
    assert _leases(srv) == {}  # released at the end of the block


def test_the_blocks_requests_name_the_lease(srv, transport):
    _clear_leases(srv)
    with read_lease(transport, "/v1/checkpoints/ls/1", "h-named") as ref:
        assert ref == "ls/1"
        assert len(_read_bytes(transport, "ls/1")) == 16
        assert list(_leases(srv)) == ["ls/1/client-h-named"]  # the service renewed that one, took none
    assert _leases(srv) == {}
    _read_bytes(transport, "ls/1")  # the same read outside the block: leased on the service's account
    assert [k.startswith("ls/1/reader-") for k in _leases(srv)] == [True]


def test_a_lease_the_service_refuses_leaves_the_block_as_it_was(srv, transport):
    _clear_leases(srv)
    with read_lease(transport, "/v1/checkpoints/ls/77", "h-none") as ref:
        assert ref is None
        assert _leases(srv) == {}
    assert _leases(srv) == {}


def test_a_load_lease_holds_where_it_is_told_and_ends_at_close(srv, transport):
    _clear_leases(srv)
    with LoadLease(transport, "ls", "latest") as lease:  # a load of latest: the manifest says which one
        assert lease.base is None and _leases(srv) == {}  # nothing held before hold
        lease.hold("/v1/checkpoints/ls/2")
        assert lease.base == "/v1/checkpoints/ls/2"
        assert list(_leases(srv)) == [f"ls/2/client-{lease.holder}"]
        assert len(_read_bytes(transport, "ls/2")) == 16
        assert list(_leases(srv)) == [f"ls/2/client-{lease.holder}"]  # held and named: nothing else
    assert _leases(srv) == {}
    _read_bytes(transport, "ls/2")  # after close the requests name nothing: the service leases it itself
    assert [k.startswith("ls/2/reader-") for k in _leases(srv)] == [True]

