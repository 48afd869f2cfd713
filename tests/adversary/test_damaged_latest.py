"""A damaged newest checkpoint does not crash-loop an auto-resume (docs/retention.md, Damaged bytes),
whatever part of it is damaged: its data, an object's bytes, its manifest, its marker, its load tree.

A job that restarts on ``RUN/latest`` after every failure, as an auto-resume does: the newest
checkpoint's data file has one byte flipped on disk after its commit (and after the service's own
verification found it good). The first load fails with ``CorruptCheckpoint``; the rank reports the
file, the service reads it again, finds it damaged and records the verdict, and the error says that
``latest`` now resolves to the step before. The next start loads that step. A reader's report of a
file that is intact changes nothing: the service judges by its own check.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
import torch

from ckptd_client import CheckpointClient
from ckptd_schemas import CorruptCheckpoint
from support import ServerProcess, assert_bits_equal, blank_like, verified

RUN = "auto"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}, "step": step}


def _flip(root: Path, name: str) -> str:
    (path,) = [p for p in (root / "runs" / RUN / name / "sessions").glob("*/files/*") if p.is_file()]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return path.name


@pytest.fixture
def srv(tmp_path):
    s = ServerProcess(tmp_path / "root").start()
    with CheckpointClient(s.url, incremental=False) as c:
        for step in (1, 2, 3):
            c.save(_state(step), f"{RUN}/{step}").wait()
    verified(s.url, *(f"{RUN}/{step}" for step in (1, 2, 3)))  # the re-reads found them good, before any flip
    yield s
    s.stop()


def _resume(url: str, **kw) -> tuple[dict, str]:
    """One start of the job: load RUN/latest into a fresh state."""
    got = blank_like(_state(0))
    with CheckpointClient(url, **kw) as c:
        report = c.load(got, f"{RUN}/latest")
    return got, report.ref


@pytest.mark.parametrize("direct_reads", [False, True], ids=["http", "direct-reads"])
def test_an_auto_resume_on_a_damaged_latest_loads_the_step_before_after_one_failure(srv, direct_reads):
    file = _flip(Path(srv.root), "3")
    outcomes = []
    for _ in range(3):  # the restart loop
        try:
            got, ref = _resume(srv.url, direct_reads=direct_reads)
        except CorruptCheckpoint as e:
            outcomes.append(e)
            continue
        outcomes.append(ref)
        break
    assert len(outcomes) == 2, outcomes  # one failure, then the step before
    err, ref = outcomes
    assert isinstance(err, CorruptCheckpoint)
    assert f"found it damaged and recorded {RUN}/3 as bad: {RUN}/latest now resolves to {RUN}/2" in err.message, \
        err.message
    assert err.details["reported"]["recorded"] is True and err.details["file"] == file
    assert ref == f"{RUN}/2"
    assert_bits_equal(got, _state(2))
    rec = json.loads((Path(srv.root) / "runs" / RUN / "3" / "VERIFIED.json").read_text()) \
        if (Path(srv.root) / "runs" / RUN / "3" / "VERIFIED.json").exists() else \
        httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/3/verification", timeout=10).json()
    assert rec["ok"] is False and any(file in p for p in rec["problems"]), rec
    # the damaged checkpoint is still there, named: nothing was deleted
    assert httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/3", timeout=10).status_code == 200


def test_a_dcp_load_of_a_damaged_latest_reports_it_too(srv):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    _flip(Path(srv.root), "3")
    with CheckpointClient(srv.url, direct_reads=False) as c:
        got = blank_like(_state(0))
        with pytest.raises(CheckpointException) as info:  # DCP wraps a rank's error in its CheckpointException
            dcp.load(got, storage_reader=c.dcp_reader(f"{RUN}/latest"), no_dist=True)
    assert "CorruptCheckpoint" in str(info.value) and f"{RUN}/latest now resolves to {RUN}/2" in str(info.value)
    got, ref = _resume(srv.url)
    assert ref == f"{RUN}/2"


def test_a_report_of_intact_bytes_changes_nothing(srv):
    m = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/3", timeout=10).json()
    (file,) = m["files"]
    before = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/3/verification", timeout=10)
    r = httpx.post(f"{srv.url}/v1/checkpoints/{RUN}/3/damaged", json={"files": [file]}, timeout=120)
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["damaged"] is False and v["recorded"] is False and v["latest"] == "3", v
    after = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/3/verification", timeout=10)
    assert after.status_code == before.status_code and after.text == before.text
    for parts in (["marker"], ["manifest"], ["load tree"], ["marker", "manifest", "load tree"]):  # intact too
        r = httpx.post(f"{srv.url}/v1/checkpoints/{RUN}/3/damaged", json={"parts": parts}, timeout=120)
        assert r.status_code == 200 and r.json()["damaged"] is False and r.json()["recorded"] is False, r.text
    after = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/3/verification", timeout=10)
    assert after.status_code == before.status_code and after.text == before.text
    _, ref = _resume(srv.url)
    assert ref == f"{RUN}/3"
    # files the checkpoint does not have, names that are not file names, too many, no part: refused, nothing read
    for body, code in (({"files": ["nope.bin"]}, 400), ({"files": ["../x"]}, 400), ({"files": []}, 422),
                       ({"files": [file] * 17}, 422), ({"files": [file], "extra": 1}, 422),
                       ({"parts": ["data"]}, 422), ({"parts": []}, 422), ({"parts": ["marker"] * 4}, 422)):
        r = httpx.post(f"{srv.url}/v1/checkpoints/{RUN}/3/damaged", json=body, timeout=60)
        assert r.status_code == code, (body, r.status_code, r.text)


@pytest.mark.slow
def test_a_flood_of_damage_reports_is_bounded_and_nothing_is_lost(tmp_path):
    """A reader with a valid token reports "damaged bytes" in twelve checkpoints at once while the
    replica's one worker is busy (a throttled reshard job): eight reports are checked, queued behind the
    job; the other four are refused at once with a typed 429 (they queue no read); once the job ends,
    the eight are answered (the files are intact: nothing recorded) and a report is accepted again."""
    import concurrent.futures

    from ckptd_schemas import TooManyRequests, error_from_body
    from support import scaled

    s = ServerProcess(tmp_path / "root").start(env={"CKPTD_RESHARD_MAX_MBPS": "0.25", "CKPTD_RESHARD_WORKERS": "1"})
    try:
        with CheckpointClient(s.url, incremental=False) as c:
            c.save({"w": torch.randn(512, 512)}, "flood/big").wait()  # 1 MiB: about 8 s through the cap
            for i in range(13):
                c.save({"w": torch.full((4,), float(i))}, f"flood/{i}").wait()
        files = {i: next((Path(s.root) / "runs" / "flood" / str(i) / "sessions").glob("*/files/*")).name
                 for i in range(13)}
        with httpx.Client(base_url=s.url, timeout=scaled(120)) as h:
            job = h.post("/v1/reshard", json={"source": "flood/big", "to": "full"}).json()
            deadline = time.monotonic() + scaled(60)
            while h.get(f"/v1/jobs/{job['id']}").json()["state"] == "queued":
                assert time.monotonic() < deadline, "the job never started"
                time.sleep(0.05)
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                answers = list(pool.map(lambda i: h.post(f"/v1/checkpoints/flood/{i}/damaged",
                                                         json={"files": [files[i]]}), range(12)))
            assert h.get(f"/v1/jobs/{job['id']}").json()["state"] == "done"  # the reports waited behind it
            codes = sorted(r.status_code for r in answers)
            assert codes == [200] * 8 + [429] * 4, codes
            for r in answers:
                if r.status_code == 429:
                    assert type(error_from_body(r.json(), 429)) is TooManyRequests and "flood/" in r.text
                else:
                    assert r.json()["damaged"] is False and r.json()["recorded"] is False
            again = h.post("/v1/checkpoints/flood/12/damaged", json={"files": [files[12]]})
            assert again.status_code == 200 and again.json()["damaged"] is False
        records = [Path(s.root) / "runs" / "flood" / str(i) / "VERIFIED.json" for i in range(13)]
        assert not any(r.exists() and json.loads(r.read_text())["ok"] is False for r in records)  # nothing marked bad
    finally:
        s.stop()


# -- every part of the newest checkpoint ----------------------------------------------------------

def _state_with_object(step: int) -> dict:
    return {**_state(step), "shape": torch.Size([step, 2])}  # not JSON: its bytes lie in the data file


def _flip_digit(path: Path, at: int) -> None:
    """One hexadecimal or decimal digit at ``at`` changed to another; the file's times kept (a stat
    cache sees nothing)."""
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[at] = ord("1") if raw[at] != ord("1") else ord("2")
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _damage(root: Path, name: str, part: str) -> None:
    ckpt = root / "runs" / RUN / name
    (manifest,) = ckpt.glob("sessions/*/manifest-*.json")
    (data,) = [p for p in ckpt.glob("sessions/*/files/*") if p.is_file()]
    m = json.loads(manifest.read_text())
    if part in ("data", "object"):
        at = next(o["location"]["offset"] for o in m["objects"] if o["location"]) if part == "object" else 100
        raw = bytearray(data.read_bytes())
        raw[at + 3] ^= 0x10
        data.write_bytes(bytes(raw))
    elif part == "manifest":
        text = manifest.read_text()
        _flip_digit(manifest, text.index('"xxh3"') + len('"xxh3": "') + 2 if '"xxh3": "' in text
                    else text.index('"xxh3":"') + len('"xxh3":"') + 2)
    else:  # a digit of one of the marker's fields: the manifest's digest, the step, the load tree's root
        marker = ckpt / "COMMITTED"
        field = {"marker digest": "manifest_xxh3", "marker step": "step", "load tree": "load_tree"}[part]
        text = marker.read_text()
        start = text.index(f'"{field}":') + len(f'"{field}":')
        _flip_digit(marker, start + (2 if text[start] == '"' else 0))


PARTS = ["data", "object", "manifest", "marker digest", "marker step", "load tree"]


@pytest.mark.parametrize("part", PARTS)
def test_a_damaged_newest_checkpoint_costs_at_most_one_failed_restart_whatever_part_is_damaged(tmp_path, part):
    """A digit flipped in one part of the newest checkpoint, after its commit and its verification:
    the restart loop on ``RUN/latest`` fails at most once; a failure is recorded by the load that found
    it (the service's own check confirms it: the record says ``ok: false``), and the next start loads
    the step before, bit for bit. Damage that makes the checkpoint invisible (its manifest, its marker's
    digest or step) costs no failure at all."""
    s = ServerProcess(tmp_path / "root").start()
    try:
        with CheckpointClient(s.url, incremental=False) as c:
            for step in (1, 2, 3):
                c.save(_state_with_object(step), f"{RUN}/{step}").wait()
        _resume_with(s.url, _state_with_object)  # the newest loads, and every cache is warm
        _damage(Path(s.root), "3", part)
        outcomes: list = []
        for _ in range(3):  # the restart loop
            try:
                got, ref = _resume_with(s.url, _state_with_object)
            except CorruptCheckpoint as e:
                outcomes.append(e)
                continue
            outcomes.append(ref)
            break
        assert outcomes[-1] == f"{RUN}/2" and len(outcomes) <= 2, outcomes
        assert_bits_equal(got, _state_with_object(2))
        if len(outcomes) == 2:
            err = outcomes[0]
            assert f"recorded {RUN}/3 as bad: {RUN}/latest now resolves to {RUN}/2" in err.message, err.message
            rec = httpx.get(f"{s.url}/v1/checkpoints/{RUN}/3/verification", timeout=10).json()
            assert rec["ok"] is False and rec["problems"], rec
        assert part in ("data", "object", "load tree") or len(outcomes) == 1, outcomes
    finally:
        s.stop()


def _resume_with(url: str, state) -> tuple[dict, str]:
    got = blank_like(state(0))
    with CheckpointClient(url) as c:
        report = c.load(got, f"{RUN}/latest")
    return got, report.ref
