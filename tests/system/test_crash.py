"""Crash safety of the commit protocol (docs/design.md §2 items 4 and 6), over a real ``ckptd serve``.

Every test commits a good checkpoint first and ends by checking that it still
loads bit for bit and that ``ckptd verify`` (its own process) passes on it.
Crashes are real: the server SIGKILLs itself at a named point of the protocol
(``CKPTD_FAULTS=crash-at=POINT``, tests/fault_server.py), the test SIGKILLs it at a random
moment, or a trainer rank dies with ``os._exit``. Nothing of ckptd is mocked.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import xxhash

from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader, SessionStore
from fault_server import CRASH_POINTS
from ckptd.store.checker import verify_manifest
from ckptd_client import CheckpointClient, CheckpointNotFound, FlatShard, Unavailable
from support import ServerProcess, assert_bits_equal, blank_like, make_state, run_ranks, scaled, verified

RUN = "run"
# Gather 64 KiB per storage write (default 8 MiB) so a file of a few MiB crosses
# "upload-mid-stream" after its first batch, with most of the file still to come.
SMALL_BATCH = {"CKPTD_WRITE_BATCH_BYTES": str(64 << 10)}


# -- helpers -------------------------------------------------------------------------------------------

def assert_loads(client: CheckpointClient, ref: str, want: dict) -> None:
    got = blank_like(want)
    report = client.load(got, ref)
    assert sorted(report.tensors) == sorted(f"model.{k}" for k in want["model"])
    assert_bits_equal(got, want)


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_verifies(root: Path, ref: str) -> None:
    p = cli("verify", ref, "--root", str(root))
    assert p.returncode == 0, f"ckptd verify {ref} exited {p.returncode}:\n{p.stdout}{p.stderr}"
    assert p.stdout.startswith(f"OK {ref}"), p.stdout


def ls_names(root: Path, run: str = RUN) -> list[str]:
    """``ckptd ls RUN --root ROOT --json`` in its own process: the committed names."""
    p = cli("ls", run, "--root", str(root), "--json")
    assert p.returncode == 0, p.stderr
    return [row["name"] for row in json.loads(p.stdout)]


def ckpt_dir(root: Path, name: str, run: str = RUN) -> Path:
    return root / "runs" / run / name


def marker_bytes(root: Path, name: str) -> bytes | None:
    path = ckpt_dir(root, name) / "COMMITTED"
    return path.read_bytes() if path.exists() else None


def sessions_of(root: Path, name: str) -> list[str]:
    d = ckpt_dir(root, name) / "sessions"
    return sorted(os.listdir(d)) if d.exists() else []


class VisibilityWatcher:
    """Polls the storage root from this process while the test crashes the server.

    The invariant (docs/design.md §2): whatever ``list_checkpoints`` shows at any moment
    is committed and complete: its marker names a manifest with that digest and
    every byte verifies. Each newly visible checkpoint is verified in full once.
    """

    def __init__(self, root: Path, run: str = RUN, period: float = 0.01) -> None:
        self.reader = CheckpointReader(LocalStorage(root, durable=False))
        self.run, self.period = run, period
        self.seen: dict[str, set[str]] = {}   # name -> marker digests seen
        self.problems: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._verified: set[tuple[str, str]] = set()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "VisibilityWatcher":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.poll()  # one last look after everything settled

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.period)

    def poll(self) -> None:
        self.polls += 1
        try:
            listed = self.reader.checkpoints_page(self.run)[0]
        except Exception as e:  # noqa: BLE001 - recorded, the test fails on it
            self.problems.append(f"list_checkpoints raised {type(e).__name__}: {e}")
            return
        for s in listed:
            self.seen.setdefault(s.name, set()).add(s.manifest_xxh3)
            key = (s.name, s.manifest_xxh3)
            if key in self._verified:
                continue
            try:
                m = self.reader.manifest(self.run, s.name)
                report = verify_manifest(m, _ReaderSource(self.reader, m).read)
            except Exception as e:  # noqa: BLE001
                self.problems.append(f"{self.run}/{s.name} listed but unreadable: {type(e).__name__}: {e}")
                continue
            if not report.ok:
                self.problems.append(f"{self.run}/{s.name} listed but does not verify: {report.problems[:3]}")
            self._verified.add(key)


class _ReaderSource:
    def __init__(self, reader: CheckpointReader, manifest) -> None:
        self.reader, self.m = reader, manifest

    def read(self, file: str, start: int, end: int) -> bytes:
        return self.reader.read_range(self.m.run, self.m.name, file, start, end)


def commit_first(client: CheckpointClient) -> dict:
    sd1 = make_state(1)
    assert client.save(sd1, f"{RUN}/1").wait(timeout=60).state == "committed"
    return sd1


SD1 = make_state(1)  # the good checkpoint RUN/1 that every test starts from


# The fixtures good_root and srv (a server over a root holding RUN/1 = SD1) are in tests/system/conftest.py.


@pytest.fixture
def fresh_srv(tmp_path):
    """A server (not started) over an empty root."""
    s = ServerProcess(tmp_path / "root", env=SMALL_BATCH)
    yield s
    s.kill()


# -- the server dies at each named point of the protocol ------------------------------------------------

@pytest.mark.parametrize("point", CRASH_POINTS)
def test_server_killed_at_crash_point_then_restarted(srv, tmp_path, point):
    root, sd1 = Path(srv.root), SD1
    client = CheckpointClient(srv.url, retry_seconds=60, streams=2, file_bytes=1 << 20)
    try:
        srv.start(env={"CKPTD_FAULTS": f"crash-at={point}"})
        sd2 = make_state(2, mib=2.5)  # a 2.5 MiB data file: dozens of 64 KiB write batches
        with VisibilityWatcher(root) as watch:
            handle = client.save(sd2, f"{RUN}/2")
            rc = srv.wait_exit(timeout=scaled(60))
            assert rc == -signal.SIGKILL, f"server exited with {rc}, expected to SIGKILL itself at {point}"

            # Down, mid-protocol: run/2 is visible only if its marker is complete (crash after it).
            marker_at_crash = marker_bytes(root, "2")
            if point == "commit-after-marker":
                assert marker_at_crash is not None
                assert ls_names(root) == ["1", "2"]
            else:
                assert marker_at_crash is None, f"marker exists after a crash at {point}"
                assert ls_names(root) == ["1"]
            assert sessions_of(root, "2") == [handle.session]

            srv.start()  # same root and port, no crash point: the client's retries finish the save
            status = handle.wait(timeout=90)
        assert status.state == "committed" and status.session == handle.session

        assert not watch.problems, watch.problems
        assert watch.polls > 10
        # Committed exactly once, by the one session, with one manifest digest ever visible.
        assert sessions_of(root, "2") == [handle.session]
        assert len(watch.seen["2"]) == 1 and watch.seen["2"] == {status.manifest_xxh3}
        marker = json.loads(marker_bytes(root, "2"))
        assert marker["session"] == handle.session and marker["manifest_xxh3"] == status.manifest_xxh3
        if marker_at_crash is not None:
            assert marker_bytes(root, "2") == marker_at_crash, "the COMMITTED marker was rewritten"
        manifests = [p.name for p in (ckpt_dir(root, "2") / "sessions" / handle.session).glob("manifest-*.json")]
        assert manifests == [marker["manifest"]]

        assert [c.name for c in client.list_checkpoints(RUN)] == ["1", "2"]
        assert_loads(client, f"{RUN}/2", sd2)
        assert_loads(client, f"{RUN}/1", sd1)
        assert_verifies(root, f"{RUN}/2")
        assert_verifies(root, f"{RUN}/1")
    finally:
        client.close(wait=False)


@pytest.mark.parametrize("point", ["index-written", "commit-before-marker", "commit-after-marker"])
def test_an_incremental_save_killed_mid_commit_never_points_at_missing_bytes(fresh_srv, tmp_path, point):
    """A save that links unchanged chunks from the previous checkpoint; the server dies mid-commit,
    restarts, the save finishes. Then the checkpoint it linked from is deleted: the new one still
    loads bit for bit and verifies (its links are its own files, never references to another)."""
    root, srv = Path(fresh_srv.root), fresh_srv
    srv.start()
    client = CheckpointClient(srv.url, retry_seconds=60, streams=2, file_bytes=1 << 20)
    try:
        frozen = make_state(5, mib=2)["model"]
        first = {"model": {**frozen, "adapter": torch.zeros(1000)}}
        second = {"model": {**frozen, "adapter": torch.ones(1000)}}
        client.save(first, f"{RUN}/1").wait(timeout=60)
        srv.kill()
        srv.start(env={**SMALL_BATCH, "CKPTD_FAULTS": f"crash-at={point}"})
        handle = client.save(second, f"{RUN}/2")
        assert srv.wait_exit(timeout=scaled(60)) == -signal.SIGKILL
        srv.start()
        assert handle.wait(timeout=90).state == "committed"
        m = client.manifest(f"{RUN}/2")
        assert m.linked_bytes > 0, "the unchanged chunks were written again"
        shutil.rmtree(ckpt_dir(root, "1"))
        assert_loads(client, f"{RUN}/2", second)
        assert_verifies(root, f"{RUN}/2")
    finally:
        client.close(wait=False)


def _rank_index(rank: int, full: torch.Tensor, lo: int, hi: int) -> tuple[bytes, dict]:
    """File bytes and index of a rank holding rows [lo, hi) of ``model.w``, crafted by hand."""
    data = full[lo:hi].contiguous().numpy().tobytes()
    loc = {"file": f"r{rank}.bin", "offset": 0, "length": len(data), "raw_length": len(data),
           "xxh3": xxhash.xxh3_64_hexdigest(data)}
    chunk = {"kind": "box", "rank": rank, "offsets": [lo, 0], "sizes": [hi - lo, full.shape[1]], "location": loc}
    tensor = {"name": "model.w", "shape": list(full.shape), "dtype": "float32", "group": "model", "chunks": [chunk]}
    return data, {"rank": rank, "world_size": 2, "tensors": [tensor], "files": [f"r{rank}.bin"]}


def test_index_retries_after_commit_are_answered_not_refused(srv, tmp_path):
    """Two ranks; the server dies right after creating the marker, before answering the last index.

    Retries of either rank's index (same body) must get the committed status, as before the crash;
    a different index for the committed ref is still refused.
    """
    root, sd1 = Path(srv.root), SD1
    client = CheckpointClient(srv.url, retry_seconds=10)
    try:
        srv.start(env={"CKPTD_FAULTS": "crash-at=commit-after-marker"})
        full = torch.randn(5, 3, generator=torch.Generator().manual_seed(4))
        ranks = [_rank_index(0, full, 0, 2), _rank_index(1, full, 2, 5)]
        base = f"/v1/checkpoints/{RUN}/2/sessions/two"
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            assert http.post(f"/v1/checkpoints/{RUN}/2/sessions", json={"session": "two", "world_size": 2}
                             ).status_code == 200
            for r, (data, _) in enumerate(ranks):
                assert http.put(f"{base}/files/r{r}.bin", content=data,
                                headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)}).status_code == 200
            r0 = http.put(f"{base}/ranks/0", content=json.dumps(ranks[0][1]))
            assert r0.status_code == 200 and r0.json()["state"] == "open"
            with pytest.raises(httpx.TransportError):
                http.put(f"{base}/ranks/1", content=json.dumps(ranks[1][1]))
        assert srv.wait_exit(timeout=scaled(30)) == -signal.SIGKILL
        marker = json.loads(marker_bytes(root, "2"))
        assert marker["session"] == "two"

        srv.start()
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            for rank in (1, 0, 1):
                r = http.put(f"{base}/ranks/{rank}", content=json.dumps(ranks[rank][1]))
                assert r.status_code == 200, r.text
                assert r.json()["state"] == "committed" and r.json()["manifest_xxh3"] == marker["manifest_xxh3"]
            changed = json.loads(json.dumps(ranks[0][1]))
            changed["coords"] = {"dp": 0}
            r = http.put(f"{base}/ranks/0", content=json.dumps(changed))
            assert r.status_code == 409 and r.json()["error"]["code"] == "already_committed", r.text
            assert f"{RUN}/2" in r.json()["error"]["message"]
        assert json.loads(marker_bytes(root, "2")) == marker
        got = {"model": {"w": torch.zeros(5, 3)}}
        client.load(got, f"{RUN}/2")
        assert torch.equal(got["model"]["w"], full)
        assert_verifies(root, f"{RUN}/2")
        assert_loads(client, f"{RUN}/1", sd1)
        assert_verifies(root, f"{RUN}/1")
    finally:
        client.close(wait=False)


def _staged_bytes(root: Path, name: str) -> int:
    """Bytes of data files (finished or still being written) under every session of RUN/name."""
    total = 0
    for d in (ckpt_dir(root, name) / "sessions").glob("*/files"):
        for entry in os.scandir(d):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
    return total


def test_sigkill_at_random_moment_during_large_upload(srv, tmp_path):
    seed = random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    print(f"random kill seed {seed}")
    root, sd1 = Path(srv.root), SD1
    srv.start()
    client = CheckpointClient(srv.url, retry_seconds=60, streams=2, file_bytes=2 << 20)
    try:
        sd2 = make_state(3, mib=48)
        total = sum(t.numel() * t.element_size() for t in sd2["model"].values())
        frac = rng.uniform(0.05, 0.5)
        with VisibilityWatcher(root, period=0.05) as watch:
            handle = client.save(sd2, f"{RUN}/2")
            deadline = time.monotonic() + scaled(60)
            while _staged_bytes(root, "2") < frac * total:
                assert time.monotonic() < deadline, "upload never reached the kill point"
                time.sleep(0.002)
            srv.kill()
            staged = _staged_bytes(root, "2")
            assert marker_bytes(root, "2") is None, f"upload finished before the kill (seed {seed})"
            assert ls_names(root) == ["1"]
            assert 0 < staged < total + (1 << 20)
            srv.start()
            status = handle.wait(timeout=120)
        assert status.state == "committed"
        assert not watch.problems, watch.problems
        assert watch.seen["2"] == {status.manifest_xxh3}
        assert [c.name for c in client.list_checkpoints(RUN)] == ["1", "2"]
        assert_loads(client, f"{RUN}/2", sd2)
        assert_loads(client, f"{RUN}/1", sd1)
        assert_verifies(root, f"{RUN}/2")
        assert_verifies(root, f"{RUN}/1")
    finally:
        client.close(wait=False)


# -- a trainer rank dies mid-save ---------------------------------------------------------------------------

FLAT_SHAPE = (512, 129)  # 66048 elements, split unevenly over 2 ranks


def rank_state(rank: int, world: int, seed: int) -> dict:
    """Rank ``rank``'s share of a flat-partitioned weight plus a replicated bias and a JSON object."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(FLAT_SHAPE, generator=g)
    bias = torch.randn(129, generator=g)
    flat = full.reshape(-1)
    cut = flat.numel() // 2 + 77
    lo, hi = (0, cut) if rank == 0 else (cut, flat.numel())
    return {"model": {"w": FlatShard(flat[lo:hi].clone(), FLAT_SHAPE, lo), "b": bias.clone()},
            "extra": {"seed": seed}}


