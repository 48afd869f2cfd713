"""The fast tier and the durable tier (``ckptd serve --root FAST --durable DURABLE``).

What must hold, each through a real ``ckptd serve``:

* a save commits on the fast tier; ``wait(durable=True)`` returns once the durable tier holds it,
  and the durable tier alone is a complete root: a service on it loads the checkpoint bit for bit;
* losing the fast tier (its directory emptied while the service is down) loses no checkpoint that
  was reported durable: every one lists, loads and keeps its name taken; a fast tier that loses its
  ``runs/`` while it runs never lets a save take a name the durable tier holds, and deletes reach the
  durable tier only for the same checkpoint (session and manifest digest);
* every byte reaches the durable tier through the one checker, an incremental save's linked files
  included, even where their source on the durable tier was damaged;
* a crash of the service between the commit and the durable marker leaves the durable copy
  invisible; the restarted service finishes it (its first scan);
* a fast copy whose bytes no longer match its manifest never becomes durable: the copy is refused,
  ``wait(durable=True)`` raises the typed error, the durable tier shows nothing under that name;
* a durable tier that already holds another checkpoint under the name keeps it and refuses ours;
* retention per tier: the fast tier keeps the newest N of each run and drops older copies only once
  durable (they load from the durable tier); the run's policy deletes from both tiers;
* the lag between tiers is in the metrics; an ``s3://`` durable tier (moto) works the same.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ckptd.storage import LocalStorage, open_storage
from ckptd.store.tiers import TieredStorage
from ckptd.store.durable import DurableCopier
from ckptd.store.paths import Paths
from ckptd.store.visibility import Visibility
from ckptd_client import AlreadyCommitted, CheckpointClient, Conflict, CorruptCheckpoint
from ckptd_client.session_calls import wait_committed
from ckptd_client.transport import Transport
from ckptd_schemas import SessionStatus
from support import ServerProcess, assert_bits_equal, blank_like, scaled

MiB = 1 << 20


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(128, 256, generator=g) for i in range(4)}, "step": torch.tensor(seed)}


def _server(tmp_path, durable: str, *, env: dict | None = None, name: str = "server") -> ServerProcess:
    return ServerProcess(tmp_path / "fast", env={"CKPTD_DURABLE": durable, **(env or {})},
                         log=tmp_path / f"{name}.log")


def _markers(root) -> set[str]:
    """``run/name`` of every COMMITTED marker under a local root."""
    return {f"{p.parent.parent.name}/{p.parent.name}" for p in (root / "runs").glob("*/*/COMMITTED")}


def _on_fast(tmp_path) -> set[str]:
    """``run/name`` of every checkpoint whose data the fast tier holds."""
    return {f"{p.parent.name}/{p.name}" for p in (tmp_path / "fast" / "runs").glob("*/*") if (p / "sessions").is_dir()}


def _metric(srv: ServerProcess, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"metric {name} {labels} not exported")


def _load(url: str, ref: str, like: dict) -> dict:
    got = blank_like(like)
    with CheckpointClient(url) as c:
        c.load(got, ref)
    return got


def _durable_alone_holds(tmp_path, durable, ref: str, want: dict, *, load: str | None = None) -> None:
    """The durable tier as a plain root: a service on it loads ``load`` (default ``ref``) bit for bit, and
    ``ckptd verify REF --root DURABLE`` passes."""
    alone = ServerProcess(durable, log=tmp_path / "alone.log").start()
    try:
        assert_bits_equal(_load(alone.url, load or ref, want), want)
    finally:
        alone.stop()
    out = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", ref, "--root", str(durable)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(f"OK {ref}"), out.stdout + out.stderr


def test_a_save_commits_locally_then_becomes_durable_and_the_durable_tier_is_a_whole_root(tmp_path):
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable)).start()
    try:
        sd = _state(1)
        with CheckpointClient(srv.url, incremental=False) as c:
            st = c.save(sd, "t/1").wait(durable=True)
        assert st.state == "committed" and st.durable is True and st.durable_error is None
        assert _markers(durable) == {"t/1"}
        assert _metric(srv, "ckptd_durable_copies_total", outcome="copied") == 1
        assert _metric(srv, "ckptd_durable_bytes_total") > 4 * 128 * 256 * 4
        assert _metric(srv, "ckptd_durable_pending") == 0
        assert _metric(srv, "ckptd_durable_lag_seconds") == 0
    finally:
        srv.stop()
    _durable_alone_holds(tmp_path, durable, "t/1", sd, load="t/latest")


def test_an_incremental_save_reaches_the_durable_tier_hashed_even_where_its_source_there_is_damaged(tmp_path):
    """Step 2 links step 1's unchanged files on the fast tier. Step 1's copy on the durable tier is then
    damaged (a byte flipped there); step 2's durable copy reads every byte from the fast tier through
    the one checker, so it never takes the damaged durable bytes, and the durable tier alone verifies
    and loads step 2."""
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable)).start()
    try:
        one = _state(1)
        two = {"model": dict(one["model"]), "step": torch.tensor(2)}
        two["model"]["w0"] = one["model"]["w0"] + 1  # one tensor of four changed
        with CheckpointClient(srv.url, file_bytes=128 << 10) as c:  # a file per tensor
            c.save(one, "t/1").wait(durable=True)
            for f in sorted((durable / "runs" / "t" / "1" / "sessions").glob("*/files/*")):
                raw = bytearray(f.read_bytes())
                raw[len(raw) // 2] ^= 0xFF
                f.write_bytes(bytes(raw))
            first = _metric(srv, "ckptd_durable_bytes_total")
            st = c.save(two, "t/2").wait(durable=True)
            assert st.durable is True
            assert c.manifest("t/2").linked_bytes >= 3 * 128 * 256 * 4  # the unchanged tensors' files, linked
        assert _metric(srv, "ckptd_durable_bytes_total") - first >= 4 * 128 * 256 * 4  # every byte hashed and sent
    finally:
        srv.stop()
    _durable_alone_holds(tmp_path, durable, "t/2", two)


def test_a_name_the_durable_tier_holds_is_taken_although_the_fast_tier_lost_it(tmp_path):
    """The fast tier's ``runs/`` is deleted under the running service (before the copier takes the
    durable markers back). A save under a name the durable tier holds is refused; the durable
    checkpoint is untouched, and a save under a new name commits."""
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable), env={"CKPTD_DURABLE_SCAN_SECONDS": "3600"}).start()
    try:
        one = _state(1)
        with CheckpointClient(srv.url, incremental=False, retry_seconds=2) as c:
            c.save(one, "t/1").wait(durable=True)
            before = (durable / "runs" / "t" / "1" / "COMMITTED").read_bytes()
            shutil.rmtree(tmp_path / "fast" / "runs")
            with pytest.raises((AlreadyCommitted, Conflict)):
                c.save(_state(9), "t/1").wait(timeout=scaled(60))
            assert (durable / "runs" / "t" / "1" / "COMMITTED").read_bytes() == before
            assert not (tmp_path / "fast" / "runs" / "t" / "1" / "COMMITTED").exists()
            c.save(_state(2), "t/2").wait(durable=True, timeout=scaled(60))
    finally:
        srv.stop()
    _durable_alone_holds(tmp_path, durable, "t/1", one)


def _marker(tier: LocalStorage, ref: str, session: str, digest: str) -> None:
    from datetime import datetime, timezone

    from ckptd.store.paths import Marker
    from ckptd.store.visibility import manifest_file_name

    run, name = ref.split("/")
    marker = Marker(ref=ref, session=session, manifest=manifest_file_name(digest), manifest_xxh3=digest, step=None,
                    derived_from=None, committed_at=datetime.now(timezone.utc))
    tier.put(Paths.marker(run, name), marker.model_dump_json().encode())
    tier.put(f"{Paths.session(run, name, session)}/files/x.bin", b"data")


def test_deletes_reach_the_durable_tier_only_for_the_same_checkpoint(tmp_path):
    """A delete of ``t/5`` (retention, ``rm``) removes the durable copy only where the durable marker
    names the fast one's session and manifest; another checkpoint under the name stays, whole."""
    fast, durable = LocalStorage(tmp_path / "fast"), LocalStorage(tmp_path / "durable")
    tiers = TieredStorage(fast, durable)
    _marker(fast, "t/5", "s-new", "b" * 16)
    _marker(durable, "t/5", "s-old", "a" * 16)
    _marker(fast, "t/6", "s-six", "c" * 16)
    _marker(durable, "t/6", "s-six", "c" * 16)
    tiers.delete_tree(Paths.ckpt("t", "5"))
    assert fast.read_or_none(Paths.marker("t", "5")) is None
    assert json.loads(durable.read(Paths.marker("t", "5")))["session"] == "s-old"
    assert durable.read(f"{Paths.session('t', '5', 's-old')}/files/x.bin") == b"data"
    tiers.delete(Paths.marker("t", "6"))
    assert durable.read_or_none(Paths.marker("t", "6")) is None  # the same checkpoint: gone from both
    tiers.delete_tree(Paths.run("t"))  # a whole run: checkpoint by checkpoint
    assert json.loads(durable.read(Paths.marker("t", "5")))["session"] == "s-old"


