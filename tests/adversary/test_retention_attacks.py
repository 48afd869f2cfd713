"""Attacks on retention: a corrupt newest checkpoint, readers slower than their lease on every read
path, junk leases, and the order gc and ``RUN/latest`` judge checkpoints by.

The promise (docs/retention.md): gc never leaves a run without its newest *verified* checkpoint,
offline, through the service and as the service's own policy, and never fails on what it finds in the
root; a reader that is still reading keeps its checkpoint however long it reads, on every path (HTTP
range reads, the client's direct reads of the service's files); checkpoints are ordered by what marker
and manifest agree on, never by something one edited file can change.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import ckptd_client._files as client_files
from ckptd_client import CheckpointClient
from support import ServerProcess, assert_bits_equal, blank_like, make_state, scaled, verified

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


def _policy_decision(srv: ServerProcess, name: str) -> dict:
    """The retention policy's decision that saw checkpoint ``name`` (the live page lists the service's
    last decisions, newest first), waited for: the policy runs in a thread after each commit."""
    deadline = time.monotonic() + scaled(60)
    while True:
        items = httpx.get(f"{srv.url}/v1/ui/runs/{RUN}/retention", timeout=10).json()["items"]
        seen = [d for d in items if d["source"] == "retention policy" and (name in d["keep"] or name in d["deleted"])]
        if seen:
            return seen[0]
        assert "retention of run ret failed" not in srv.log.read_text(), srv.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no retention decision after {name}'s commit: {items}"
        time.sleep(0.1)


def _until(t: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``t`` (a sleep only ever overshoots: a moment the test needs
    to be past, however loaded the machine)."""
    time.sleep(max(0.0, t - time.monotonic()))


def test_gc_keeps_the_newest_verified_checkpoint_when_the_newest_is_corrupt(tmp_path):
    srv = ServerProcess(tmp_path / "root").start()
    root = Path(srv.root)
    try:
        states = {s: _state(s) for s in (1, 2, 3)}
        with CheckpointClient(srv.url) as c:
            for s, sd in states.items():
                c.save(sd, f"{RUN}/{s}").wait()
        verified(srv.url, *(f"{RUN}/{s}" for s in states))
        _flip_data_byte(root, "3")
        # A dry run says which checkpoint is the newest verified one and how that was established: step 2's
        # re-read after its commit recorded its check, whose stamps still hold (step 3's no longer do: it is
        # read again).
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
            deadline = time.monotonic() + scaled(60)
            while _names(srv) != ["10"] and time.monotonic() < deadline:  # 5 goes: 10 verified
                time.sleep(0.1)
            assert _names(srv) == ["10"]
            _flip_data_byte(root, "10")
            seven = _state(7)
            c.save(seven, f"{RUN}/7").wait()
            decision = _policy_decision(srv, "7")  # the policy runs in the background after the commit
            assert decision["newest_verified"] == "7" and decision["deleted"] == [], decision
            assert _names(srv) == ["7", "10"]
            out = blank_like(seven)
            c.load(out, f"{RUN}/7")
            assert_bits_equal(out, seven)
        assert "retention of run ret failed" not in srv.log.read_text()
    finally:
        srv.stop()


def test_a_reader_slower_than_its_lease_keeps_its_checkpoint(tmp_path):
    """Leases of 5 s; a reader fetches one range a second through the service for two lease periods
    while a newer checkpoint commits and gc with ``--keep-last 1`` runs right after each read. Its
    checkpoint survives until it stops reading, and goes once a lease period has passed since its last
    read. Each round reads just before its gc, so only the gc's own time separates the lease from the
    decision; a round whose gc answered more than a lease after its read (a machine too loaded to
    tell) proves nothing and is not counted, and at least seven rounds must count."""
    lease = scaled(5.0)
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": f"{lease:g}"}).start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save(_state(1), f"{RUN}/1").wait()
            m = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/1", timeout=10).json()
            (file,) = m["files"]
            first = time.monotonic()
            i = counted = 0
            while counted < 7 or time.monotonic() - first < 2 * lease:  # reading for longer than its lease
                assert i < 60, f"only {counted} of {i} rounds had their gc answered within a lease of the read"
                c.save(_state(2 + i), f"{RUN}/{2 + i}").wait()
                r = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/1/files/{file}", headers={"Range": "bytes=0-1023"},
                              timeout=10)
                assert r.status_code == 206, f"read {i}: {r.text[:200]}"
                last = time.monotonic()  # the service wrote its lease by now
                plan = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1}, timeout=60).json()
                took = time.monotonic() - last
                if took < lease:
                    assert plan["keep"].get("1", "").startswith("leased"), \
                        f"round {i}, gc answered {took:.1f} s after the read, leases of {lease:g} s: {plan}"
                    counted += 1
                else:
                    assert "1" in plan["keep"] or "1" in plan["deleted"], plan
                    if "1" in plan["deleted"]:  # the lease lapsed while gc ran: this machine cannot tell
                        pytest.skip(f"round {i}: gc answered {took:.1f} s after the read, past a {lease:g} s lease")
                time.sleep(1.0)
                i += 1
            _until(last + lease + 0.5)  # reading stopped: a whole lease period after the last read, it lapses
            plan = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1}, timeout=60).json()
            assert "1" in plan["deleted"], plan
    finally:
        srv.stop()