def full_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(FLAT_SHAPE, generator=g), "b": torch.randn(129, generator=g)},
            "extra": {"seed": seed}}


def wait_for_a_dead_peer(handle, seconds: float) -> None:
    """``handle.wait(timeout=seconds)`` once this rank's own part of the save is in (its upload, waited
    for up to a generous bound): the seconds then only wait for a commit that the dead rank keeps from
    coming, and raise ``Unavailable``, however long a loaded machine takes over the upload."""
    concurrent.futures.wait([handle._future], timeout=scaled(120))
    handle.wait(timeout=seconds)


def dying_save_job(rank: int, world: int, url: str, ref: str, seed: int) -> dict:
    client = CheckpointClient(url, retry_seconds=3, streams=1)
    handle = client.save(rank_state(rank, world, seed), ref)
    if rank == 1:
        # Snapshot taken, upload just started in the background: die without any cleanup.
        # Exit status 0 so the launcher lets rank 0 finish instead of killing it too.
        os._exit(0)
    try:
        wait_for_a_dead_peer(handle, 3)
    except Unavailable as e:
        return {"session": handle.session, "error": type(e).__name__, "message": e.message}
    return {"session": handle.session, "error": None}


def good_save_job(rank: int, world: int, url: str, ref: str, seed: int) -> dict:
    client = CheckpointClient(url, retry_seconds=10, streams=1)
    status = client.save(rank_state(rank, world, seed), ref).wait(timeout=60)
    client.close()
    return {"state": status.state, "session": status.session}


