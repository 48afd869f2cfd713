"""Direct writes (client/_staging.py): a save on the service's host writes its data files itself.

A real ``ckptd serve`` over a local root offers the session's directory when a session is opened
with ``direct_writes``; the client writes each data file there and the service adopts it after
hashing every byte. Checked here: the bytes never cross HTTP, the checkpoint loads and verifies
in its own process, no staged file is left behind; either side can turn it off; a staged file the
service refuses (corrupted between the client's hash and the service's read) is uploaded over
HTTP instead and the save commits; a probe that does not read back keeps the client on HTTP.
The service's refusals of bad staged files are in ``test_refusals.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd_client import CheckpointClient
from ckptd_client._staging import StagingDir, probe
from ckptd_schemas import DirectWrites
from support import ServerProcess, assert_bits_equal, blank_like, make_state


def _requests(url: str) -> dict[str, float]:
    """``route status -> count`` of the upload routes, from the service's own metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("ckptd_http_requests_total{") and ("upload_file" in line or "adopt_file" in line):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
            key = f"{labels['route'].strip(chr(34))} {labels['status'].strip(chr(34))}"
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


def _staged_leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("files/.*.direct-*"))


def _verify(root: Path, ref: str) -> None:
    p = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", ref, "--root", str(root)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith(f"OK {ref}"), p.stdout + p.stderr


def test_save_writes_its_files_and_the_service_adopts_them(server):
    sd = make_state(3, mib=3.0)
    with CheckpointClient(server.url, file_bytes=1 << 20) as c:  # direct writes are the default
        c.save(sd, "w/1").wait()
        got = blank_like(sd)
        c.load(got, "w/1")
    assert_bits_equal(got, sd)
    seen = _requests(server.url)
    assert seen.get("adopt_file 200", 0) >= 2, seen   # one per data file, several files
    assert not any(k.startswith("upload_file") for k in seen), seen
    assert _staged_leftovers(Path(server.root)) == []
    _verify(Path(server.root), "w/1")


def test_the_client_or_the_service_can_turn_direct_writes_off(server, tmp_path):
    sd = make_state(4)
    with CheckpointClient(server.url, direct_writes=False) as c:
        c.save(sd, "w/2").wait()
    seen = _requests(server.url)
    assert seen.get("upload_file 200", 0) >= 1 and "adopt_file 200" not in seen, seen

    off = ServerProcess(tmp_path / "root-off", env={"CKPTD_DIRECT_WRITES": "false"}).start()
    try:
        r = httpx.post(off.url + "/v1/checkpoints/w/3/sessions",
                       json={"session": "s1", "world_size": 1, "direct_writes": True})
        assert r.status_code == 200 and "direct" not in r.json(), r.text
        with CheckpointClient(off.url, direct_writes=True) as c:
            c.save(sd, "w/4").wait()
            got = blank_like(sd)
            c.load(got, "w/4")
        assert_bits_equal(got, sd)
        seen = _requests(off.url)
        assert seen.get("upload_file 200", 0) >= 1 and "adopt_file 200" not in seen, seen
        r = httpx.post(off.url + "/v1/checkpoints/w/3/sessions/s1/files/a.bin/adopt",
                       json={"staged": ".a.bin.direct-" + "0" * 32, "size": 0, "xxh3": "0" * 16})
        assert r.status_code == 400 and "direct writes are off" in r.json()["error"]["message"], r.text
    finally:
        off.stop()


def test_a_refused_staged_file_is_uploaded_over_http_instead(server, monkeypatch, caplog):
    """One byte of the first staged file changes after the client hashed it: the service refuses
    that file (checksum mismatch) and deletes it; the client uploads it over HTTP, the rest of the
    save goes over HTTP, and the checkpoint holds the right bytes."""
    real = StagingDir.write
    corrupted: list[str] = []

    def write_then_corrupt(self, file, size, pieces):
        staged = real(self, file, size, pieces)
        if staged is not None and not corrupted:
            path = Path(self.path) / staged
            with open(path, "r+b") as f:
                b = f.read(1)
                f.seek(0)
                f.write(bytes([b[0] ^ 1]))
            corrupted.append(staged)
        return staged

    monkeypatch.setattr(StagingDir, "write", write_then_corrupt)
    sd = make_state(5, mib=2.0)
    with CheckpointClient(server.url, file_bytes=1 << 20, streams=1, direct_writes=True) as c:
        c.save(sd, "w/5").wait()
        got = blank_like(sd)
        c.load(got, "w/5")
    assert_bits_equal(got, sd)
    seen = _requests(server.url)
    assert corrupted and seen.get("adopt_file 422") == 1, seen
    assert seen.get("upload_file 200", 0) >= 2, seen    # the refused file and every later one
    assert "adopt_file 200" not in seen, seen
    assert any("direct writes off" in r.getMessage() for r in caplog.records)
    assert _staged_leftovers(Path(server.root)) == []
    _verify(Path(server.root), "w/5")


