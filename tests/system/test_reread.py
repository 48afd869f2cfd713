"""The independent re-read after a marker: held by the store, split in shares, taken over when its checker dies.

Real ``ckptd serve`` processes on one local root, real worker processes, real SIGKILLs (the fault server
kills itself at a named point: ``tests/fault_server.py``). A rank speaks the wire protocol, its chunks
declared ahead of its bytes, so the commit reads none of them and leaves them to the re-read:

* a service SIGKILLed right after a marker, before any re-read began: the service started again on the
  root re-reads the checkpoint and records it verified; a byte flipped while it was down is found, the
  checkpoint recorded known bad and ``latest`` moves on to the last good one;
* a service SIGKILLed with one share of a re-read stored and the other claimed by its dead worker: a
  second replica on the root takes the claimed share over once its claim expires, reads only that share,
  and records the checkpoint verified, every byte counted once;
* two worker processes split one checkpoint: two shares, each read once (``ckptd_reread_bytes_total``
  and the record's ``bytes_read`` are the checkpoint's bytes, not twice them), on a local root and on
  S3 (moto), where no entry is left behind (on a local root, not even the run's folder);
* a stored manifest whose chunks leave a gap in a tensor, every digest and the marker made to agree, so
  that each file's bytes check: one share checks the tiling too, as ``ckptd verify`` does, and the
  checkpoint is recorded known bad naming the tensor;
* a replica stopped gracefully while it holds claims for an hour (its checks done, their records not yet
  stored): it deletes them on the way out, and the other replica's next sweep takes the shares at once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import xxhash

from adversary.test_requests import ALICE, TOKENS, _auth, _metric
from ckptd_schemas.arrival import CHUNKS_HEADER, Declared, encode
from ckptd.storage import LocalStorage
from ckptd.store.rereads import mark_due
from support import ServerProcess, plant_file, scaled, verified

N = 64 * 1024  # int32 elements of each file's tensor, in two chunks


def _env(**more: str) -> dict[str, str]:
    """Sweeps and claim renewals often, a dead checker's claim expired after about a second."""
    return {"CKPTD_TOKENS": TOKENS, "CKPTD_RECLAIM_INTERVAL": str(scaled(0.2)),
            "CKPTD_JOB_HEARTBEAT_SECONDS": str(scaled(0.25)), "CKPTD_JOB_TAKEOVER_SECONDS": str(scaled(1)), **more}


def _data(seed: int) -> bytes:
    return b"".join(((seed * 7919 + i) % (1 << 31)).to_bytes(4, "little") for i in range(N))


def _rows(data: bytes, tensor: str) -> list[Declared]:
    half = len(data) // 2
    return [Declared(o, half, xxhash.xxh3_64_hexdigest(data[o:o + half]), "raw", half, "tensor", tensor)
            for o in (0, half)]


def _save(url: str, name: str, step: int, files: dict[str, bytes]) -> httpx.Response | None:
    """A one-rank save of ``files`` (one int32 tensor each), every chunk declared ahead of its bytes; the
    index's answer, or None when the service died before it answered."""
    r = httpx.post(f"{url}/v1/checkpoints/r/{name}/sessions", headers=_auth(),
                   json={"session": "s1", "world_size": 1, "step": step})
    assert r.status_code == 200 and r.json()["arrival_checks"] is True, r.text
    tensors = []
    for i, (f, data) in enumerate(sorted(files.items())):
        rows, declared = _rows(data, f"w{i}"), encode(_rows(data, f"w{i}"))
        r = httpx.put(f"{url}/v1/checkpoints/r/{name}/sessions/s1/files/{f}", content=declared + data, timeout=60,
                      headers={**_auth(), "X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data),
                               CHUNKS_HEADER: str(len(declared))})
        assert r.status_code == 200, r.text
        tensors.append({"name": f"w{i}", "shape": [N], "dtype": "int32", "group": "model", "chunks": [
            {"kind": "flat", "rank": 0, "start": row.offset // 4, "length": row.length // 4,
             "location": {"file": f, "offset": row.offset, "length": row.length, "codec": "raw",
                          "raw_length": row.length, "xxh3": row.xxh3}} for row in rows]})
    index = {"rank": 0, "world_size": 1, "files": sorted(files), "tensors": tensors}
    try:
        return httpx.put(f"{url}/v1/checkpoints/r/{name}/sessions/s1/ranks/0", json=index, headers=_auth(),
                         timeout=60)
    except httpx.HTTPError:
        return None


def _files(seed: int, n: int) -> dict[str, bytes]:
    return {f"f{i}.bin": _data(seed * 10 + i) for i in range(n)}


def _statuses(url: str) -> dict[str, str]:
    r = httpx.get(f"{url}/v1/runs/r/checkpoints", headers=_auth(), timeout=10)
    assert r.status_code == 200, r.text
    return {c["name"]: c["status"] for c in r.json()}


def _latest(url: str) -> str:
    r = httpx.get(f"{url}/v1/checkpoints/r/latest", headers=_auth(), timeout=10)
    assert r.status_code == 200, r.text
    return r.headers["X-Ckptd-Name"]