@pytest.mark.slow
def test_rank_killed_mid_save_leaves_checkpoint_invisible(srv, tmp_path):
    root, sd1 = Path(srv.root), SD1
    srv.start()
    client = CheckpointClient(srv.url, retry_seconds=10)
    try:
        with VisibilityWatcher(root, period=0.05) as watch:
            records = run_ranks(dying_save_job, 2, srv.url, f"{RUN}/2", 5, tmp=tmp_path, check=False, timeout=60)
        assert records[1] == {"ok": False, "error": "no result"}  # rank 1 died before reporting
        r0 = records[0]
        assert r0["ok"], r0
        assert r0["result"]["error"] == "Unavailable", r0["result"]
        assert "not committed" in r0["result"]["message"] and "[0]" in r0["result"]["message"]
        dead_session = r0["result"]["session"]

        assert not watch.problems, watch.problems
        assert "2" not in watch.seen
        assert ls_names(root) == ["1"]
        assert [c.name for c in client.list_checkpoints(RUN)] == ["1"]
        with pytest.raises(CheckpointNotFound) as ei:
            client.manifest(f"{RUN}/2")
        assert "run/2" in ei.value.message
        st = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/2/sessions/{dead_session}").json()
        assert st["state"] == "open" and st["ranks_done"] == [0] and st["world_size"] == 2
        assert_loads(client, f"{RUN}/1", sd1)
        assert_verifies(root, f"{RUN}/1")

        # A new attempt (new session id from its rank 0) saves the same ref and commits.
        records = run_ranks(good_save_job, 2, srv.url, f"{RUN}/2", 6, tmp=tmp_path, timeout=90)
        new_session = records[0]["result"]["session"]
        assert [r["result"]["state"] for r in records] == ["committed", "committed"]
        assert new_session != dead_session
        assert json.loads(marker_bytes(root, "2"))["session"] == new_session
        st = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/2/sessions/{dead_session}").json()
        assert st["state"] == "failed" and new_session in st["error"]["message"]
        assert ls_names(root) == ["1", "2"]
        assert_loads(client, f"{RUN}/2", full_state(6))
        assert_loads(client, f"{RUN}/1", sd1)
        assert_verifies(root, f"{RUN}/2")
        assert_verifies(root, f"{RUN}/1")
    finally:
        client.close(wait=False)