def test_losing_the_fast_tier_loses_no_durable_checkpoint(tmp_path):
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable)).start()
    states = {step: _state(step) for step in (1, 2, 3)}
    with CheckpointClient(srv.url, incremental=False) as c:
        for step, sd in states.items():
            c.save(sd, f"t/{step}").wait(durable=True)
    srv.kill()
    shutil.rmtree(tmp_path / "fast")  # the node's NVMe is gone: a new, empty one in its place
    srv.start()
    try:
        names = [x["name"] for x in httpx.get(f"{srv.url}/v1/runs/t/checkpoints", timeout=10).json()]
        assert names == ["1", "2", "3"]
        for step, sd in states.items():
            assert_bits_equal(_load(srv.url, f"t/{step}", sd), sd, f"step {step}")
        with CheckpointClient(srv.url, incremental=False) as c:
            with pytest.raises(AlreadyCommitted):
                c.save(_state(9), "t/2").wait()  # its name stays taken
            st = c.save(_state(4), "t/4").wait(durable=True)  # and saving goes on
        assert st.durable and _markers(durable) == {"t/1", "t/2", "t/3", "t/4"}
        assert_bits_equal(_load(srv.url, "t/latest", _state(4)), _state(4))
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_crash_before_the_durable_marker_is_finished_by_the_restarted_service(tmp_path):
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable), env={"CKPTD_FAULTS": "crash-at=durable-before-marker"}).start()
    sd = _state(2)
    c = CheckpointClient(srv.url, incremental=False, retry_seconds=2)
    handle = c.save(sd, "t/1")
    with pytest.raises(Exception):
        handle.wait(durable=True, timeout=scaled(30))  # the service dies on its way to the durable marker
    assert srv.wait_exit(timeout=scaled(30)) != 0
    c.close()
    assert _markers(tmp_path / "fast") == {"t/1"}  # committed locally ...
    assert _markers(durable) == set()  # ... and nothing visible on the durable tier
    assert (durable / "runs" / "t" / "1").is_dir()  # although its files were copied
    srv.start(env={"CKPTD_FAULTS": ""})
    try:
        st = httpx.get(f"{srv.url}/v1/checkpoints/t/1/sessions/{handle.session}",
                       params={"wait": 30, "durable": "true"}, timeout=60).json()
        assert st["state"] == "committed" and st["durable"] is True, st
        assert _markers(durable) == {"t/1"}
    finally:
        srv.stop()
    _durable_alone_holds(tmp_path, durable, "t/1", sd)


