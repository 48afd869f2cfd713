"""A load through the checkpoint's load tree, against a real ``ckptd serve``: what one rank fetches before
its bytes stays flat from 16 to 256 ranks (the whole manifest grows 16x), every value arrives, and
the tree is held to its marker: a marker naming another root fails the load typed and fails ``ckptd
verify``, a marker naming none is loaded through the manifest as before.

The saves are simulated ranks on the wire protocol (open the session, upload the rank's file with
its digest, put its index), each rank one row band of every tensor; the load is the real client, one
rank's bands as ``FlatShard`` views."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import xxhash

from ckptd_client import CheckpointClient, FlatShard
from ckptd_schemas import CorruptCheckpoint
from support import ServerProcess

TENSORS, ROWS, COLS = 6, 2, 8
BAND = ROWS * COLS * 4  # float32 bytes of one rank's band of one tensor


def _value(world: int, t: int) -> torch.Tensor:
    return torch.arange(ROWS * world * COLS, dtype=torch.float32).reshape(ROWS * world, COLS) * (t + 1) + world


def _save(url: str, name: str, world: int) -> None:
    base = f"{url}/v1/checkpoints/tree/{name}"
    sid = f"s-{name}"
    with httpx.Client(timeout=60) as c:
        for r in range(world):
            assert c.post(f"{base}/sessions", json={"session": sid, "world_size": world, "step": world}
                          ).status_code == 200
            data = b"".join(_value(world, t)[r * ROWS:(r + 1) * ROWS].numpy().tobytes() for t in range(TENSORS))
            file = f"r{r:05d}.bin"
            assert c.put(f"{base}/sessions/{sid}/files/{file}", content=data,
                         headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)}).status_code == 200
            index = {"rank": r, "world_size": world,  "files": [file], "objects": [
                {"name": "rng", "rank": r, "encoding": "json", "value": r}], "tensors": [
                {"name": f"model.w{t}", "shape": [ROWS * world, COLS], "dtype": "float32", "group": "model",
                 "chunks": [{"kind": "box", "rank": r, "offsets": [r * ROWS, 0], "sizes": [ROWS, COLS],
                             "location": {"file": file, "offset": t * BAND, "length": BAND, "raw_length": BAND,
                                          "xxh3": xxhash.xxh3_64_hexdigest(data[t * BAND:(t + 1) * BAND])}}]}
                for t in range(TENSORS)]}
            st = c.put(f"{base}/sessions/{sid}/ranks/{r}", json=index)
            assert st.status_code == 200, st.text
    assert st.json()["state"] == "committed"


def _rank_state(world: int, rank: int) -> dict:
    n = ROWS * COLS
    return {"model": {f"w{t}": FlatShard(torch.zeros(n), (ROWS * world, COLS), rank * n) for t in range(TENSORS)},
            "rng": None}


def _load(url: str, name: str, world: int, rank: int):
    sd = _rank_state(world, rank)
    with CheckpointClient(url) as client:
        report = client.load(sd, f"tree/{name}")  # this process is rank 0: it restores rank 0's "rng"
    for t in range(TENSORS):
        want = _value(world, t)[rank * ROWS:(rank + 1) * ROWS].reshape(-1)
        assert torch.equal(sd["model"][f"w{t}"].local, want), t
    assert sd["rng"] == 0
    return report


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree") / "root"
    srv = ServerProcess(root, log=root.parent / "server.log").start()
    try:
        _save(srv.url, "small", 16)
        _save(srv.url, "large", 256)
        yield srv, root
    finally:
        srv.stop()


def test_what_one_rank_fetches_is_flat_in_the_world_size(served) -> None:
    srv, _ = served
    small = _load(srv.url, "small", 16, 7)
    large = _load(srv.url, "large", 256, 7)
    manifests = {n: len(httpx.get(f"{srv.url}/v1/checkpoints/tree/{n}", timeout=30).content) for n in ("small", "large")}
    assert manifests["large"] > 12 * manifests["small"]  # the whole manifest grows with the ranks...
    assert large.metadata_bytes < 1.5 * small.metadata_bytes, (small.metadata_bytes, large.metadata_bytes)
    assert large.metadata_bytes < manifests["large"] / 10  # ...what a rank fetches does not
    assert _load(srv.url, "large", 256, 255).metadata_bytes < 1.5 * small.metadata_bytes


def _marker(root: Path, name: str) -> Path:
    return root / "runs" / "tree" / name / "COMMITTED"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True, timeout=180)


def test_a_marker_naming_another_tree_fails_the_load_and_verify(served, tmp_path) -> None:
    srv, root = served
    _save(srv.url, "edited", 4)
    path = _marker(root, "edited")
    marker = json.loads(path.read_bytes())
    marker["load_tree"] = "0" * 32
    path.write_text(json.dumps(marker))
    with pytest.raises(CorruptCheckpoint, match="load tree"):
        _load(srv.url, "edited", 4, 1)
    out = _cli("verify", "tree/edited", "--root", str(root))
    assert out.returncode == 1 and "load tree" in out.stdout + out.stderr, out.stdout + out.stderr
    out = _cli("verify", "tree/edited", "--server", srv.url)
    assert out.returncode == 1 and "load tree" in out.stdout + out.stderr, out.stdout + out.stderr
    _load(srv.url, "small", 16, 3)  # another checkpoint of the run still loads


def test_a_marker_without_a_tree_is_loaded_through_its_manifest(served) -> None:
    srv, root = served
    _save(srv.url, "old", 4)
    path = _marker(root, "old")
    marker = json.loads(path.read_bytes())
    del marker["load_tree"]
    path.write_text(json.dumps(marker))
    report = _load(srv.url, "old", 4, 2)
    manifest = len(httpx.get(f"{srv.url}/v1/checkpoints/tree/old", timeout=30).content)
    assert report.metadata_bytes == manifest  # the manifest alone: the reads are planned here


def test_a_dcp_reader_plans_through_the_tree_as_the_load_does(served) -> None:
    """``dcp.load`` through ``client.dcp_reader`` plans its reads here from the checked pieces, like the
    load: every value arrives from a checkpoint with a tree and from one whose marker names none, and a
    marker naming another tree fails the rank typed. (The reader used to read by the service's own read
    plan: the edited marker's checkpoint loaded.)"""
    import torch.distributed.checkpoint as dcp

    srv, root = served
    for name in ("dcp-tree", "dcp-old", "dcp-edited"):
        _save(srv.url, name, 4)
    for name, named in (("dcp-old", None), ("dcp-edited", "0" * 32)):
        path = _marker(root, name)
        marker = json.loads(path.read_bytes())
        if named is None:
            del marker["load_tree"]  # written before load trees
        else:
            marker["load_tree"] = named  # names another tree
        path.write_text(json.dumps(marker))
    with CheckpointClient(srv.url) as client:
        for name in ("dcp-tree", "dcp-old"):
            sd = {"model": {"w1": torch.zeros(ROWS * 4, COLS)}}
            dcp.load(sd, storage_reader=client.dcp_reader(f"tree/{name}"), no_dist=True)
            assert torch.equal(sd["model"]["w1"], _value(4, 1)), name
        with pytest.raises(BaseException) as info:  # DCP wraps the rank's error in its CheckpointException
            dcp.load(sd, storage_reader=client.dcp_reader("tree/dcp-edited"), no_dist=True)
    assert "CorruptCheckpoint" in str(info.value) and "load tree" in str(info.value), info.value


def test_a_rank_with_more_regions_than_a_request_may_name_sends_several(tmp_path) -> None:
    """A service that takes 4 regions per request (``CKPTD_READ_PLAN_MAX_REQUESTS``) and a rank of 6
    tensors: the client splits its load-tree request by the limit the service's 413 names, and every
    value arrives (a marker without a tree: planned here from the manifest)."""
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_PLAN_MAX_REQUESTS": "4"},
                        log=tmp_path / "server.log").start()
    try:
        _save(srv.url, "tree", 8)
        one = httpx.post(f"{srv.url}/v1/checkpoints/tree/tree/load-tree", timeout=30,
                         json={"requests": [{"name": f"model.w{t}"} for t in range(TENSORS)]})
        err = one.json()["error"]
        assert one.status_code == 413 and err["details"]["max_requests"] == 4, one.text
        assert "CKPTD_READ_PLAN_MAX_REQUESTS" in err["message"]
        _load(srv.url, "tree", 8, 5)
        _save(srv.url, "old", 8)
        path = _marker(tmp_path / "root", "old")
        marker = json.loads(path.read_bytes())
        del marker["load_tree"]
        path.write_text(json.dumps(marker))
        _load(srv.url, "old", 8, 3)
    finally:
        srv.stop()
