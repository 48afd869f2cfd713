"""Attacks on the visibility rule: the storage root edited while the service runs.

The promise (docs/guarantees.md §4): a checkpoint is visible if and only if its ``COMMITTED`` marker
parses and names the digest of a manifest that parses and agrees with it on ref and step; one that
fails is invisible, logged once, counted, and never breaks another checkpoint or run (``GET /v1/runs``,
``GET /v1/runs/RUN/checkpoints``, ``RUN/latest``, ``ckptd ls``, gc or the stale-session sweep for the
rest of the root); an invisible checkpoint's data is kept; ``RUN/latest`` falls back to the newest
visible one; every manifest served matches its marker's digest when it is served.

Each attack edits files under a real ``ckptd serve`` root, then asks through every public reader:
``GET /v1/runs``, ``GET /v1/runs/RUN/checkpoints``, ``RUN/latest``, the manifest, ``client.load``,
``ckptd ls``, ``ckptd verify`` (root and server) and ``ckptd gc``. Further attacks put odd objects
where a marker or manifest should be, and junk beside the runs, while the service runs and its
stale-session sweep goes on.
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
import xxhash

from ckptd_client import CheckpointClient
from ckptd_schemas import CheckpointNotFound
from support import ServerProcess, assert_bits_equal, blank_like, scaled, verified

RUN = "vis"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g)}


def _ckpt(root: Path, run: str, name: str) -> Path:
    return root / "runs" / run / name


def _marker(root: Path, run: str, name: str) -> Path:
    return _ckpt(root, run, name) / "COMMITTED"


def _manifest(root: Path, run: str, name: str) -> Path:
    m = json.loads(_marker(root, run, name).read_bytes())
    return _ckpt(root, run, name) / "sessions" / m["session"] / m["manifest"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def three_steps(tmp_path):
    """A service with run ``vis`` at steps 1, 2, 3 and a second run ``other`` at step 1."""
    srv = ServerProcess(tmp_path / "root").start()
    states = {s: _state(s) for s in (1, 2, 3)}
    with CheckpointClient(srv.url) as c:
        for s, sd in states.items():
            c.save(sd, f"{RUN}/{s}").wait()
        c.save(_state(9), "other/1").wait()
    yield srv, Path(srv.root), states
    srv.stop()


def _visible(srv: ServerProcess, run: str = RUN) -> list[str]:
    r = httpx.get(f"{srv.url}/v1/runs/{run}/checkpoints", timeout=10)
    assert r.status_code == 200, r.text
    return [c["name"] for c in r.json()]


def _latest(srv: ServerProcess, run: str = RUN) -> str:
    r = httpx.get(f"{srv.url}/v1/checkpoints/{run}/latest", timeout=10)
    assert r.status_code == 200, r.text
    return r.headers["x-ckptd-name"]


def _assert_invisible_and_the_rest_intact(srv: ServerProcess, root: Path, states: dict, gone: str) -> None:
    assert gone not in _visible(srv)
    r = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/{gone}", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "checkpoint_not_found", r.text
    runs = httpx.get(f"{srv.url}/v1/runs", timeout=10)
    assert runs.status_code == 200 and {x["run"] for x in runs.json()} == {RUN, "other"}, runs.text
    assert _visible(srv, "other") == ["1"]
    newest = max(int(n) for n in _visible(srv))
    assert _latest(srv) == str(newest)  # falls back to the newest visible checkpoint
    with CheckpointClient(srv.url) as c:
        out = blank_like(states[newest])
        c.load(out, f"{RUN}/latest")
        assert_bits_equal(out, states[newest])
        with pytest.raises(CheckpointNotFound):
            c.load(blank_like(states[int(gone)]), f"{RUN}/{gone}")
    ls = _cli("ls", RUN, "--root", str(root), "--json")
    assert ls.returncode == 0 and gone not in {c["name"] for c in json.loads(ls.stdout)}, ls.stdout + ls.stderr
    for target in (["--root", str(root)], ["--server", srv.url]):
        v = _cli("verify", f"{RUN}/{gone}", *target)
        assert v.returncode == 1 and "Traceback" not in v.stderr, v.stdout + v.stderr
    assert srv.proc is not None and srv.proc.poll() is None
    assert httpx.get(f"{srv.url}/healthz", timeout=5).status_code == 200


def _metric(srv: ServerProcess, reason: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'ckptd_invisible_checkpoints_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _rewrite_json(path: Path, **changes) -> None:
    data = json.loads(path.read_bytes())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("attack", [
    "marker-step-raised", "marker-step-lowered", "marker-empty", "marker-garbage", "marker-wrong-fields",
    "marker-of-another-checkpoint", "manifest-byte-flipped", "manifest-rewritten-valid", "manifest-deleted",
    "manifest-emptied", "marker-names-other-manifest-file",
])
def test_a_tampered_newest_checkpoint_is_invisible_and_nothing_else_breaks(three_steps, attack):
    srv, root, states = three_steps
    assert _latest(srv) == "3"
    httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/3", timeout=10)  # the service has read (and cached) it
    marker, manifest = _marker(root, RUN, "3"), _manifest(root, RUN, "3")
    if attack == "marker-step-raised":
        _rewrite_json(marker, step=10**9)  # would make it outlive every other checkpoint in gc
    elif attack == "marker-step-lowered":
        _rewrite_json(marker, step=0)
    elif attack == "marker-empty":
        marker.write_bytes(b"")
    elif attack == "marker-garbage":
        marker.write_bytes(b"\x00{not json")
    elif attack == "marker-wrong-fields":
        marker.write_text(json.dumps({"hello": "world"}))
    elif attack == "marker-of-another-checkpoint":
        marker.write_bytes(_marker(root, RUN, "2").read_bytes())
    elif attack == "manifest-byte-flipped":
        raw = bytearray(manifest.read_bytes())
        i = raw.index(b'"shape"') + 3
        raw[i] ^= 0x01
        manifest.write_bytes(bytes(raw))
    elif attack == "manifest-rewritten-valid":  # parses, but no longer hashes to the marker's digest
        _rewrite_json(manifest, step=2)
    elif attack == "manifest-deleted":
        manifest.unlink()
    elif attack == "manifest-emptied":
        manifest.write_bytes(b"")
    elif attack == "marker-names-other-manifest-file":
        other = _manifest(root, RUN, "2")
        m = json.loads(marker.read_bytes())
        sdir = manifest.parent
        (sdir / other.name).write_bytes(other.read_bytes())
        m["manifest"], m["manifest_xxh3"] = other.name, xxhash.xxh3_64_hexdigest(other.read_bytes())
        marker.write_text(json.dumps(m))
    _assert_invisible_and_the_rest_intact(srv, root, states, "3")
    assert sum(_metric(srv, r) for r in ("marker_malformed", "manifest_missing", "manifest_digest",
                                          "manifest_malformed", "disagrees")) >= 1
    # The name stays taken (a marker is there): a new save under it is refused, not mixed in.
    with CheckpointClient(srv.url) as c, pytest.raises(Exception) as e:
        c.save(_state(3), f"{RUN}/3").wait()
    assert getattr(e.value, "status", None) == 409 or "409" in str(e.value) or "commit" in str(e.value).lower()
    # gc through the service and offline: the run keeps a good checkpoint, the tampered one is not counted.
    plan = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1, "dry_run": True}, timeout=60).json()
    assert "3" not in plan["keep"] and "3" not in plan["delete"] and plan["newest_verified"] == "2", plan
    gc = _cli("gc", RUN, "--keep-last", "1", "--root", str(root), "--json")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert json.loads(gc.stdout)["deleted"] == ["1"] and _visible(srv) == ["2"]
    assert _marker(root, RUN, "3").exists()  # an invisible checkpoint is left for whoever looks into it


def test_one_malformed_marker_breaks_no_listing_and_no_sweep(tmp_path):
    # a TTL longer than a save takes on a loaded machine: the planted session is years old anyway
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_RECLAIM_INTERVAL": "0.2",
                                                 "CKPTD_STALE_SESSION_TTL": f"{scaled(30):g}"}).start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save(_state(1), f"{RUN}/1").wait()
            c.save(_state(2), f"{RUN}/2").wait()
        verified(srv.url, f"{RUN}/1", f"{RUN}/2")  # the re-reads after the commits are done: the log is ours
        root = Path(srv.root)
        _marker(root, RUN, "2").write_bytes(b"")
        (root / "runs" / "NOT A RUN").mkdir()  # junk beside the runs: not a valid run name
        (root / "runs" / RUN / "junk file").write_bytes(b"x")
        stale = root / "runs" / RUN / "7" / "sessions" / ("a" * 32)
        stale.mkdir(parents=True)
        (stale / "SESSION.json").write_text(json.dumps({"session": "a" * 32, "world_size": 1, "step": 7,
                                                        "created_at": "2020-01-01T00:00:00Z"}))
        deadline = time.monotonic() + scaled(30)
        while stale.exists() and time.monotonic() < deadline:  # the sweep runs past the bad marker and reclaims it
            time.sleep(0.1)
        assert not stale.exists()
        assert _marker(root, RUN, "2").exists() and (_ckpt(root, RUN, "2") / "sessions").exists()
        assert _visible(srv) == ["1"] and _latest(srv) == "1"
        assert [r["run"] for r in httpx.get(f"{srv.url}/v1/runs", timeout=10).json()] == [RUN]
        ls = _cli("ls", "--root", str(root), "--json")
        assert ls.returncode == 0, ls.stderr
        log = srv.log.read_text()
        assert "Traceback" not in log and log.count("vis/2 is invisible") == 1, log[-3000:]
    finally:
        srv.stop()


def test_a_manifest_changed_after_the_service_cached_it_is_never_served(three_steps):
    """The service read (and cached) the manifest; then it is replaced on storage by one that parses
    and names other data. No reader gets the new one: it does not hash to the marker's digest."""
    srv, root, states = three_steps
    with CheckpointClient(srv.url) as c:
        c.load(blank_like(states[3]), f"{RUN}/3")  # cached by the service now
    manifest = _manifest(root, RUN, "3")
    other = json.loads(_manifest(root, RUN, "2").read_bytes())
    mine = json.loads(manifest.read_bytes())
    mine["tensors"], mine["files"] = other["tensors"], other["files"]
    for f in other["files"]:  # point at step 2's values: a load would silently restore them
        src = next((_ckpt(root, RUN, "2") / "sessions").glob(f"*/files/{f}"))
        (manifest.parent / "files" / f).write_bytes(src.read_bytes())
    manifest.write_text(json.dumps(mine))
    r = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/3", timeout=10)
    assert r.status_code == 404, r.text[:300]
    with CheckpointClient(srv.url) as c:
        with pytest.raises(CheckpointNotFound):
            c.load(blank_like(states[3]), f"{RUN}/3")
    v = _cli("verify", f"{RUN}/3", "--server", srv.url)
    assert v.returncode == 1, v.stdout + v.stderr


