"""The service verifies committed checkpoints in a worker process and records the outcome
(docs/design.md §2 item 5: "The service can run it after each commit and records the result").

Real ``ckptd serve`` processes; the records are read back over HTTP and checked against the
checkpoint's manifest, and a corrupt byte is found and named.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import torch
import xxhash

from ckptd_client import CheckpointClient
from support import ServerProcess, make_state, verified


def _wait_record(url: str, ref: str, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/v1/checkpoints/{ref}/verification", timeout=10)
        if r.status_code == 200:
            return r.json()
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        time.sleep(0.2)
    raise AssertionError(f"no verification of {ref} recorded in {timeout}s")


def test_the_commit_records_its_own_check_without_a_second_read(tmp_path):
    """With CKPTD_VERIFY_BEFORE_VISIBLE (the commit reads every byte back before its marker): the record
    is there the moment the save returns, about this manifest, and counts every byte the commit read
    with the one checker. (By default the bytes are checked as they arrive and the record is the
    re-read's, after the marker: tests/adversary/test_arrival.py.)"""
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_VERIFY_BEFORE_VISIBLE": "true"}).start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save(make_state(1, mib=1.0), "c/1").wait()
            m = c.manifest("c/1")
        r = httpx.get(f"{srv.url}/v1/checkpoints/c/1/verification", timeout=10)
        assert r.status_code == 200, r.text  # no wait: written before the marker was answered
        rec = r.json()
        marker = httpx.get(f"{srv.url}/v1/checkpoints/c/1", timeout=10)
        assert rec["ok"] is True and rec["problems"] == [] and rec["ref"] == "c/1"
        assert rec["bytes_read"] == m.total_bytes > 1 << 20 and rec["files"] == len(m.files)
        assert rec["manifest_xxh3"] == xxhash.xxh3_64_hexdigest(marker.content)
        assert set(rec["stamps"]) == set(m.files)  # nothing moved while it was read: the stamps vouch
    finally:
        srv.stop()


def test_every_commit_is_verified_and_recorded(tmp_path):
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_VERIFY_AFTER_COMMIT": "true"}).start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save(make_state(1, mib=1.0), "v/1").wait()
            c.save(make_state(2, mib=1.0), "v/2").wait()
            manifests = {n: c.manifest(f"v/{n}") for n in ("1", "2")}
        for n, m in manifests.items():
            rec = _wait_record(srv.url, f"v/{n}")
            marker = httpx.get(f"{srv.url}/v1/checkpoints/v/{n}", timeout=10)
            assert rec["ok"] is True and rec["problems"] == [], rec
            assert rec["ref"] == f"v/{n}" and rec["bytes_read"] == m.total_bytes > 1 << 20
            assert rec["files"] == len(m.files) and rec["tensors"] == len(m.tensors)
            assert rec["manifest_xxh3"] == xxhash.xxh3_64_hexdigest(marker.content)  # about this manifest
        assert _wait_record(srv.url, "v/latest")["ref"] == "v/2"  # latest resolves to the newest step
    finally:
        srv.stop()


def test_verify_on_request_finds_a_corrupt_byte_and_names_the_file(server):
    with CheckpointClient(server.url) as c:
        c.save({"w": torch.randn(256, 512)}, "v/3").wait()
    (first,) = verified(server.url, "v/3")  # the re-read after the commit
    assert first["ok"] is True and first["bytes_read"] == 256 * 512 * 4 and first["stamps"], first
    good = httpx.post(f"{server.url}/v1/checkpoints/v/3/verify", timeout=120).json()
    assert good["ok"] is True and good["bytes_read"] > 0

    (path,) = sorted(p for p in Path(server.root).rglob("files/*") if p.is_file())
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    bad = httpx.post(f"{server.url}/v1/checkpoints/v/3/verify", timeout=120).json()
    assert bad["ok"] is False and any(path.name in p for p in bad["problems"]), bad
    assert httpx.get(f"{server.url}/v1/checkpoints/v/3/verification", timeout=10).json() == bad  # recorded


def test_verify_of_a_missing_checkpoint_is_404(server):
    r = httpx.post(f"{server.url}/v1/checkpoints/v/404/verify", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "checkpoint_not_found", r.text


def test_a_manifest_that_no_longer_matches_its_marker_is_not_visible_to_verify(server):
    with CheckpointClient(server.url) as c:
        c.save({"w": torch.randn(64, 64)}, "v/5").wait()
    (manifest,) = sorted(Path(server.root).rglob("v/5/sessions/*/manifest-*.json"))
    manifest.write_bytes(manifest.read_bytes().replace(b'"w"', b'"x"', 1))
    r = httpx.post(f"{server.url}/v1/checkpoints/v/5/verify", timeout=120)  # invisible now: nothing to verify
    assert r.status_code == 404 and "does not hash to the digest" in r.json()["error"]["message"], r.text


def test_ckptd_verify_in_service(server, tmp_path):
    import subprocess
    import sys

    with CheckpointClient(server.url) as c:
        c.save({"w": torch.randn(128, 128)}, "v/6").wait()

    def cli(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", "v/6", *extra],
                              capture_output=True, text=True, timeout=120)

    ok = cli("--server", server.url, "--in-service")
    assert ok.returncode == 0 and ok.stdout.startswith("OK v/6"), ok.stdout + ok.stderr
    assert httpx.get(f"{server.url}/v1/checkpoints/v/6/verification", timeout=10).json()["ok"] is True
    usage = cli("--root", str(tmp_path), "--in-service")
    assert usage.returncode == 2 and "needs --server" in usage.stderr
    (path,) = sorted(p for p in Path(server.root).rglob("v/6/sessions/*/files/*") if p.is_file())
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    bad = cli("--server", server.url, "--in-service", "--json")
    assert bad.returncode == 1 and '"ok": false' in bad.stdout and path.name in bad.stdout, bad.stdout


def test_a_killed_worker_process_does_not_stop_later_verifications(tmp_path):
    """A worker process killed mid-life (the kernel's OOM killer, an operator) breaks its pool for good;
    the service starts a new pool on the next request, so verifications (and jobs, drills, rechecks)
    work again without a restart."""
    import signal

    from support import scaled

    srv = ServerProcess(tmp_path / "root").start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save(make_state(1, mib=0.25), "w/1").wait()
        assert httpx.post(f"{srv.url}/v1/checkpoints/w/1/verify", timeout=120).json()["ok"] is True

        def children(pid: int) -> list[int]:
            out = []
            for p in Path("/proc").iterdir():
                if p.name.isdigit():
                    try:
                        st = (p / "stat").read_text()
                        cmd = (p / "cmdline").read_bytes()
                    except OSError:
                        continue
                    if int(st.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmd:
                        out.append(int(p.name))
            return out

        serve = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                 and b"ckptd.cli.main\x00serve" in (p / "cmdline").read_bytes()
                 and str(srv.root).encode() in (p / "cmdline").read_bytes()]
        workers = [w for s in serve for w in children(s)]
        assert workers, "no worker process found"
        for w in workers:
            os.kill(w, signal.SIGKILL)
        deadline = time.monotonic() + scaled(60)
        while True:
            r = httpx.post(f"{srv.url}/v1/checkpoints/w/1/verify", timeout=120)
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, r.text  # the broken pool refused every later job
            time.sleep(0.5)
        assert r.json()["ok"] is True
    finally:
        srv.stop()