# == readers that outlast their lease on every read path, junk leases, the order of checkpoints ==============


def _rows_state(seed: int, rows: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 64, generator=g)}


def _gc(srv: ServerProcess, **body) -> dict:
    r = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _cli_60s(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=60)


def test_reads_closer_together_than_the_lease_never_let_it_lapse(tmp_path):
    """Leases of 6 s (scaled). Two reads half a lease apart, then gc just past the first read's lease,
    half a lease after the second: at no moment was the checkpoint unread for a whole lease period, so
    that gc must find it leased (with half a lease to spare for a loaded machine); a lease after the
    last read, it lapses."""
    lease = scaled(6.0)
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": f"{lease:g}"}).start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save(_rows_state(1), f"{RUN}/1").wait()
            c.save(_rows_state(2), f"{RUN}/2").wait()
        (file,) = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/2", timeout=10).json()["files"]  # 1's has the same name

        def read() -> float:
            r = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/1/files/{file}", headers={"Range": "bytes=0-99"},
                          timeout=10)
            assert r.status_code == 206, r.text[:200]
            return time.monotonic()

        t0 = read()  # the first read's lease is written by then: it ends by t0 + lease
        _until(t0 + lease / 2)
        sent = time.monotonic()  # the second read's lease is written after this: it ends after sent + lease
        last = read()
        _until(t0 + lease + 0.3)  # past the first read's lease
        plan = _gc(srv)
        assert plan["keep"].get("1", "").startswith("leased") and "1" not in plan["deleted"], \
            f"gc done {time.monotonic() - sent:.1f} s after the second read was sent, leases of {lease:g} s: {plan}"
        _until(last + lease + 0.3)  # no read for longer than a lease: it lapses
        assert "1" in _gc(srv)["deleted"]
    finally:
        srv.stop()


def test_a_direct_read_load_slower_than_its_lease_keeps_its_checkpoint(tmp_path, monkeypatch):
    """The client reads the service's files itself (direct reads), so the service sees no read while
    it does. Leases of 3 s (scaled: the client renews its own every second); the direct read lasts
    until a newer checkpoint has committed and gc has run, more than a lease after the read plan. The
    load finishes (its objects are fetched over HTTP afterwards) with the checkpoint's values."""
    lease = scaled(3.0)
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": f"{lease:g}"}).start()
    reading, release = threading.Event(), threading.Event()
    orig = client_files.LocalFiles.read

    def slow(self, *a, **kw):
        reading.set()
        release.wait(scaled(120))  # reading until gc has run
        return orig(self, *a, **kw)

    monkeypatch.setattr(client_files.LocalFiles, "read", slow)
    try:
        want = make_state(1, mib=0.05)
        with CheckpointClient(srv.url) as c:
            c.save(want, f"{RUN}/1").wait()
            out, result = blank_like(want), {}

            def load() -> None:
                try:
                    result["report"] = c.load(out, f"{RUN}/1")
                except Exception as e:  # noqa: BLE001 - reported below
                    result["error"] = e

            t = threading.Thread(target=load)
            t.start()
            try:
                assert reading.wait(scaled(60))
                time.sleep(lease + 0.5)  # longer than a lease since the read plan
                c.save(make_state(2, mib=0.05), f"{RUN}/2").wait()
                plan = _gc(srv)
            finally:
                release.set()
                t.join(scaled(60))
            assert not t.is_alive(), "the load never finished"
        assert "error" not in result, result.get("error")
        assert result["report"].bytes_read_direct > 0  # the bytes did come from the files
        assert plan["keep"].get("1", "").startswith("leased"), plan
        assert_bits_equal(out, want)
    finally:
        srv.stop()