@pytest.mark.slow
def test_a_damaged_fast_copy_never_becomes_durable(tmp_path):
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable), env={"CKPTD_FAULTS": "crash-at=durable-before-marker"}).start()
    c = CheckpointClient(srv.url, incremental=False, retry_seconds=2)
    handle = c.save(_state(3), "t/1")
    with pytest.raises(Exception):
        handle.wait(durable=True, timeout=scaled(30))
    srv.wait_exit(timeout=scaled(30))
    c.close()
    data = sorted((tmp_path / "fast" / "runs" / "t" / "1" / "sessions").glob("*/files/*"))[0]
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # one byte flipped on the fast tier after the commit checked it
    data.write_bytes(bytes(raw))
    srv.start(env={"CKPTD_FAULTS": ""})
    try:
        st = httpx.get(f"{srv.url}/v1/checkpoints/t/1/sessions/{handle.session}",
                       params={"wait": 30, "durable": "true"}, timeout=60).json()
        assert st["state"] == "committed" and st["durable"] is False, st
        assert st["durable_error"]["code"] == "corrupt_checkpoint" and data.name in st["durable_error"]["message"]
        transport = Transport(srv.url)  # the client's wait raises the typed error
        try:
            with pytest.raises(CorruptCheckpoint, match=data.name):
                wait_committed(transport, "/v1/checkpoints/t/1", "t/1", SessionStatus.model_validate(st), None,
                               durable=True)
        finally:
            transport.close()
        assert _markers(durable) == set()
        assert _metric(srv, "ckptd_durable_copies_total", outcome="refused") == 1
        assert _metric(srv, "ckptd_durable_pending") == 0  # refused: not waiting any more
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_name_the_durable_tier_holds_otherwise_is_not_overwritten(tmp_path):
    """Two fast tiers behind one durable tier (a misconfiguration): the second ``t/1`` stays local."""
    durable = tmp_path / "durable"
    first = ServerProcess(tmp_path / "fast-a", env={"CKPTD_DURABLE": str(durable)}, log=tmp_path / "a.log").start()
    try:
        with CheckpointClient(first.url, incremental=False) as c:
            c.save(_state(1), "t/1").wait(durable=True)
    finally:
        first.stop()
    before = (durable / "runs" / "t" / "1" / "COMMITTED").read_bytes()
    # A fast tier that does not see the durable one's t/1 when it commits its own.
    tiers = TieredStorage(LocalStorage(tmp_path / "fast-b"), LocalStorage(tmp_path / "elsewhere"))
    second = ServerProcess(tmp_path / "fast-b", env={"CKPTD_DURABLE": str(tmp_path / "elsewhere")},
                           log=tmp_path / "b.log").start()
    try:
        with CheckpointClient(second.url, incremental=False) as c:
            c.save(_state(2), "t/1").wait(durable=True)
    finally:
        second.stop()
    shutil.rmtree(tmp_path / "elsewhere")
    copier = DurableCopier(TieredStorage(tiers.fast, LocalStorage(durable)))
    assert copier.scan() == []
    c1 = Visibility(tiers.fast).check("t", "1")
    st = copier.state("t", "1", c1.digest)
    assert not st.durable and st.error["code"] == "conflict", st
    assert (durable / "runs" / "t" / "1" / "COMMITTED").read_bytes() == before