# -- what a killed upload leaves ------------------------------------------------------------------------------

BIG_SHAPE = (6144, 2048)  # 48 MiB of float32, about 24 MiB per rank: each rank's file takes several writes


def big_rank_state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(BIG_SHAPE, generator=g).reshape(-1)
    cut = flat.numel() // 2 + 4099
    lo, hi = (0, cut) if rank == 0 else (cut, flat.numel())
    return {"model": {"w": FlatShard(flat[lo:hi].clone(), BIG_SHAPE, lo)}}


def retrying_save_job(rank: int, world: int, url: str, ref: str, seed: int) -> dict:
    """One rank's save that rides out a server killed and restarted under it (its retries)."""
    client = CheckpointClient(url, retry_seconds=scaled(120), streams=1)
    status = client.save(big_rank_state(rank, seed), ref).wait(timeout=scaled(180))
    client.close()
    return {"state": status.state, "session": status.session, "manifest_xxh3": status.manifest_xxh3}


def _temp_files(where: Path) -> dict[Path, int]:
    """The temp files of unfinished writes (``.NAME.tmp-XXXXXXXXXXXX``) under ``where``, and their sizes."""
    found = {}
    for p in where.rglob(".*.tmp-*"):
        try:
            found[p] = p.stat().st_size
        except FileNotFoundError:
            pass
    return found


