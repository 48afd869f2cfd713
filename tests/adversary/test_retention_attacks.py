"""Attacks on retention: a corrupt newest checkpoint, and a reader slower than its lease.

The promise (docs/retention.md): gc never leaves a run without its newest *verified* checkpoint,
offline, through the service and as the service's own policy; a reader that is still reading
keeps its checkpoint however long it reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from ckptd_client import CheckpointClient
from support import ServerProcess, assert_bits_equal, blank_like, scaled

RUN = "ret"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(128, 64, generator=g)}


def _flip_data_byte(root: Path, name: str) -> None:
    (path,) = [p for p in (root / "runs" / RUN / name / "sessions").glob("*/files/*") if p.is_file()]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 3] ^= 0x40
    path.write_bytes(bytes(raw))


def _names(srv: ServerProcess) -> list[str]:
    return [c["name"] for c in httpx.get(f"{srv.url}/v1/runs/{RUN}/checkpoints", timeout=10).json()]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_gc_keeps_the_newest_verified_checkpoint_when_the_newest_is_corrupt(tmp_path):
    srv = ServerProcess(tmp_path / "root").start()
    root = Path(srv.root)
    try:
        states = {s: _state(s) for s in (1, 2, 3)}
        with CheckpointClient(srv.url) as c:
            for s, sd in states.items():
                c.save(sd, f"{RUN}/{s}").wait()
        _flip_data_byte(root, "3")
        # A dry run says which checkpoint is the newest verified one and how that was established: step 2's
        # commit recorded its full check, whose stamps still hold (step 3's no longer do: it is read again).
        for target, how in ((["--root", str(root)], "recorded verification of the stored bytes"),
                            (["--server", srv.url], "recorded verification of the stored bytes")):
            dry = _cli("gc", RUN, "--keep-last", "1", "--dry-run", "--json", *target)
            assert dry.returncode == 0, dry.stdout + dry.stderr
            plan = json.loads(dry.stdout)
            assert plan["newest_verified"] == "2" and plan["verified_how"] == how, plan
            assert "3" in plan["failed_verification"] and plan["delete"] == ["1"], plan
            assert plan["keep"]["2"] == "newest verified checkpoint"
        assert _names(srv) == ["1", "2", "3"]
        # Through the service: the older good one stays; only step 1 goes.
        r = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1}, timeout=120)
        assert r.status_code == 200 and r.json()["deleted"] == ["1"], r.text
        assert _names(srv) == ["2", "3"]
        # Nothing is left to delete: step 2 is what RUN/latest resolves to (step 3 is known to be bad).
        again = _cli("gc", RUN, "--keep-last", "1", "--json", "--root", str(root))
        plan = json.loads(again.stdout)
        assert plan["latest"] == "2" and "3" in plan["known_bad"] and plan["deleted"] == [], again.stdout
        # ...and once step 2's bytes change too, still nothing is deleted.
        _flip_data_byte(root, "2")
        plan = json.loads(_cli("gc", RUN, "--keep-last", "1", "--json", "--root", str(root)).stdout)
        assert plan["deleted"] == [], plan
        assert _names(srv) == ["2", "3"]
    finally:
        srv.stop()


def test_the_service_policy_keeps_the_newest_verified_checkpoint(tmp_path):
    """Steps committed out of order (a late save of step 7 after step 10): the policy's run after
    step 7's commit finds the newest checkpoint (10) corrupt and keeps 7, the newest that verifies."""
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_RETENTION_KEEP_LAST": "1"}).start()
    root = Path(srv.root)
    try:
        with CheckpointClient(srv.url) as c:
            c.save(_state(5), f"{RUN}/5").wait()
            c.save(_state(10), f"{RUN}/10").wait()
            deadline = time.monotonic() + 60
            while _names(srv) != ["10"] and time.monotonic() < deadline:  # 5 goes: 10 verified
                time.sleep(0.1)
            assert _names(srv) == ["10"]
            _flip_data_byte(root, "10")
            seven = _state(7)
            c.save(seven, f"{RUN}/7").wait()
            time.sleep(3)  # the policy runs in the background after the commit
            assert _names(srv) == ["7", "10"]
            out = blank_like(seven)
            c.load(out, f"{RUN}/7")
            assert_bits_equal(out, seven)
        assert "retention of run ret failed" not in srv.log.read_text()
    finally:
        srv.stop()


def test_a_reader_slower_than_its_lease_keeps_its_checkpoint(tmp_path):
    """Leases of 4 s; a reader fetches one range a second (and a save and a gc later) for 7 rounds
    through the service while gc with ``--keep-last 1`` runs after every newer commit. Its checkpoint
    survives until it stops reading. (4 s, scaled: a round on a loaded 2-core machine can take 2 s.)"""
    lease = scaled(4.0)
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": f"{lease:g}"}).start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save(_state(1), f"{RUN}/1").wait()
            m = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/1", timeout=10).json()
            (file,) = m["files"]
            for i in range(7):
                r = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/1/files/{file}", headers={"Range": "bytes=0-1023"},
                              timeout=10)
                assert r.status_code == 206, f"read {i}: {r.text[:200]}"
                c.save(_state(2 + i), f"{RUN}/{2 + i}").wait()
                plan = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1}, timeout=60).json()
                assert plan["keep"].get("1", "").startswith("leased"), plan
                time.sleep(1.0)
            time.sleep(1.5 * lease)  # reading stopped: the lease (a renewal lasts one and a half) lapses
            plan = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1}, timeout=60).json()
            assert "1" in plan["deleted"], plan
    finally:
        srv.stop()