def test_the_fast_tier_keeps_the_newest_and_older_ones_load_from_the_durable_tier(tmp_path):
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable), env={"CKPTD_FAST_KEEP_LAST": "2"}).start()
    try:
        states = {step: _state(step) for step in (1, 2, 3, 4)}
        with CheckpointClient(srv.url, incremental=False) as c:
            for step, sd in states.items():
                c.save(sd, f"t/{step}").wait(durable=True)
        deadline = time.monotonic() + scaled(30)
        while _on_fast(tmp_path) != {"t/3", "t/4"} and time.monotonic() < deadline:
            time.sleep(0.1)  # trimmed by the scan that follows each copy
        assert _on_fast(tmp_path) == {"t/3", "t/4"}
        assert _markers(tmp_path / "fast") == _markers(durable) == {"t/1", "t/2", "t/3", "t/4"}  # names stay taken
        for step, sd in states.items():
            assert_bits_equal(_load(srv.url, f"t/{step}", sd), sd, f"step {step}")
    finally:
        srv.stop()
    both = f"tiered:{tmp_path / 'fast'}|{durable}"  # the offline commands see the two tiers as the service does
    out = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", "t/1", "--root", both],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OK t/1"), out.stdout + out.stderr


@pytest.mark.slow
def test_a_reshard_job_reads_a_dropped_fast_copy_and_its_output_becomes_durable(tmp_path):
    """A worker process reopens both tiers (``tiered:FAST|DURABLE``): it reads a source whose data only
    the durable tier holds, and its commit, made outside the service's process, is found by the scan."""
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable), env={"CKPTD_FAST_KEEP_LAST": "1", "CKPTD_DURABLE_SCAN_SECONDS": "0.3"})
    srv.start()
    try:
        sd = _state(6)
        with CheckpointClient(srv.url, incremental=False) as c:
            c.save(sd, "t/1").wait(durable=True)
            c.save(_state(7), "t/2").wait(durable=True)
        deadline = time.monotonic() + scaled(30)
        while "t/1" in _on_fast(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "t/1" not in _on_fast(tmp_path)
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            job = http.post("/v1/reshard", json={"source": "t/1", "to": "full", "out": "t-full/1"}).json()
            while job["state"] not in ("done", "failed") and time.monotonic() < deadline + scaled(60):
                time.sleep(0.2)
                job = http.get(f"/v1/jobs/{job['id']}").json()
        assert job["state"] == "done", job.get("error")
        while "t-full/1" not in _markers(durable) and time.monotonic() < deadline + scaled(90):
            time.sleep(0.1)
        assert "t-full/1" in _markers(durable)
        assert_bits_equal(_load(srv.url, "t-full/1", sd), sd)
    finally:
        srv.stop()


def test_a_fast_copy_being_read_is_not_dropped_until_its_reader_lets_go(tmp_path):
    """A slow reader holds a read lease (as a load that reads for long does): the fast tier keeps that
    checkpoint's data past ``CKPTD_FAST_KEEP_LAST`` until the lease is released, then drops it."""
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable), env={"CKPTD_FAST_KEEP_LAST": "1", "CKPTD_DURABLE_SCAN_SECONDS": "0.2"})
    srv.start()
    try:
        with CheckpointClient(srv.url, incremental=False) as c, httpx.Client(base_url=srv.url, timeout=30) as http:
            c.save(_state(1), "t/1").wait(durable=True)
            assert http.put("/v1/checkpoints/t/1/leases/slowreader").status_code == 200
            for step in (2, 3):
                c.save(_state(step), f"t/{step}").wait(durable=True)
            deadline = time.monotonic() + scaled(30)
            while "t/2" in _on_fast(tmp_path) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # several more scans
            assert _on_fast(tmp_path) == {"t/1", "t/3"}  # t/2 dropped, the leased t/1 kept
            assert http.delete("/v1/checkpoints/t/1/leases/slowreader").status_code in (200, 204)
            while "t/1" in _on_fast(tmp_path) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _on_fast(tmp_path) == {"t/3"}
    finally:
        srv.stop()