def test_a_server_killed_while_two_ranks_upload_leaves_nothing_in_the_committed_checkpoint(srv, tmp_path):
    """The service is SIGKILLed while two ranks stream their files; restarted, the ranks' retries
    commit. The killed process's half-written temp files (megabytes per rank) are not left inside
    the committed checkpoint: its directory holds the files its manifest names, their records and
    the checkpoint's metadata, and nothing else (``ckptd verify`` names no stray)."""
    root = Path(srv.root)
    srv.start(env={"CKPTD_FAULTS": "throttle=16"})  # a slow store: the two uploads overlap on any machine
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ranks = pool.submit(run_ranks, retrying_save_job, 2, srv.url, f"{RUN}/2", 11, tmp=tmp_path, timeout=300)
        deadline = time.monotonic() + scaled(120)
        while True:  # both ranks' files half written: at least one 4 MiB window of each on disk
            temps = _temp_files(ckpt_dir(root, "2"))
            writing = {p.name[1:8] for p, n in temps.items() if "/files/" in str(p) and n >= 4 << 20}
            if writing == {"r000000", "r000001"}:
                break
            assert not ranks.done(), ranks.result()
            assert time.monotonic() < deadline, "the ranks never had their files half written at once"
            time.sleep(0.002)
        srv.kill()
        left = {p: n for p, n in _temp_files(ckpt_dir(root, "2")).items() if "/files/" in str(p)}
        assert marker_bytes(root, "2") is None and sum(left.values()) >= 8 << 20, left
        srv.start()  # the store at full speed again
        records = ranks.result()
    assert [r["result"]["state"] for r in records] == ["committed", "committed"], records
    verified(srv.url, f"{RUN}/2")  # the re-read after the marker writes its record beside it through a temp file
    manifest = CheckpointReader(LocalStorage(root)).manifest(RUN, "2")
    named = sum(e.size for e in manifest.files.values())
    on_disk = sum(p.stat().st_size for p in ckpt_dir(root, "2").rglob("*") if p.is_file())
    print(f"killed with {sum(left.values())} bytes in temp files; committed: {named} bytes named, {on_disk} on disk")
    assert named <= on_disk < named + (1 << 20), (named, on_disk)  # the data, and under 1 MiB of records
    assert _temp_files(ckpt_dir(root, "2")) == {}
    p = cli("verify", f"{RUN}/2", "--root", str(root))
    assert p.returncode == 0 and p.stdout.startswith(f"OK {RUN}/2") and "STRAY" not in p.stdout, p.stdout
    with CheckpointClient(srv.url, retry_seconds=10) as client:
        got = {"model": {"w": torch.empty(BIG_SHAPE)}}
        client.load(got, f"{RUN}/2")
        want = torch.randn(BIG_SHAPE, generator=torch.Generator().manual_seed(11))
        assert torch.equal(got["model"]["w"], want)