def test_every_served_manifest_carries_and_matches_its_digest(three_steps):
    srv, root, _ = three_steps
    for name in ("1", "2", "3", "latest"):
        r = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/{name}", timeout=10)
        concrete = r.headers["x-ckptd-name"]
        assert xxhash.xxh3_64_hexdigest(r.content) == r.headers["x-ckptd-manifest-xxh3"]
        assert json.loads(_marker(root, RUN, concrete).read_bytes())["manifest_xxh3"] == \
            r.headers["x-ckptd-manifest-xxh3"]


# == odd objects where a marker or manifest should be, junk beside the runs ==================================

STALE = "a" * 32
#: The stale-session TTL of the ``served`` service: longer than a small save takes on a loaded machine
#: (a save still open past it is reclaimed), short enough that a test can wait it out.
STALE_TTL = scaled(3.0)


def _small_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=g)}


def _cli_30s(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=30)


def _metric_total(srv: ServerProcess) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ckptd_invisible_checkpoints_total{"))


def _plant_stale_session(root: Path, step: int = 7) -> Path:
    stale = root / "runs" / RUN / str(step) / "sessions" / STALE
    stale.mkdir(parents=True)
    (stale / "SESSION.json").write_text(json.dumps({"session": STALE, "world_size": 1, "step": step,
                                                    "created_at": "2020-01-01T00:00:00Z"}))
    return stale


@pytest.fixture
def served(tmp_path):
    """Run ``vis`` at steps 1, 2, 3 and run ``other`` at step 1; the sweep runs every 0.2 s."""
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_RECLAIM_INTERVAL": "0.2",
                                                 "CKPTD_STALE_SESSION_TTL": f"{STALE_TTL:g}",
                                                 "CKPTD_READ_LEASE_SECONDS": "0"}).start()
    states = {s: _small_state(s) for s in (1, 2, 3)}
    with CheckpointClient(srv.url) as c:
        for s, sd in states.items():
            c.save(sd, f"{RUN}/{s}").wait()
        c.save(_small_state(9), "other/1").wait()
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
    ls = _cli_30s("ls", RUN, "--root", str(root), "--json")
    assert ls.returncode == 0 and [c["name"] for c in json.loads(ls.stdout)] == ["1", "2"], ls.stdout + ls.stderr
    plan = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1, "dry_run": True}, timeout=60)
    assert plan.status_code == 200, plan.text
    p = plan.json()
    assert p["newest_verified"] == "2" and p["delete"] == ["1"] and "3" not in p["keep"], p
    deadline = time.monotonic() + scaled(30)
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
    record = sdir / "SESSION.json"
    if record.is_file():  # 3's session past the stale-session TTL now, as if the test waited it out
        record.write_text(json.dumps({**json.loads(record.read_text()), "created_at": "2020-01-01T00:00:00Z"}))
    _assert_rest_of_root_intact(srv, root, states, stale)
    assert _metric_total(srv) >= 1
    later = _plant_stale_session(root, step=8)  # gone once a whole sweep ran after the TTL was past
    deadline = time.monotonic() + scaled(30)
    while later.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not later.exists(), "no sweep ran"
    if keep_data:  # the sweep leaves an invisible checkpoint's data for whoever looks into it
        assert sdir.is_dir() and any((sdir / "files").iterdir()), f"{sdir} was deleted"
    # The name stays taken: a save under it is refused, never mixed into what is there.
    with CheckpointClient(srv.url) as c, pytest.raises(Exception):
        c.save(_small_state(3), f"{RUN}/3").wait()


