"""A finished load does not pin its checkpoint; a lease that does names its holder and its end.

A real ``ckptd serve`` with its default read leases. A load through the service (every byte over
HTTP), a load that reads the service's files directly, and a load of ``RUN/latest`` each return,
and a ``dcp.load`` through ``dcp_reader`` each return,
and right after it ``rm`` of that checkpoint removes it: the load's own lease named each of its
requests and was released when it returned, and the service leased nothing on its own. A reader
that holds a lease (as a load in progress does) keeps the checkpoint, and ``rm`` says who holds it
and until when; reading a manifest takes no lease, and a byte read without one (``curl``) still
leases the checkpoint for a while. A load takes its lease beside the request for its pieces, yet
however slow the lease's answer, no byte is read, directly or over HTTP, before it is held.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import torch

from ckptd_client import CheckpointClient
from support import ServerProcess, scaled


def _rm(url: str, ref: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", "rm", ref, "--server", url],
                          capture_output=True, text=True, timeout=120)


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((64, 64), v), "b": torch.arange(10.0) + v}}


def test_a_finished_load_leaves_no_lease_and_a_held_one_names_its_holder(tmp_path):
    srv = ServerProcess(tmp_path / "root").start()
    try:
        with CheckpointClient(srv.url, incremental=False) as c:
            for step in (1, 2, 3, 4, 5, 6):
                c.save(_state(step), f"ev/{step}").wait()
        for ref, kw in (("ev/1", {"direct_reads": False}), ("ev/2", {}), ("ev/latest", {"direct_reads": False})):
            with CheckpointClient(srv.url, **kw) as c:
                got = _state(0)
                report = c.load(got, ref)
            assert torch.equal(got["model"]["w"], _state(float(report.ref.split("/")[1]))["model"]["w"])
            leases = list((tmp_path / "root" / "leases").rglob("*.json"))
            assert leases == [], leases  # nothing of the load is left
            if ref != "ev/latest":  # the newest is kept by retention's own rules
                out = _rm(srv.url, ref)
                assert out.returncode == 0 and out.stdout.strip() == f"removed {ref}", out.stdout + out.stderr

        # dcp.load through the DCP reader: its rank's lease ends with its read_data (DCP has no closing call)
        import torch.distributed.checkpoint as dcp

        with CheckpointClient(srv.url) as c:
            got = _state(0)
            reader = c.dcp_reader("ev/5")  # still referenced: nothing ends its lease but the reader itself
            dcp.load(got, storage_reader=reader, no_dist=True)
            assert torch.equal(got["model"]["w"], _state(5.0)["model"]["w"])
            leases = list((tmp_path / "root" / "leases").rglob("*.json"))
            assert leases == [], leases
            out = _rm(srv.url, "ev/5")
            assert out.returncode == 0 and out.stdout.strip() == "removed ev/5", out.stdout + out.stderr
            del reader

        # a reader holding its own lease (a load in progress): kept, naming the holder and the end
        assert httpx.put(f"{srv.url}/v1/checkpoints/ev/3/leases/evaluator-7", timeout=10).status_code == 200
        out = _rm(srv.url, "ev/3")
        assert out.returncode == 1, out.stdout + out.stderr
        assert out.stdout.startswith("kept ev/3: leased by client-evaluator-7 until ") and " UTC" in out.stdout, \
            out.stdout
        assert httpx.delete(f"{srv.url}/v1/checkpoints/ev/3/leases/evaluator-7", timeout=10).status_code == 204
        assert _rm(srv.url, "ev/3").returncode == 0

        # reading metadata takes no lease; a byte read that names no lease leases the checkpoint on the
        # service's own account
        m = httpx.get(f"{srv.url}/v1/checkpoints/ev/4", timeout=10)
        assert m.status_code == 200
        assert list((tmp_path / "root" / "leases").rglob("*.json")) == []
        file = next(iter(m.json()["files"]))
        assert httpx.get(f"{srv.url}/v1/checkpoints/ev/4/files/{file}", headers={"Range": "bytes=0-9"},
                         timeout=10).status_code == 206
        out = _rm(srv.url, "ev/4")
        assert out.returncode == 1 and "leased by reader-" in out.stdout, out.stdout + out.stderr
    finally:
        srv.stop()


def test_a_dcp_load_reading_files_directly_holds_one_lease_the_readers(tmp_path, monkeypatch):
    """The lease belongs to the caller of the read executor: while ``dcp.load`` reads the service's files
    directly, the checkpoint holds exactly one lease (the reader's), not a second one taken by the
    executor for its direct reads."""
    import torch.distributed.checkpoint as dcp
    from ckptd_client import _files

    srv = ServerProcess(tmp_path / "root").start()
    seen: list[list[str]] = []
    real = _files.LocalFiles.read

    def read(self, *a, **kw):
        seen.append(sorted(p.name for p in (tmp_path / "root" / "leases" / "dl" / "1").glob("*.json")))
        return real(self, *a, **kw)

    monkeypatch.setattr(_files.LocalFiles, "read", read)
    try:
        with CheckpointClient(srv.url) as c:
            c.save(_state(3), "dl/1").wait()
            got = _state(0)
            dcp.load(got, storage_reader=c.dcp_reader("dl/1"), no_dist=True)
        assert torch.equal(got["model"]["w"], _state(3.0)["model"]["w"])
        assert seen and all(len(held) == 1 for held in seen), seen  # read directly, under the reader's lease
        assert not list((tmp_path / "root" / "leases").rglob("*.json"))
    finally:
        srv.stop()


def test_a_slow_lease_is_held_before_the_load_reads_a_byte(tmp_path, monkeypatch):
    """A lease PUT answered late (delayed here) still comes back before the first byte is read: each
    direct read finds the load's lease on the root, and the reads over HTTP all name a lease already
    held (the service leases nothing on its own account)."""
    from ckptd_client import _files
    from ckptd_client.transport import Transport

    srv = ServerProcess(tmp_path / "root").start()
    held = tmp_path / "root" / "leases" / "sl" / "1"
    seen: list[list[str]] = []
    real_read, real_request = _files.LocalFiles.read, Transport.request

    def read(self, *a, **kw):
        seen.append(sorted(p.name for p in held.glob("*.json")))
        return real_read(self, *a, **kw)

    def request(self, method, path, **kw):
        if method == "PUT" and "/leases/" in path:
            time.sleep(scaled(0.5))
        return real_request(self, method, path, **kw)

    monkeypatch.setattr(_files.LocalFiles, "read", read)
    monkeypatch.setattr(Transport, "request", request)
    try:
        with CheckpointClient(srv.url) as c:
            c.save(_state(3), "sl/1").wait()
        for kw in ({}, {"direct_reads": False}):
            with CheckpointClient(srv.url, **kw) as c:
                got = _state(0)
                report = c.load(got, "sl/1")
            assert torch.equal(got["model"]["w"], _state(3.0)["model"]["w"]), kw
            assert (report.bytes_read_direct > 0) == (kw == {}), (kw, report)
            leases = list((tmp_path / "root" / "leases").rglob("*.json"))
            assert leases == [], (kw, leases)  # no ``reader-`` lease: every HTTP byte read named a held one
        assert seen and all(len(h) == 1 and h[0].startswith("client-") for h in seen), seen
    finally:
        srv.stop()