def test_a_fast_copy_that_is_not_durable_is_never_trimmed(tmp_path):
    """The durable tier unreachable: every checkpoint stays on the fast tier, and the lag shows it."""
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable), env={"CKPTD_FAST_KEEP_LAST": "1", "CKPTD_DURABLE_SCAN_SECONDS": "0.2"})
    srv.start()
    durable.rmdir()
    durable.write_text("a file where the durable tier's directory was: every write there fails")
    try:
        with CheckpointClient(srv.url, incremental=False) as c:
            for step in (1, 2, 3):
                st = c.save(_state(step), f"t/{step}").wait()
                assert st.state == "committed"
            time.sleep(1.0)
            assert _on_fast(tmp_path) == {"t/1", "t/2", "t/3"}
            got = httpx.get(f"{srv.url}/v1/checkpoints/t/3/sessions/{st.session}", params={"durable": "true"},
                            timeout=10).json()
            assert got["state"] == "committed" and got["durable"] is False and got["durable_error"] is None
        assert _metric(srv, "ckptd_durable_pending") == 3
        assert _metric(srv, "ckptd_durable_lag_seconds") >= 1.0
    finally:
        srv.stop()


def test_markers_the_fast_tier_loses_while_it_runs_come_back(tmp_path):
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable), env={"CKPTD_DURABLE_SCAN_SECONDS": "0.1"}).start()
    try:
        states = {step: _state(step) for step in (1, 2)}
        with CheckpointClient(srv.url, incremental=False) as c:
            for step, sd in states.items():
                c.save(sd, f"t/{step}").wait(durable=True)
        shutil.rmtree(tmp_path / "fast" / "runs")  # someone empties the fast tier under the running service
        deadline = time.monotonic() + scaled(30)
        while _markers(tmp_path / "fast") != {"t/1", "t/2"} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _markers(tmp_path / "fast") == {"t/1", "t/2"}
        for step, sd in states.items():
            assert_bits_equal(_load(srv.url, f"t/{step}", sd), sd, f"step {step}")
    finally:
        srv.stop()


