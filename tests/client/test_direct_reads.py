"""Direct reads (client/_files.py): a load on the service's host reads the data files itself.

A real ``ckptd serve`` over a local root offers each file's path in the read plan; the client
reads through ``preadv`` and verifies every block digest. The refusal paths: the service turned
off, a file that is corrupt (both paths fail, naming the file), and a file at the offered path
that is not the service's (wrong bytes, wrong size, absent): the load falls back to HTTP and gives
the checkpoint's values.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from ckptd_client import CheckpointClient
from ckptd_client._files import LocalFiles
from ckptd_client._flatten import flatten
from ckptd_client._placement import local_piece
from ckptd_client._load import _destination, _request, execute
from ckptd_schemas import ChecksumMismatch, ReadPlan
from support import ServerProcess, assert_bits_equal, blank_like, make_state


def _data_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("files/*") if p.is_file())


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_load_reads_the_service_files_and_matches_http(server):
    sd = make_state(3, mib=2.0)
    with CheckpointClient(server.url) as c:
        c.save(sd, "d/1").wait()
        direct = blank_like(sd)
        rep = c.load(direct, "d/1")
    with CheckpointClient(server.url, direct_reads=False) as c:
        via_http = blank_like(sd)
        rep_http = c.load(via_http, "d/1")
    for got in (direct, via_http):
        assert_bits_equal({"model": got["model"]}, {"model": sd["model"]})
    assert rep.bytes_read > 2 << 20 and rep.bytes_read_direct == rep.bytes_read
    assert rep_http.bytes_read == rep.bytes_read and rep_http.bytes_read_direct == 0


def test_buffered_copies_read_directly_too(server):
    """A destination that is not row-major (a transposed view) takes the buffered path: the whole
    fetch is read from the file into a buffer, verified, then copied with strided views."""
    w = torch.randn(300, 70)
    with CheckpointClient(server.url) as c:
        c.save({"w": w}, "d/2").wait()
        dest = torch.zeros(70, 300).t()
        assert not dest.is_contiguous()
        rep = c.load({"w": dest}, "d/2")
    assert torch.equal(dest, w) and rep.bytes_read_direct == rep.bytes_read > 0


def test_the_service_can_turn_direct_reads_off(tmp_path):
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_DIRECT_READS": "false"}).start()
    try:
        sd = make_state(4)
        with CheckpointClient(srv.url) as c:
            c.save(sd, "d/3").wait()
            got = blank_like(sd)
            rep = c.load(got, "d/3")
        assert_bits_equal(got["model"], sd["model"])
        assert rep.bytes_read > 0 and rep.bytes_read_direct == 0
    finally:
        srv.stop()


def test_read_plan_names_paths_only_when_asked(server):
    with CheckpointClient(server.url) as c:
        c.save({"w": torch.ones(64, 64)}, "d/4").wait()
    url = f"{server.url}/v1/checkpoints/d/4/read-plan"
    plain = httpx.post(url, json={"requests": [{"name": "w"}]}).json()
    assert "local_paths" not in plain  # an older client sees the plan it knows
    asked = httpx.post(url, json={"requests": [{"name": "w"}], "local_paths": True}).json()
    files = {f["file"] for f in asked["fetches"]}
    assert set(asked["local_paths"]) == files
    for p in asked["local_paths"].values():
        assert os.path.isabs(p) and Path(p).is_file() and Path(p).is_relative_to(Path(server.root).resolve())


def test_a_corrupt_file_fails_on_both_paths_naming_it(server):
    sd = {"w": torch.randn(512, 256)}
    with CheckpointClient(server.url) as c:
        c.save(sd, "d/5").wait()
        (path,) = _data_files(Path(server.root))
        _flip(path, os.path.getsize(path) // 2)
        for direct in (True, False):
            c.direct_reads = direct
            with pytest.raises(ChecksumMismatch, match=path.name):
                c.load({"w": torch.zeros(512, 256)}, "d/5")


def _plan(c: CheckpointClient, ref: str, sd: dict) -> tuple[str, ReadPlan, list]:
    run, name = ref.split("/")
    base = f"/v1/checkpoints/{run}/{name}"
    pieces = [(leaf, local_piece(leaf.fqn, leaf.value)) for leaf in flatten(sd).leaves if leaf.kind == "tensor"]
    body = {"requests": [_request(leaf.fqn, p).model_dump(exclude_none=True) for leaf, p in pieces],
            "local_paths": True}
    plan = ReadPlan.model_validate(c._transport.request("POST", f"{base}/read-plan", json=body))
    assert plan.local_paths
    return base, plan, pieces


@pytest.mark.parametrize("case", ["other bytes", "other size", "absent"])
def test_a_file_that_is_not_the_services_falls_back_to_http(server, tmp_path, case):
    """What a rank on another host sees when the service's path exists there with other content
    (or not at all): its bytes are never used for the result."""
    want = torch.randn(700, 300)
    with CheckpointClient(server.url) as c:
        c.save({"w": want}, "d/6").wait()
        got = {"w": torch.zeros(700, 300)}
        base, plan, pieces = _plan(c, "d/6", got)
        sizes = {f: os.path.getsize(p) for f, p in plan.local_paths.items()}
        other = {}
        for f, p in plan.local_paths.items():
            dst = tmp_path / "elsewhere" / f
            dst.parent.mkdir(exist_ok=True)
            shutil.copy(p, dst)
            if case == "other bytes":
                _flip(dst, sizes[f] // 3)
            elif case == "other size":
                with open(dst, "ab") as fh:
                    fh.write(b"\0")
            else:
                dst.unlink()
            other[f] = str(dst)
        files = LocalFiles(other, sizes)
        try:
            execute(c._transport, base, plan, [_destination(p) for _, p in pieces], 2, files)
        finally:
            files.close()
    assert torch.equal(got["w"], want)
    assert files.enabled is (case != "other bytes")  # a digest failure there stops direct reads
    assert files.bytes_read < plan.bytes_to_read or case == "other bytes"


@pytest.mark.parametrize("direct", [True, False])
def test_the_dcp_reader_reads_both_ways(server, direct):
    import torch.distributed.checkpoint as dcp

    want = {"w": torch.randn(257, 33), "b": torch.randn(9).to(torch.bfloat16)}
    with CheckpointClient(server.url) as c:
        dcp.save(want, storage_writer=c.dcp_writer(f"dcp/{int(direct)}"))
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    with CheckpointClient(server.url, direct_reads=direct) as c:
        reader = c.dcp_reader(f"dcp/{int(direct)}")
        dcp.load(got, storage_reader=reader)
    assert reader.direct_reads is direct
    for k in want:
        assert torch.equal(got[k], want[k]), k