# -- stale staging, restarts --------------------------------------------------------------------------------

def _open_and_stage(url: str, name: str, sid: str, payload: bytes) -> None:
    r = httpx.post(f"{url}/v1/checkpoints/{RUN}/{name}/sessions", json={"session": sid, "world_size": 1})
    assert r.status_code == 200, r.text
    r = httpx.put(f"{url}/v1/checkpoints/{RUN}/{name}/sessions/{sid}/files/part.bin", content=payload,
                  headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(payload)})
    assert r.status_code == 200, r.text


def test_stale_staging_reclaimed_after_ttl_never_the_committed(fresh_srv, tmp_path):
    srv = fresh_srv
    root = Path(srv.root)
    srv.start()
    client = CheckpointClient(srv.url, retry_seconds=10)
    try:
        # An abandoned attempt on run/1 that predates its successful save, and one on run/2.
        _open_and_stage(srv.url, "1", "abandoned1", os.urandom(5000))
        sd1 = commit_first(client)
        committed = json.loads(marker_bytes(root, "1"))["session"]
        _open_and_stage(srv.url, "2", "abandoned2", os.urandom(7000))
        assert sessions_of(root, "1") == sorted(["abandoned1", committed])

        store = SessionStore(LocalStorage(root), dead_after=86400)  # the TTL alone (test_dead_sessions: idle)
        assert store.sweeper.reclaim_stale(3600) == []                       # younger than the TTL: kept
        assert store.sweeper.reclaim_stale(3600, now=time.time() + 1800) == []
        removed = store.sweeper.reclaim_stale(3600, now=time.time() + 7200)   # two hours later
        assert sorted(removed) == [f"{RUN}/1/abandoned1", f"{RUN}/2/abandoned2"]
        assert sessions_of(root, "1") == [committed]
        assert sessions_of(root, "2") == []
        # Even a zero TTL never touches the committed session.
        assert store.sweeper.reclaim_stale(0) == []
        assert sessions_of(root, "1") == [committed]
        r = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/2/sessions/abandoned2")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert "abandoned2" in r.json()["error"]["message"]
        assert_loads(client, f"{RUN}/1", sd1)
        assert_verifies(root, f"{RUN}/1")

        # The service's own sweep, with a short TTL, does the same while it runs.
        srv.restart(env={"CKPTD_STALE_SESSION_TTL": "1", "CKPTD_RECLAIM_INTERVAL": "0.2"})
        _open_and_stage(srv.url, "3", "abandoned3", os.urandom(3000))
        assert sessions_of(root, "3") == ["abandoned3"]
        deadline = time.monotonic() + scaled(30)
        while sessions_of(root, "3"):
            assert time.monotonic() < deadline, "the service never reclaimed the stale session"
            time.sleep(0.1)
        assert sessions_of(root, "1") == [committed]
        assert ls_names(root) == ["1"]
        assert_loads(client, f"{RUN}/1", sd1)
        assert_verifies(root, f"{RUN}/1")
    finally:
        client.close(wait=False)