def test_a_new_fast_tier_does_not_start_without_the_durable_tier_s_names(tmp_path):
    """An empty fast tier must first learn every name the durable tier holds: with the durable tier
    unreachable, the service refuses to start rather than let a save reuse a committed name."""
    durable = tmp_path / "durable"
    durable.write_text("not a directory")
    srv = _server(tmp_path, str(durable / "root"))
    with pytest.raises(RuntimeError, match="exited with 2"):  # a root that cannot be made: one line, exit 2
        srv.start()
    assert "Traceback" not in srv.log.read_text()


@pytest.mark.slow
def test_the_retention_policy_deletes_from_both_tiers(tmp_path):
    durable = tmp_path / "durable"
    srv = _server(tmp_path, str(durable), env={"CKPTD_RETENTION_KEEP_LAST": "2", "CKPTD_FAST_KEEP_LAST": "5"})
    srv.start()
    try:
        with CheckpointClient(srv.url, incremental=False) as c:
            for step in (1, 2, 3, 4):
                c.save(_state(step), f"t/{step}").wait(durable=True)
        gone = durable / "runs" / "t" / "1" / "sessions"

        def done() -> bool:  # markers go first, then the trees: wait for both
            return (_markers(durable), _markers(tmp_path / "fast")) == ({"t/3", "t/4"},) * 2 and not gone.exists()

        deadline = time.monotonic() + scaled(30)
        while not done() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _markers(durable) == _markers(tmp_path / "fast") == {"t/3", "t/4"}
        assert not gone.exists(), sorted(str(p.relative_to(durable)) for p in gone.rglob("*"))
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_fast_tier_that_adopted_starts_and_saves_while_the_s3_durable_tier_is_down(tmp_path, moto_s3, s3_env):
    from s3_server import aws_env
    from support import free_port

    url = moto_s3.url("tiers-down")
    srv = _server(tmp_path, url, env=aws_env(moto_s3.endpoint)).start()
    try:
        with CheckpointClient(srv.url, incremental=False) as c:
            assert c.save(_state(1), "t/1").wait(durable=True).durable
        srv.stop()
        down = {**aws_env(f"http://127.0.0.1:{free_port()}"), "AWS_MAX_ATTEMPTS": "1"}  # nothing listens there
        srv.start(env=down)
        with CheckpointClient(srv.url, incremental=False) as c:
            st = c.save(_state(2), "t/2").wait()
            assert st.state == "committed"
            with pytest.raises(AlreadyCommitted):
                c.save(_state(3), "t/1").wait()
        got = httpx.get(f"{srv.url}/v1/checkpoints/t/2/sessions/{st.session}", params={"durable": "true"},
                        timeout=30).json()
        assert got["durable"] is False, got
        assert_bits_equal(_load(srv.url, "t/2", _state(2)), _state(2))
        srv.stop()
        srv.start(env=aws_env(moto_s3.endpoint))  # back: the pending checkpoint becomes durable
        got = httpx.get(f"{srv.url}/v1/checkpoints/t/2/sessions/{st.session}",
                        params={"durable": "true", "wait": 30}, timeout=60).json()
        assert got["durable"] is True, got
    finally:
        srv.stop()
        moto_s3.clear("tiers-down")