def test_a_fifo_swapped_in_after_the_look_at_the_marker_blocks_no_reader(three_steps):
    """Another user of the host who can write in the root swaps the newest ``COMMITTED`` marker for a
    FIFO and back, over and over, while readers ask the service for that checkpoint: a reader that looked
    at a regular file and then opened the path would find the FIFO and wait for a writer forever. Every
    request is answered (200 while the marker is there, 404 while the FIFO is), and once the swapping
    stops the checkpoint loads. (Before, readers hung on the FIFO and their requests never returned.)"""
    import threading

    srv, root, states = three_steps
    marker = _marker(root, RUN, "3")
    good = marker.read_bytes()
    reg, fifo = marker.with_name(".swap-reg"), marker.with_name(".swap-fifo")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            reg.write_bytes(good)
            os.replace(reg, marker)
            os.mkfifo(fifo)
            os.replace(fifo, marker)
        reg.write_bytes(good)
        os.replace(reg, marker)

    answers: list[int] = []
    hung: list[BaseException] = []

    def read() -> None:
        with httpx.Client(timeout=scaled(20)) as c:  # the deadline only guards against a hang
            for _ in range(150):
                try:
                    answers.append(c.get(f"{srv.url}/v1/checkpoints/{RUN}/3").status_code)
                except httpx.TimeoutException as e:
                    hung.append(e)
                    return

    swapper = threading.Thread(target=swap, daemon=True)
    readers = [threading.Thread(target=read, daemon=True) for _ in range(4)]
    swapper.start()
    for t in readers:
        t.start()
    for t in readers:
        t.join(scaled(300))
    stop.set()
    swapper.join(scaled(30))
    assert not hung and not any(t.is_alive() for t in readers), f"{len(hung)} readers hung on the FIFO"
    assert set(answers) <= {200, 404} and len(answers) == 600, sorted(set(answers))
    with CheckpointClient(srv.url) as c:
        out = blank_like(states[3])
        c.load(out, f"{RUN}/3")
        assert_bits_equal(out, states[3])


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
    listing = _cli_30s("ls", "--root", str(root), "--json")
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stdout + listing.stderr
    gc = _cli_30s("gc", RUN, "--keep-last", "1", "--root", str(root), "--json")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert json.loads(gc.stdout)["deleted"] == ["1"]
    assert [c["name"] for c in httpx.get(f"{srv.url}/v1/runs/{RUN}/checkpoints", timeout=10).json()] == ["2"]