def test_probe_reads_the_token_back_or_declines(tmp_path):
    (tmp_path / "probe").write_text("token-a")
    assert probe(DirectWrites(dir=str(tmp_path), probe=str(tmp_path / "probe"), token="token-a")) is not None
    # The same path on another filesystem (another host) holds another token, or nothing.
    assert probe(DirectWrites(dir=str(tmp_path), probe=str(tmp_path / "probe"), token="token-b")) is None
    assert probe(DirectWrites(dir=str(tmp_path), probe=str(tmp_path / "absent"), token="token-a")) is None
    assert probe(None) is None


def test_staging_dir_that_cannot_be_written_turns_itself_off(tmp_path):
    staging = StagingDir(str(tmp_path / "not-there"))
    assert staging.write("a.bin", 3, [b"abc"]) is None and not staging.enabled
    staging = StagingDir(str(tmp_path))
    name = staging.write("a.bin", 5, [b"ab", memoryview(b"cde")])
    assert name is not None and (tmp_path / name).read_bytes() == b"abcde" and staging.bytes_written == 5
    assert staging.write("b.bin", 9, [b"short"]) is None and not staging.enabled   # size disagrees
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]                    # nothing half-written kept


def test_dcp_writer_writes_directly_too(server):
    sd = {"w": torch.randn(257, 33), "b": torch.arange(40, dtype=torch.int64)}
    with CheckpointClient(server.url) as c:
        dcp.save(sd, storage_writer=c.dcp_writer("w/6"))
        got = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(got, storage_reader=c.dcp_reader("w/6"))
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert _requests(server.url).get("adopt_file 200", 0) >= 1
    _verify(Path(server.root), "w/6")


def test_both_paths_store_the_same_bytes(server):
    """The committed data files do not depend on how they travelled."""
    sd = make_state(6, mib=1.0)
    contents = {}
    for direct in (True, False):
        with CheckpointClient(server.url, direct_writes=direct, file_bytes=1 << 19) as c:
            c.save(sd, f"same/{int(direct)}").wait()
        files = sorted((Path(server.root) / "runs" / "same" / str(int(direct))).rglob("files/r*.bin"))
        contents[direct] = [(f.name, f.read_bytes()) for f in files]
    assert len(contents[True]) >= 2 and contents[True] == contents[False]


@pytest.mark.parametrize("point", ["upload-mid-stream", "upload-before-digest"])
def test_service_killed_while_adopting_then_restarted(tmp_path, point):
    """The service SIGKILLs itself while adopting a staged file: part-hashed (the staged file is still
    there; the client's retry adopts it), or renamed into place before its digest was recorded (the
    retry finds no staged file and no digest, so the client uploads that file over HTTP). Either
    way the same save commits once, loads, verifies, and leaves no staged file."""
    srv = ServerProcess(tmp_path / "root").start(env={"CKPTD_FAULTS": f"crash-at={point}"})
    try:
        sd = make_state(7, mib=1.0)
        with CheckpointClient(srv.url, direct_writes=True, retry_seconds=60, streams=1) as c:
            handle = c.save(sd, "k/1")
            assert srv.wait_exit(timeout=60) < 0, f"the service did not stop at {point}"
            srv.start()  # no crash point
            status = handle.wait(timeout=90)
            assert status.state == "committed" and status.session == handle.session
            got = blank_like(sd)
            c.load(got, "k/1")
        assert_bits_equal(got, sd)
        seen = _requests(srv.url)  # counted by the restarted process only
        if point == "upload-mid-stream":
            assert seen.get("adopt_file 200", 0) >= 1 and not any(k.startswith("upload_file") for k in seen), seen
        else:
            assert seen.get("adopt_file 400") == 1 and seen.get("upload_file 200", 0) >= 1, seen
        assert _staged_leftovers(Path(srv.root)) == []
        _verify(Path(srv.root), "k/1")
    finally:
        srv.stop()