def test_restarted_server_serves_everything_committed_before(srv, tmp_path):
    root = Path(srv.root)
    srv.start()
    client = CheckpointClient(srv.url, retry_seconds=10)
    states = {f"{RUN}/1": SD1, f"{RUN}/7": make_state(7), f"{RUN}/12": make_state(12),
              "other/3": make_state(33, mib=1)}
    try:
        for ref, sd in states.items():
            if ref != f"{RUN}/1":  # already there
                assert client.save(sd, ref).wait(timeout=60).state == "committed"
        _open_and_stage(srv.url, "99", "unfinished", os.urandom(1000))  # never committed
        runs_before = [r.model_dump() for r in client.list_runs()]
        ckpts_before = [c.model_dump() for c in client.list_checkpoints(RUN)]
        manifests_before = {ref: client.manifest(ref).model_dump_json() for ref in states}

        srv.kill()  # SIGKILL, no graceful shutdown
        srv.start()
        fresh = CheckpointClient(srv.url, retry_seconds=10)
        try:
            assert [r.model_dump() for r in fresh.list_runs()] == runs_before
            assert [r.latest for r in fresh.list_runs()] == ["3", "12"]
            assert [c.model_dump() for c in fresh.list_checkpoints(RUN)] == ckpts_before
            assert [c.name for c in fresh.list_checkpoints(RUN)] == ["1", "7", "12"]
            for ref, sd in states.items():
                assert fresh.manifest(ref).model_dump_json() == manifests_before[ref]
                assert_loads(fresh, ref, sd)
                assert_verifies(root, ref)
            assert_loads(fresh, f"{RUN}/latest", states[f"{RUN}/12"])
            st = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/99/sessions/unfinished").json()
            assert st["state"] == "open"
        finally:
            fresh.close()
    finally:
        client.close(wait=False)


def test_a_session_folder_without_its_record_is_removed_only_on_the_second_sweep(tmp_path):
    """A folder with no SESSION.json may be one being opened right now: one sweep of grace."""
    from ckptd.storage import LocalStorage
    from ckptd.store import SessionStore

    storage = LocalStorage(tmp_path)
    storage.put("runs/r/1/sessions/abc/files/x.bin", b"partial")
    store = SessionStore(storage)
    assert store.sweeper.reclaim_stale(0) == []
    assert storage.exists("runs/r/1/sessions/abc/files/x.bin")
    assert store.sweeper.reclaim_stale(0) == ["r/1/abc"]
    assert storage.list("runs/r/1/sessions") == []