def test_no_checkpoint_can_be_named_latest_in_any_case(three_steps):
    """A writer with a valid token cannot create a checkpoint that shadows ``RUN/latest``: a session
    opened under ``latest``, ``LATEST`` or ``Latest`` is refused (400, naming the rule), by the service
    and by the client before any byte is sent; ``RUN/latest`` still names the newest step."""
    import torch

    from ckptd_client import CheckpointClient
    from ckptd_schemas import InvalidName

    srv = three_steps[0]
    for name in ("latest", "LATEST", "Latest"):
        r = httpx.post(f"{srv.url}/v1/checkpoints/{RUN}/{name}/sessions",
                       json={"session": "s1", "world_size": 1, "step": 9}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_name", (name, r.text)
        assert "names the newest checkpoint of a run" in r.json()["error"]["message"]
        with CheckpointClient(srv.url) as c, pytest.raises(InvalidName, match="names the newest checkpoint"):
            c.save({"w": torch.zeros(4)}, f"{RUN}/{name}")
    assert _latest(srv) == "3" and _visible(srv) == ["1", "2", "3"]


def test_a_fifo_in_place_of_a_data_file_or_a_manifest_blocks_no_reader(three_steps):
    """Another user of the host who can write in the root puts FIFOs where a checkpoint's data file and
    another's manifest were. Every reader answers instead of waiting for a writer that never comes: the
    loading rank (which opens the service's files itself on this host, then asks the service), the
    service's own reads, ``ckptd verify`` on both targets, the listings; the damaged checkpoints fail
    with typed errors, and the one left intact still loads. (Before, each of them blocked in ``open``.)"""
    import threading

    from ckptd_schemas import CkptdError

    srv, root, states = three_steps
    data = next((_ckpt(root, RUN, "3") / "sessions").glob("*/files/*.bin"))
    manifest = _manifest(root, RUN, "2")
    for victim in (data, manifest):
        os.replace(victim, victim.with_name(victim.name + ".kept"))
        os.mkfifo(victim)

    outcomes: dict[str, object] = {}

    def load(name: str) -> None:
        try:
            with CheckpointClient(srv.url) as c:
                c.load(blank_like(states[int(name)]), f"{RUN}/{name}")
            outcomes[name] = "loaded"
        except CkptdError as e:
            outcomes[name] = e
        except Exception as e:  # noqa: BLE001 - reported below: a load must fail typed
            outcomes[name] = f"untyped {type(e).__name__}: {e}"

    loads = [threading.Thread(target=load, args=(n,), daemon=True) for n in ("3", "2")]
    for t in loads:
        t.start()
    for t in loads:
        t.join(scaled(120))
    assert not any(t.is_alive() for t in loads), f"a load hung on a FIFO: {outcomes}"
    assert isinstance(outcomes["3"], CkptdError) and isinstance(outcomes["2"], CkptdError), outcomes
    for target in (["--root", str(root)], ["--server", srv.url]):
        for name in ("3", "2"):
            v = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", f"{RUN}/{name}", *target],
                               capture_output=True, text=True, timeout=scaled(120))
            assert v.returncode in (1, 2) and "Traceback" not in v.stderr, v.stdout + v.stderr
    for path in (f"/v1/runs/{RUN}/checkpoints", "/v1/runs", f"/v1/checkpoints/{RUN}/2", f"/v1/checkpoints/{RUN}/3"):
        assert httpx.get(f"{srv.url}{path}", timeout=scaled(30)).status_code < 500, path
    with CheckpointClient(srv.url) as c:
        out = blank_like(states[1])
        c.load(out, f"{RUN}/1")
        assert_bits_equal(out, states[1])
    assert httpx.get(f"{srv.url}/healthz", timeout=5).status_code == 200