def _entries_gone(root: Path) -> None:
    """The due entry is deleted once its record is written (right after it), and with it the run's folder
    once it holds no other entry: nothing is left under ``reread/``."""
    deadline = time.monotonic() + scaled(30)
    while (root / "reread" / "r").exists():
        assert time.monotonic() < deadline, sorted(str(p) for p in (root / "reread" / "r").rglob("*"))
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("flip", [False, True], ids=["intact", "flipped"])
def test_a_service_killed_after_the_marker_has_its_reread_finished_by_the_next_one(tmp_path, flip):
    root = tmp_path / "root"
    srv = ServerProcess(root, env=_env(), log=tmp_path / "server.log").start()
    try:
        good, files = _files(1, 2), _files(2, 2)
        assert _save(srv.url, "1", 1, good).status_code == 200
        assert verified(srv.url, "r/1", token=ALICE)[0]["ok"] is True
        srv.kill()
        srv.start(env={"CKPTD_FAULTS": "crash-at=commit-after-marker"})
        assert _save(srv.url, "2", 2, files) is None
        assert srv.wait_exit(timeout=scaled(60)) == -signal.SIGKILL
        staged = root / "runs" / "r" / "2" / "sessions" / "s1" / "files"
        assert (root / "runs" / "r" / "2" / "COMMITTED").exists() and (root / "reread" / "r" / "2").exists()
        assert not (root / "runs" / "r" / "2" / "VERIFIED.json").exists()  # nothing re-read it before the kill
        if flip:  # while no service runs: only the re-read can find it
            with open(staged / "f1.bin", "r+b") as f:
                f.seek(1000)
                b = f.read(1)
                f.seek(1000)
                f.write(bytes([b[0] ^ 1]))
        srv.start()  # the same root, no fault: its first sweep finds the re-read due
        rec = verified(srv.url, "r/2", token=ALICE)[0]
        _entries_gone(root)
        if flip:
            assert rec["ok"] is False and "f1.bin" in rec["problems"][0], rec
            assert _statuses(srv.url) == {"1": "verified", "2": "known bad"}
            assert _latest(srv.url) == "1"
        else:
            assert rec["ok"] is True and rec["bytes_read"] == sum(map(len, files.values())), rec
            assert sorted(rec["stamps"]) == ["f0.bin", "f1.bin"], rec  # it vouches for every file
            assert _statuses(srv.url) == {"1": "verified", "2": "verified"}
            assert _latest(srv.url) == "2"
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_share_whose_checker_died_is_finished_by_another_replica_once_its_claim_expires(tmp_path):
    root = tmp_path / "root"
    # Two workers take the two shares at once; the service dies storing the first one's record.
    a = ServerProcess(root, env=_env(CKPTD_RESHARD_WORKERS="2", CKPTD_FAULTS="crash-at=reread-part-stored"),
                      log=tmp_path / "a.log").start()
    b = None
    try:
        files = _files(3, 2)
        total = sum(map(len, files.values()))
        assert _save(a.url, "1", 1, files).status_code == 200
        assert a.wait_exit(timeout=scaled(60)) == -signal.SIGKILL
        entry = root / "reread" / "r" / "1" / "s1"
        assert len(list(entry.glob("part-*"))) == 1 and len(list(entry.glob("claim-*"))) == 2
        b = ServerProcess(root, env=_env(), log=tmp_path / "b.log").start()  # a second replica on the root
        rec = verified(b.url, "r/1", token=ALICE)[0]
        assert rec["ok"] is True and rec["bytes_read"] == total, rec  # each share's bytes once
        read_by_b = _metric(b.url, "ckptd_reread_bytes_total")
        assert 0 < read_by_b < total and _metric(b.url, "ckptd_reread_shares_total") == 1  # only the dead one's share
        _entries_gone(root)
        assert _statuses(b.url) == {"1": "verified"}
    finally:
        a.stop()
        if b is not None:
            b.stop()


@pytest.mark.slow
def test_two_workers_split_one_checkpoints_reread_and_read_each_share_once(tmp_path):
    srv = ServerProcess(tmp_path / "root", env=_env(CKPTD_RESHARD_WORKERS="2"), log=tmp_path / "server.log").start()
    try:
        files = _files(4, 4)
        total = sum(map(len, files.values()))
        assert _save(srv.url, "1", 1, files).status_code == 200
        rec = verified(srv.url, "r/1", token=ALICE)[0]
        _entries_gone(tmp_path / "root")
        assert rec["ok"] is True and rec["bytes_read"] == total and sorted(rec["stamps"]) == sorted(files), rec
        assert _metric(srv.url, "ckptd_reread_shares_total") == 2
        assert _metric(srv.url, "ckptd_reread_bytes_total") == total
    finally:
        srv.stop()