@pytest.mark.slow
def test_an_s3_durable_tier(tmp_path, moto_s3, s3_env):
    from s3_server import aws_env

    url = moto_s3.url("tiers-durable")
    srv = _server(tmp_path, url, env=aws_env(moto_s3.endpoint)).start()
    try:
        sd = _state(5)
        with CheckpointClient(srv.url, incremental=False) as c:
            assert c.save(sd, "s/1").wait(durable=True).durable
        store = open_storage(url)
        assert Visibility(store).check("s", "1") is not None
        manifest = Visibility(store).manifest(Visibility(store).check("s", "1"))
        for f, entry in manifest.files.items():
            assert store.size(Paths.file("s", "1", manifest.session, f)) == entry.size
        json.loads(store.read(Paths.marker("s", "1")))
    finally:
        srv.stop()
        moto_s3.clear("tiers-durable")


class _Hooked(LocalStorage):
    """A local tier that runs ``hook`` once, just before the first read of a data file (``on="read"``),
    the first write of a manifest (``on="manifest"``) or the first look at ``t/2``'s marker
    (``on="listed"``: the scan has judged every checkpoint, and copies none yet) it serves."""

    def __init__(self, root, on: str) -> None:
        super().__init__(root, durable=False)
        self.on, self.hook = on, None

    def _fire(self) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()

    def read_into(self, key: str, start: int, view: memoryview, **kw) -> int:
        if self.on == "read" and "/files/" in key:
            self._fire()
        return super().read_into(key, start, view, **kw)

    def local_path(self, key: str):
        if self.on == "listed" and key == Paths.marker("t", "2"):
            self._fire()
        return super().local_path(key)

    def open_write(self, key: str, *, once: bool = False):
        if self.on == "manifest" and "/manifest-" in key:
            self._fire()
        return super().open_write(key, once=once)


@pytest.mark.parametrize("when", ["after the scan listed it", "while its files are read", "before its durable marker"])
def test_a_checkpoint_deleted_while_it_is_copied_leaves_nothing_on_either_tier(tmp_path, when):
    """Retention (or ``rm``) deletes a checkpoint while the durable copier copies it: the copy stops, takes
    back what it wrote to the durable tier (no marker names it there: it would stay invisible for good)
    and records nothing on the fast tier (no "not durable" record for a name that is gone). Another
    checkpoint copied the same way becomes durable. Deleted after the scan listed it and before its copy
    began (retention runs on the same commit that wakes the copier), it is not copied at all, though the
    copier still holds its manifest from an earlier look. In every case the durable tier shows nothing
    under its name, not even an empty directory."""
    import xxhash
    from ckptd.store.sessions import SessionStore
    from ckptd_schemas import OpenSession, RankIndex

    fast = _Hooked(tmp_path / "fast", "read" if when.startswith("while") else "-")
    durable = _Hooked(tmp_path / "durable", {"before": "manifest", "after": "listed"}.get(when.split()[0], "-"))
    tiers = TieredStorage(fast, durable)
    store = SessionStore(tiers)
    for name in ("1", "2"):
        store.open("t", name, OpenSession(session=f"s{name}", world_size=1, step=int(name)))
        data = f"checkpoint {name}".encode() * 1000
        sink = store.intake.receive("t", name, f"s{name}", "f.bin")
        sink.write(data)
        sink.finish(xxhash.xxh3_64_hexdigest(data))
        assert store.put_index("t", name, f"s{name}", RankIndex(rank=0, world_size=1, files=["f.bin"])).state == "committed"
    (fast if when.startswith("while") else durable).hook = lambda: (
        tiers.delete(Paths.marker("t", "1")), tiers.delete_tree(Paths.ckpt("t", "1")))  # what retention does
    copier = DurableCopier(tiers)
    copier.fast_vis.manifest(copier.fast_vis.check("t", "1"))  # held from an earlier look
    assert [(d.run, d.name) for d in copier.scan()] == [("t", "2")]
    assert fast.hook is None and durable.hook is None  # the deletion happened, at the point named
    left = tmp_path / "durable" / "runs" / "t" / "1"
    assert not left.exists(), sorted(str(p.relative_to(left)) for p in left.rglob("*"))  # not even a directory
    assert not (tmp_path / "fast" / "runs" / "t" / "1").exists()
    assert _markers(tmp_path / "durable") == {"t/2"}
    assert copier.scan() == []  # nothing left to retry either