def test_an_http_range_streamed_for_longer_than_the_lease_keeps_its_checkpoint(tmp_path):
    """One GET of a 24 MiB file, consumed slowly (a MiB every half second, scaled as the lease is, so the
    stream outlasts one and a half leases at any scale) with leases of 3 s (scaled);
    once the stream has lasted one and a half leases, a newer checkpoint commits and gc runs while the
    reader goes on reading: every byte arrives, and gc finds the checkpoint leased."""
    lease = scaled(3.0)
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": f"{lease:g}"}).start()
    try:
        big = _rows_state(1, rows=(24 << 20) // 256)
        with CheckpointClient(srv.url) as c:
            c.save(big, f"{RUN}/1").wait()
            m = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/1", timeout=10).json()
            (file,) = m["files"]
            size = m["files"][file]["size"]
            got = 0
            plans: list[dict] = []

            def newer_and_gc() -> None:
                c.save(_rows_state(2), f"{RUN}/2").wait()
                plans.append(_gc(srv))

            collector: threading.Thread | None = None
            with httpx.stream("GET", f"{srv.url}/v1/checkpoints/{RUN}/1/files/{file}", timeout=scaled(30)) as r:
                assert r.status_code == 200
                t0 = time.monotonic()
                for piece in r.iter_bytes(1 << 20):
                    got += len(piece)
                    if collector is None and time.monotonic() - t0 > 1.5 * lease:  # the stream's first lease is over
                        collector = threading.Thread(target=newer_and_gc)
                        collector.start()
                    if collector is None or collector.is_alive():
                        time.sleep(scaled(0.5))  # a slow reader, still reading while gc runs; then it drains
            assert collector is not None, "the stream ended before gc ran"
            collector.join(scaled(120))
        assert got == size
        assert plans and plans[0]["keep"].get("1", "").startswith("leased"), plans
    finally:
        srv.stop()


def test_a_tool_reading_through_the_service_keeps_its_checkpoint_between_ranges(tmp_path):
    """A tool (``ckptd verify``/``export --server``) reads a range, pauses longer than the lease, reads
    the next: ``CatalogClient.lease`` keeps the checkpoint it resolved from ``latest`` meanwhile, even
    after a newer one commits, and gives it up when the block ends."""
    from ckptd_client import CatalogClient

    lease = scaled(3.0)  # renewed by the tool every second
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": f"{lease:g}"}).start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save(_rows_state(1), f"{RUN}/1").wait()
            c.save(_rows_state(2), f"{RUN}/2").wait()
            with CatalogClient(srv.url) as cat:
                m = cat.manifest(f"{RUN}/2")
                (file,) = m.files
                with cat.lease(f"{RUN}/latest") as held:
                    assert held == f"{RUN}/2"
                    first = cat.read_range(held, file, 0, 64)
                    c.save(_rows_state(3), f"{RUN}/3").wait()  # latest moves on; the lease stays on 2
                    time.sleep(1.5 * lease)  # no read for one and a half leases
                    plan = _gc(srv)
                    assert plan["keep"].get("2", "").startswith("leased") and "2" not in plan["deleted"], plan
                    assert "1" in plan["deleted"], plan
                    assert cat.read_range(held, file, 0, 64) == first
                    last = time.monotonic()
                _until(last + lease + 0.5)  # any lease of the last read has lapsed; the tool's went with the block
                assert "2" in _gc(srv)["deleted"]
        assert _names(srv) == ["3"]
    finally:
        srv.stop()


@pytest.mark.parametrize("junk", ["list", "string-expiry", "directory", "garbage"])
def test_a_junk_lease_breaks_no_gc(tmp_path, junk):
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": "0"}).start()
    root = Path(srv.root)
    try:
        with CheckpointClient(srv.url) as c:
            for s in (1, 2, 3):
                c.save(_rows_state(s), f"{RUN}/{s}").wait()
        lease = root / "leases" / RUN / "1" / "evil.json"
        lease.parent.mkdir(parents=True)
        if junk == "list":
            lease.write_text("[1, 2]")
        elif junk == "string-expiry":
            lease.write_text(json.dumps({"holder": "x", "expires_at": "tomorrow"}))
        elif junk == "directory":
            lease.mkdir()
        else:
            lease.write_bytes(b"\xff\x00not json")
        dry = _cli_60s("gc", RUN, "--keep-last", "1", "--dry-run", "--json", "--root", str(root))
        assert dry.returncode == 0 and "Traceback" not in dry.stderr, dry.stdout + dry.stderr
        assert json.loads(dry.stdout)["delete"] == ["1", "2"]
        assert _gc(srv)["deleted"] == ["1", "2"] and _names(srv) == ["3"]
    finally:
        srv.stop()


def test_latest_and_gc_order_same_step_checkpoints_by_what_the_manifest_binds(tmp_path):
    """Two trainer checkpoints of step 5 under different names. Editing only the older one's marker
    (``committed_at`` moved into the future) must not make it ``RUN/latest``: a marker field that the
    manifest does not bind is not evidence of order."""
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": "0"}).start()
    root = Path(srv.root)
    try:
        first, second = _rows_state(1), _rows_state(2)
        with CheckpointClient(srv.url) as c:
            c.save(first, f"{RUN}/first", step=5).wait()
            time.sleep(0.05)
            c.save(second, f"{RUN}/second", step=5).wait()
        latest = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/latest", timeout=10)
        assert latest.headers["x-ckptd-name"] == "second"
        marker = root / "runs" / RUN / "first" / "COMMITTED"
        m = json.loads(marker.read_bytes())
        m["committed_at"] = "2999-01-01T00:00:00Z"
        marker.write_text(json.dumps(m))
        latest = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/latest", timeout=10)
        assert latest.status_code == 200 and latest.headers["x-ckptd-name"] == "second", latest.headers
        with CheckpointClient(srv.url) as c:
            out = blank_like(second)
            c.load(out, f"{RUN}/latest")
            assert_bits_equal(out, second)
        assert _gc(srv, dry_run=True)["keep"]["second"] == "newest committed checkpoint"
    finally:
        srv.stop()