@pytest.mark.slow
def test_two_workers_split_a_reread_on_s3_and_leave_no_entry_behind(moto_s3, s3_env, tmp_path):
    """The same on an S3 root (moto): the plan, the claims (conditional PUTs) and the parts are objects."""
    from ckptd.storage import open_storage

    st = open_storage(moto_s3.url())
    srv = ServerProcess(st.url, env={**moto_s3.env, **_env(CKPTD_RESHARD_WORKERS="2")},
                        log=tmp_path / "server.log").start()
    try:
        files = _files(5, 4)
        total = sum(map(len, files.values()))
        assert _save(srv.url, "1", 1, files).status_code == 200
        rec = verified(srv.url, "r/1", token=ALICE)[0]
        assert rec["ok"] is True and rec["bytes_read"] == total and sorted(rec["stamps"]) == sorted(files), rec
        assert _metric(srv.url, "ckptd_reread_shares_total") == 2
        assert _metric(srv.url, "ckptd_reread_bytes_total") == total
        deadline = time.monotonic() + scaled(30)
        while st.walk("reread"):
            assert time.monotonic() < deadline, st.walk("reread")
            time.sleep(0.05)
    finally:
        srv.stop()
        moto_s3.clear(st._prefix)


@pytest.mark.slow
def test_one_share_checks_the_tiling_and_a_manifest_with_a_gap_is_recorded_known_bad(tmp_path):
    """A writer with access to the root stretches tensor ``w1`` in the stored manifest by one element (its
    chunks then cover all but the last), the marker's digest and load tree made to agree, and marks the
    checkpoint's re-read due again: every file's bytes still check, only the tiling does not. ``ckptd
    verify`` refuses it; the re-read in two shares must too (share 0 checks every tensor's tiling)."""
    root = tmp_path / "root"
    srv = ServerProcess(root, env=_env(CKPTD_RESHARD_WORKERS="2"), log=tmp_path / "server.log").start()
    try:
        files = _files(6, 2)
        assert _save(srv.url, "1", 1, _files(7, 2)).status_code == 200
        assert _save(srv.url, "2", 2, files).status_code == 200
        assert all(rec["ok"] for rec in verified(srv.url, "r/1", "r/2", token=ALICE))
        _entries_gone(root)
        srv.stop()
        (root / "runs" / "r" / "2" / "VERIFIED.json").unlink()

        def stretch(manifest: dict) -> None:
            manifest["tensors"][1]["shape"] = [N + 1]

        plant_file(root, "r", "2", "f1.bin", files["f1.bin"], stretch, load_tree=True)  # the same bytes
        v = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", "r/2", "--root", str(root)],
                           capture_output=True, text=True, timeout=scaled(120))
        assert v.returncode == 1 and f"'w1': chunks cover {N} of {N + 1}" in v.stdout + v.stderr, v.stdout + v.stderr
        mark_due(LocalStorage(root), "r", "2", "s1")
        srv.start()  # its first sweep finds the re-read due
        rec = verified(srv.url, "r/2", token=ALICE)[0]
        _entries_gone(root)
        assert rec["ok"] is False and [p for p in rec["problems"] if f"'w1': chunks cover {N} of" in p], rec
        assert _statuses(srv.url) == {"1": "verified", "2": "known bad"}
        assert _latest(srv.url) == "1"
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_replica_stopped_mid_share_releases_its_claims_and_another_takes_them_at_once(tmp_path):
    """Claims held for an hour: replica A has both shares checked, but storing their records stalls
    (``stall-reread``), and it is stopped gracefully (SIGTERM) meanwhile. B runs on the root all along and
    cannot take the shares while A holds them; once A has stopped, B's next sweep takes both and records the
    checkpoint verified, within a guard far below the hour the claims would otherwise have held for."""
    root = tmp_path / "root"
    hour = {"CKPTD_JOB_TAKEOVER_SECONDS": "3600"}
    a = ServerProcess(root, env=_env(CKPTD_RESHARD_WORKERS="2", CKPTD_FAULTS=f"stall-reread={scaled(600)}", **hour),
                      log=tmp_path / "a.log").start()
    b = None
    try:
        files = _files(8, 2)
        assert _save(a.url, "1", 1, files).status_code == 200
        entry = root / "reread" / "r" / "1" / "s1"
        deadline = time.monotonic() + scaled(30)
        while len(list(entry.glob("claim-*"))) < 2:  # both shares claimed by A, their records stalled
            assert time.monotonic() < deadline, sorted(p.name for p in entry.glob("*"))
            time.sleep(0.05)
        b = ServerProcess(root, env=_env(**hour), log=tmp_path / "b.log").start()
        assert not list(entry.glob("part-*")) and _statuses(b.url) == {"1": "pending"}
        a.stop()
        rec = verified(b.url, "r/1", token=ALICE)[0]  # the guard: scaled(60), not the hour
        assert rec["ok"] is True and rec["bytes_read"] == sum(map(len, files.values())), rec
        assert _metric(b.url, "ckptd_reread_shares_total") == 2  # both shares, checked by B
        _entries_gone(root)
    finally:
        a.stop()
        if b is not None:
            b.stop()
