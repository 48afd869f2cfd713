"""Attacks on the visibility rule: the storage root edited while the service runs.

The promise (docs/guarantees.md §4): a checkpoint is visible if and only if its ``COMMITTED`` marker
parses and names the digest of a manifest that parses and agrees with it on ref and step; one that
fails is invisible, counted, and never breaks another checkpoint or run; ``RUN/latest`` falls back
to the newest visible one; every manifest served matches its marker's digest when it is served.

Each attack edits files under a real ``ckptd serve`` root, then asks through every public reader:
``GET /v1/runs``, ``GET /v1/runs/RUN/checkpoints``, ``RUN/latest``, the manifest, ``client.load``,
``ckptd ls``, ``ckptd verify`` (root and server) and ``ckptd gc``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import xxhash

from ckptd_client import CheckpointClient
from ckptd_schemas import CheckpointNotFound
from support import ServerProcess, assert_bits_equal, blank_like

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
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_RECLAIM_INTERVAL": "0.2",
                                                 "CKPTD_STALE_SESSION_TTL": "0.5"}).start()
    try:
        with CheckpointClient(srv.url) as c:
            c.save(_state(1), f"{RUN}/1").wait()
            c.save(_state(2), f"{RUN}/2").wait()
        root = Path(srv.root)
        _marker(root, RUN, "2").write_bytes(b"")
        (root / "runs" / "NOT A RUN").mkdir()  # junk beside the runs: not a valid run name
        (root / "runs" / RUN / "junk file").write_bytes(b"x")
        stale = root / "runs" / RUN / "7" / "sessions" / ("a" * 32)
        stale.mkdir(parents=True)
        (stale / "SESSION.json").write_text(json.dumps({"session": "a" * 32, "world_size": 1, "step": 7,
                                                        "created_at": "2020-01-01T00:00:00Z"}))
        for _ in range(100):  # the sweep runs past the bad marker and reclaims the stale session
            if not stale.exists():
                break
            import time
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
