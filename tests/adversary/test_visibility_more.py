"""More attacks on the visibility rule: odd objects where a marker or manifest should be, and junk
beside the runs, while the service runs and its stale-session sweep goes on.

The promise (docs/guarantees.md §4): one checkpoint that fails the rule is invisible, logged once,
counted, and never breaks ``GET /v1/runs``, ``GET /v1/runs/RUN/checkpoints``, ``RUN/latest``,
``ckptd ls``, gc or the sweep for the rest of the root; an invisible checkpoint's data is kept.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from ckptd_client import CheckpointClient
from support import ServerProcess, assert_bits_equal, blank_like

RUN = "vis"
STALE = "a" * 32


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=g)}


def _ckpt(root: Path, run: str, name: str) -> Path:
    return root / "runs" / run / name


def _marker(root: Path, run: str, name: str) -> Path:
    return _ckpt(root, run, name) / "COMMITTED"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=30)


def _metric_total(srv: ServerProcess) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ckptd_invisible_checkpoints_total{"))


def _plant_stale_session(root: Path) -> Path:
    stale = root / "runs" / RUN / "7" / "sessions" / STALE
    stale.mkdir(parents=True)
    (stale / "SESSION.json").write_text(json.dumps({"session": STALE, "world_size": 1, "step": 7,
                                                    "created_at": "2020-01-01T00:00:00Z"}))
    return stale


@pytest.fixture
def served(tmp_path):
    """Run ``vis`` at steps 1, 2, 3 and run ``other`` at step 1; the sweep runs every 0.2 s."""
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_RECLAIM_INTERVAL": "0.2",
                                                 "CKPTD_STALE_SESSION_TTL": "2",
                                                 "CKPTD_READ_LEASE_SECONDS": "0"}).start()
    states = {s: _state(s) for s in (1, 2, 3)}
    with CheckpointClient(srv.url) as c:
        for s, sd in states.items():
            c.save(sd, f"{RUN}/{s}").wait()
        c.save(_state(9), "other/1").wait()
    for name in ("1", "2", "3"):  # the service has read and cached every one
        assert httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/{name}", timeout=10).status_code == 200
    srv.saved_at = time.monotonic()  # every session above was created before this
    yield srv, Path(srv.root), states
    srv.stop()


def _assert_rest_of_root_intact(srv: ServerProcess, root: Path, states: dict, stale: Path) -> None:
    runs = httpx.get(f"{srv.url}/v1/runs", timeout=10)
    assert runs.status_code == 200, runs.text
    by_run = {r["run"]: r for r in runs.json()}
    assert by_run[RUN]["latest"] == "2" and by_run["other"]["latest"] == "1", by_run
    r = httpx.get(f"{srv.url}/v1/runs/{RUN}/checkpoints", timeout=10)
    assert r.status_code == 200 and [c["name"] for c in r.json()] == ["1", "2"], r.text
    assert [c["name"] for c in httpx.get(f"{srv.url}/v1/runs/other/checkpoints", timeout=10).json()] == ["1"]
    latest = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/latest", timeout=10)
    assert latest.status_code == 200 and latest.headers["x-ckptd-name"] == "2", latest.text[:300]
    gone = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/3", timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "checkpoint_not_found", gone.text
    with CheckpointClient(srv.url) as c:
        out = blank_like(states[2])
        c.load(out, f"{RUN}/latest")
        assert_bits_equal(out, states[2])
    ls = _cli("ls", RUN, "--root", str(root), "--json")
    assert ls.returncode == 0 and [c["name"] for c in json.loads(ls.stdout)] == ["1", "2"], ls.stdout + ls.stderr
    plan = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1, "dry_run": True}, timeout=60)
    assert plan.status_code == 200, plan.text
    p = plan.json()
    assert p["newest_verified"] == "2" and p["delete"] == ["1"] and "3" not in p["keep"], p
    deadline = time.monotonic() + 8
    while stale.exists() and time.monotonic() < deadline:  # the sweep runs past the bad entry
        time.sleep(0.1)
    assert not stale.exists(), "the stale-session sweep stopped at the bad entry"
    assert srv.proc is not None and srv.proc.poll() is None
    log = srv.log.read_text()
    assert "Traceback" not in log and "sweep failed" not in log, log[-3000:]


def _session_dir(root: Path, name: str) -> Path:
    (sdir,) = (_ckpt(root, RUN, name) / "sessions").iterdir()
    return sdir


@pytest.mark.parametrize("attack", [
    "marker-is-a-directory", "marker-is-a-fifo", "marker-symlink-loop", "marker-huge-sparse",
    "marker-symlink-to-another-runs-marker", "marker-names-another-runs-session", "marker-digest-is-a-path",
    "marker-names-a-missing-session",
    "manifest-is-a-directory", "manifest-is-a-fifo", "session-dir-missing",
])
def test_an_odd_object_in_place_of_the_newest_marker_or_manifest_breaks_nothing_else(served, attack):
    srv, root, states = served
    stale = _plant_stale_session(root)
    marker = _marker(root, RUN, "3")
    m = json.loads(marker.read_bytes())
    sdir = _session_dir(root, "3")
    manifest = sdir / m["manifest"]
    keep_data = True
    if attack == "marker-is-a-directory":
        marker.unlink()
        marker.mkdir()
    elif attack == "marker-is-a-fifo":  # opening it for reading would wait for a writer forever
        marker.unlink()
        os.mkfifo(marker)
    elif attack == "marker-symlink-loop":  # reading it fails with ELOOP, as an unreadable file does
        marker.unlink()
        marker.symlink_to(marker.name)
    elif attack == "marker-huge-sparse":
        with open(marker, "r+b") as f:
            f.truncate(256 << 20)
    elif attack == "marker-symlink-to-another-runs-marker":
        marker.unlink()
        marker.symlink_to(_marker(root, "other", "1"))
    elif attack == "marker-names-another-runs-session":
        other = json.loads(_marker(root, "other", "1").read_bytes())
        m.update(session=f"../../../other/1/sessions/{other['session']}", manifest=other["manifest"],
                 manifest_xxh3=other["manifest_xxh3"])
        marker.write_text(json.dumps(m))
    elif attack == "marker-digest-is-a-path":
        m.update(manifest_xxh3="../../../../other", manifest="manifest-../../../../other.json")
        marker.write_text(json.dumps(m))
    elif attack == "marker-names-a-missing-session":  # the committed session then looks unclaimed
        m["session"] = "b" * 32
        marker.write_text(json.dumps(m))
    elif attack == "manifest-is-a-directory":
        manifest.unlink()
        manifest.mkdir()
    elif attack == "manifest-is-a-fifo":
        manifest.unlink()
        os.mkfifo(manifest)
    elif attack == "session-dir-missing":
        shutil.rmtree(sdir)
        keep_data = False
    _assert_rest_of_root_intact(srv, root, states, stale)
    assert _metric_total(srv) >= 1
    time.sleep(max(0.0, srv.saved_at + 2.8 - time.monotonic()))  # 3's session is past the TTL; sweeps ran
    if keep_data:  # the sweep leaves an invisible checkpoint's data for whoever looks into it
        assert sdir.is_dir() and any((sdir / "files").iterdir()), f"{sdir} was deleted"
    # The name stays taken: a save under it is refused, never mixed into what is there.
    with CheckpointClient(srv.url) as c, pytest.raises(Exception):
        c.save(_state(3), f"{RUN}/3").wait()


def test_junk_beside_the_runs_breaks_no_listing_gc_or_sweep(served):
    srv, root, states = served
    stale = _plant_stale_session(root)
    runs = root / "runs"
    (runs / "afile").write_bytes(b"a run directory that is a file")
    os.mkdir(os.path.join(os.fsencode(runs), b"bad\xffrun"))  # names that are not UTF-8
    os.mkdir(os.path.join(os.fsencode(runs / RUN), b"bad\xfename"))
    os.mkdir(os.path.join(os.fsencode(_ckpt(root, RUN, "2") / "sessions"), b"bad\xfdsid"))
    (_ckpt(root, RUN, "2") / "sessions" / "stray-file").write_bytes(b"x")
    (runs / RUN / "stray-file").write_bytes(b"x")
    (runs / RUN / "4").mkdir()  # a checkpoint directory with nothing in it
    shutil.copytree(_ckpt(root, RUN, "3"), runs / RUN / "no-such-step")  # a whole copy under another name
    (runs / "other" / "2").mkdir()
    (runs / "other" / "2" / "COMMITTED").write_bytes(b"")
    # and the newest checkpoint of vis made invisible by an empty marker
    _marker(root, RUN, "3").write_bytes(b"")
    _assert_rest_of_root_intact(srv, root, states, stale)
    assert (runs / RUN / "no-such-step" / "COMMITTED").exists()
    listing = _cli("ls", "--root", str(root), "--json")
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stdout + listing.stderr
    gc = _cli("gc", RUN, "--keep-last", "1", "--root", str(root), "--json")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert json.loads(gc.stdout)["deleted"] == ["1"]
    assert [c["name"] for c in httpx.get(f"{srv.url}/v1/runs/{RUN}/checkpoints", timeout=10).json()] == ["2"]
