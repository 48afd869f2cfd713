"""``RUN/latest`` is the newest visible trainer checkpoint *not known to be bad* (docs/design.md §1).

Known bad: the checkpoint's recorded verification (``VERIFIED.json``) of the manifest committed
under its name now failed. One rule decides it (``Visibility.latest``), and every path that resolves
``latest`` asks it: a load through the service (whose answer names the checkpoints skipped, and
why), ``ckptd show``/``ls``/``verify``/``export`` offline and through the service, and retention,
which does not count a known-bad checkpoint among the N newest it keeps.

Attacks through the public surface: a real ``ckptd serve``, the real client and the CLI; a data
byte flipped in the root, a verification recorded by the service's route or by ``ckptd gc``.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file

from ckptd.service.read_routes import MAX_SKIPPED_HEADER_BYTES, _skipped_header
from ckptd.store.retention import plan_retention
from ckptd.store.visibility import Skipped
from ckptd_client import CheckpointClient
from ckptd_schemas import CheckpointNotFound, ChecksumMismatch
from support import ServerProcess, assert_bits_equal, blank_like, make_state, scaled, verified

from .test_retention import ckpt_lists

RUN = "kb"


def _flip_data_byte(root: Path, name: str) -> Path:
    files = sorted(p for p in (root / "runs" / RUN / name / "sessions").glob("*/files/*") if p.is_file())
    path = files[0]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 3] ^= 0x40
    path.write_bytes(bytes(raw))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=180)


def _latest(srv: ServerProcess) -> httpx.Response:
    r = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/latest", timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r


def _save(srv: ServerProcess, steps: list[int]) -> dict[int, dict]:
    states = {s: make_state(s) for s in steps}
    with CheckpointClient(srv.url) as c:
        for s, sd in states.items():
            c.save(sd, f"{RUN}/{s}").wait()
    verified(srv.url, *(f"{RUN}/{s}" for s in steps))  # the re-reads after the commits, before any damage
    return states


def test_a_failed_verification_makes_latest_skip_the_checkpoint_everywhere(tmp_path, caplog):
    """Three saves; the newest one's data damaged. Until a verification is recorded, nothing knows it
    is bad and ``latest`` still names it (the load fails typed). Once the service's verify route
    records the failure, the load of ``latest`` restores step 2 bit for bit, and the report, the
    client's log, the HTTP answer and ``ckptd show``/``ls`` (through the service and offline) name
    step 3 as skipped and why. gc with ``--keep-last 1`` keeps step 2 and does not count step 3;
    once a good step 4 commits, the known-bad step 3 is no longer newest and goes. (No read leases:
    the loads here would keep what they read from gc.)"""
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": "0"}).start()
    root = Path(srv.root)
    try:
        states = _save(srv, [1, 2, 3])
        damaged = _flip_data_byte(root, "3")
        # Not known to be bad yet (never verified since the damage): latest is still step 3.
        assert _latest(srv).headers["x-ckptd-name"] == "3" and "x-ckptd-skipped" not in _latest(srv).headers
        with CheckpointClient(srv.url) as c, pytest.raises(ChecksumMismatch):
            c.load(blank_like(states[3]), f"{RUN}/latest")

        rec = httpx.post(f"{srv.url}/v1/checkpoints/{RUN}/3/verify", timeout=180).json()
        assert rec["ok"] is False and any(damaged.name in p for p in rec["problems"]), rec

        r = _latest(srv)
        assert r.headers["x-ckptd-name"] == "2"
        (skipped,) = json.loads(r.headers["x-ckptd-skipped"])
        assert skipped["ref"] == f"{RUN}/3" and skipped["reason"].startswith("verification failed at ")
        assert rec["problems"][0][:100] in skipped["reason"], skipped

        out = blank_like(states[2])
        with caplog.at_level(logging.WARNING, logger="ckptd_client"), CheckpointClient(srv.url) as c:
            report = c.load(out, f"{RUN}/latest")
        assert_bits_equal(out, states[2])
        assert report.ref == f"{RUN}/2"
        assert [(s.ref, s.reason) for s in report.skipped] == [(skipped["ref"], skipped["reason"])]
        warned = [r.getMessage() for r in caplog.records if r.name == "ckptd_client" and r.levelno == logging.WARNING]
        assert any(f"{RUN}/2" in m and f"{RUN}/3" in m and "verification failed" in m for m in warned), warned
        with CheckpointClient(srv.url) as c:  # a named checkpoint is served as asked, and names nothing skipped
            assert c.load(blank_like(states[2]), f"{RUN}/2").skipped == []
        assert [r["latest"] for r in httpx.get(f"{srv.url}/v1/runs", timeout=10).json()] == ["2"]

        for target in (["--server", srv.url], ["--root", str(root)]):
            show = _cli("show", f"{RUN}/latest", *target)
            assert show.returncode == 0, show.stdout + show.stderr
            lines = show.stdout.splitlines()
            assert lines[0].startswith(f"checkpoint {RUN}/2 "), show.stdout
            assert lines[1].startswith(f"skipped    {RUN}/3: verification failed at "), show.stdout
            js = _cli("show", f"{RUN}/latest", "--json", *target)
            assert js.returncode == 0 and json.loads(js.stdout)["name"] == "2", js.stdout[-300:] + js.stderr
            assert f"skipped {RUN}/3: verification failed" in js.stderr, js.stderr
            ls = _cli("ls", *target)
            assert ls.returncode == 0 and f"{RUN}\t3 checkpoints\tlatest=2" in ls.stdout, ls.stdout + ls.stderr
            # ls and show mark the known-bad checkpoint, with why, and the others verified
            ls = _cli("ls", RUN, *target)
            rows = {line.split("\t")[0]: line.split("\t")[3] for line in ls.stdout.splitlines()}
            assert rows[f"{RUN}/3"].startswith("known bad (verification failed at "), ls.stdout
            assert rows[f"{RUN}/2"] == rows[f"{RUN}/1"] == "verified", ls.stdout
            js = {r["name"]: r for r in json.loads(_cli("ls", RUN, "--json", *target).stdout)}
            assert js["3"]["status"] == "known bad" and js["3"]["status_reason"] == skipped["reason"], js
            assert js["2"]["status"] == "verified" and js["2"]["status_reason"] is None, js
            show = _cli("show", f"{RUN}/3", *target)
            assert f"status     known bad ({skipped['reason']})" in show.stdout.splitlines(), show.stdout
            verify = _cli("verify", f"{RUN}/latest", *target)  # the good one: exit 0
            assert verify.returncode == 0 and verify.stdout.startswith(f"OK {RUN}/2"), verify.stdout + verify.stderr

        # Retention: keep-last 1 keeps step 2 (what latest names, and the newest verified); step 3 takes
        # no place among the kept steps, but stays while it is the newest committed; step 1 goes.
        plan = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1, "dry_run": True}, timeout=180).json()
        assert plan["latest"] == "2" and plan["newest_verified"] == "2" and plan["delete"] == ["1"], plan
        assert set(plan["known_bad"]) == {"3"} and "2" in plan["keep"] and "known to be bad" in plan["keep"]["3"]
        gc = _cli("gc", RUN, "--keep-last", "1", "--server", srv.url)
        assert gc.returncode == 0 and f"deleted {RUN}/1" in gc.stdout, gc.stdout + gc.stderr
        assert f"known bad {RUN}/3: verification failed" in gc.stdout, gc.stdout
        assert [c["name"] for c in httpx.get(f"{srv.url}/v1/runs/{RUN}/checkpoints", timeout=10).json()] == ["2", "3"]
        out = blank_like(states[2])
        with CheckpointClient(srv.url) as c:
            assert c.load(out, f"{RUN}/latest").ref == f"{RUN}/2"
        assert_bits_equal(out, states[2])

        # A good step 4: latest again skips nothing, and the known-bad step 3 is no longer kept.
        states |= _save(srv, [4])
        assert _latest(srv).headers["x-ckptd-name"] == "4" and "x-ckptd-skipped" not in _latest(srv).headers
        plan = httpx.post(f"{srv.url}/v1/runs/{RUN}/gc", json={"keep_last": 1}, timeout=180).json()
        assert sorted(plan["deleted"]) == ["2", "3"] and plan["newest_verified"] == "4", plan
        with CheckpointClient(srv.url) as c:
            out = blank_like(states[4])
            report = c.load(out, f"{RUN}/latest")
        assert_bits_equal(out, states[4])
        assert report.ref == f"{RUN}/4" and report.skipped == []
    finally:
        srv.stop()


def test_no_record_or_a_record_of_another_manifest_is_not_known_bad(tmp_path):
    """Only a failed record *of the manifest committed now* counts. A damaged checkpoint whose record
    is gone (never verified) is not skipped; neither is a checkpoint re-saved under a name whose
    failed record, about the earlier manifest, is written back by a verification that finished late.
    When every trainer checkpoint is known to be bad, ``latest`` is a typed 404 naming them."""
    srv = ServerProcess(tmp_path / "root").start()
    root = Path(srv.root)
    try:
        states = _save(srv, [1, 2])
        _flip_data_byte(root, "2")
        rec = httpx.post(f"{srv.url}/v1/checkpoints/{RUN}/2/verify", timeout=180).json()
        assert rec["ok"] is False
        record = root / "runs" / RUN / "2" / "VERIFIED.json"
        stale = record.read_bytes()
        assert _latest(srv).headers["x-ckptd-name"] == "1"

        # The record is gone: nothing is known about step 2 any more, so latest names it again.
        record.unlink()
        r = _latest(srv)
        assert r.headers["x-ckptd-name"] == "2" and "x-ckptd-skipped" not in r.headers

        # Step 2 deleted behind the service's back and saved again with other bytes; then the failed
        # record of the old manifest is written back. It is about another digest: it does not count.
        shutil.rmtree(root / "runs" / RUN / "2")
        states[2] = make_state(22)
        with CheckpointClient(srv.url) as c:
            c.save(states[2], f"{RUN}/2").wait()
        record.write_bytes(stale)
        assert json.loads(stale)["manifest_xxh3"] != _latest(srv).headers["x-ckptd-manifest-xxh3"]
        r = _latest(srv)
        assert r.headers["x-ckptd-name"] == "2" and "x-ckptd-skipped" not in r.headers
        out = blank_like(states[2])
        with CheckpointClient(srv.url) as c:
            report = c.load(out, f"{RUN}/latest")
        assert_bits_equal(out, states[2])
        assert report.ref == f"{RUN}/2" and report.skipped == []

        # Every trainer checkpoint known to be bad: no latest, a typed 404 that names them.
        for name in ("1", "2"):
            _flip_data_byte(root, name)
            assert httpx.post(f"{srv.url}/v1/checkpoints/{RUN}/{name}/verify", timeout=180).json()["ok"] is False
        r = httpx.get(f"{srv.url}/v1/checkpoints/{RUN}/latest", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "checkpoint_not_found", r.text
        assert "not known to be bad" in r.json()["error"]["message"]
        assert [s["ref"] for s in r.json()["error"]["details"]["skipped"]] == [f"{RUN}/2", f"{RUN}/1"]
        with CheckpointClient(srv.url) as c, pytest.raises(CheckpointNotFound, match="not known to be bad"):
            c.load(blank_like(states[2]), f"{RUN}/latest")
        show = _cli("show", f"{RUN}/latest", "--server", srv.url)
        assert show.returncode == 1 and "Traceback" not in show.stderr, show.stdout + show.stderr
    finally:
        srv.stop()


def test_offline_gc_records_the_failure_and_every_offline_reader_skips_it(tmp_path):
    """No service: ``ckptd gc --dry-run --root`` verifies the damaged newest checkpoint, plans as if
    its failure were recorded, and records nothing; ``ckptd gc --root`` records it (and deletes step 1):
    from then on ``ckptd verify``, ``show``, ``ls`` and ``export`` of ``RUN/latest`` on the root take
    step 2, and gc counts step 3 for nothing."""
    srv = ServerProcess(tmp_path / "root").start()
    root = Path(srv.root)
    try:
        states = _save(srv, [1, 2, 3])
    finally:
        srv.stop()
    _flip_data_byte(root, "3")
    target = ["--root", str(root)]
    before = _cli("verify", f"{RUN}/latest", *target)
    assert before.returncode == 1 and before.stdout.startswith(f"FAIL {RUN}/3"), before.stdout + before.stderr

    dry = _cli("gc", RUN, "--keep-last", "1", "--dry-run", "--json", *target)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["newest_verified"] == "2" and "3" in plan["failed_verification"], plan
    assert plan["latest"] == "2" and set(plan["known_bad"]) == {"3"} and plan["delete"] == ["1"], plan
    assert not (root / "runs" / RUN / "3" / "VERIFIED.json").exists() or json.loads(
        (root / "runs" / RUN / "3" / "VERIFIED.json").read_text())["ok"]  # the dry run recorded nothing
    assert _cli("verify", f"{RUN}/latest", *target).stdout.startswith(f"FAIL {RUN}/3")  # nothing known yet

    real = _cli("gc", RUN, "--keep-last", "1", "--json", *target)
    assert json.loads(real.stdout)["deleted"] == ["1"], real.stdout + real.stderr

    after = _cli("verify", f"{RUN}/latest", *target)
    assert after.returncode == 0 and after.stdout.startswith(f"OK {RUN}/2"), after.stdout + after.stderr
    show = _cli("show", f"{RUN}/latest", *target)
    assert show.returncode == 0 and show.stdout.startswith(f"checkpoint {RUN}/2 "), show.stdout + show.stderr
    assert f"skipped    {RUN}/3: verification failed at " in show.stdout
    assert "latest=2" in _cli("ls", *target).stdout
    exported = _cli("export", f"{RUN}/latest", str(tmp_path / "out"), "--json", *target)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert json.loads(exported.stdout)["ref"] == f"{RUN}/2"
    got: dict = {}
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        got |= load_file(shard)
    assert torch.equal(got["w"], states[2]["model"]["w"])  # the model's weights, by the model's own names
    again = _cli("gc", RUN, "--keep-last", "1", "--json", *target)
    assert json.loads(again.stdout)["deleted"] == [], again.stdout + again.stderr  # step 3 costs step 2 nothing
    assert _cli("show", f"{RUN}/latest", *target).stdout.startswith(f"checkpoint {RUN}/2 ")


@settings(max_examples=300, deadline=None)
@given(ckpts=ckpt_lists, keep_last=st.integers(1, 5), keep_every=st.one_of(st.none(), st.integers(1, 30)),
       data=st.data())
def test_a_known_bad_checkpoint_takes_no_place_and_never_costs_another_one(ckpts, keep_last, keep_every, data):
    """Retention's rule 2 over random runs: with some checkpoints known to be bad, the N newest steps
    kept are those held by checkpoints not known to be bad; no known-bad checkpoint is kept as one of
    them; what ``RUN/latest`` resolves to and the newest trainer checkpoint stay; and nothing is
    deleted that the same policy would keep without the records."""
    names = [c.name for c in ckpts]
    bad = set(data.draw(st.lists(st.sampled_from(names), max_size=6))) if names else set()
    known = {n: "verification failed at 2026-01-01T00:00:00Z: file x: chunk 0 fails its checksum" for n in bad}
    plan = plan_retention("r", ckpts, keep_last=keep_last, keep_every=keep_every, known_bad=known)
    plain = plan_retention("r", ckpts, keep_last=keep_last, keep_every=keep_every)
    assert set(plan.keep).isdisjoint(plan.delete) and set(plan.keep) | set(plan.delete) == set(names)
    assert set(plan.delete) <= set(plain.delete), (plan, plain)
    good_steps = sorted({c.step for c in ckpts if c.step is not None and c.name not in bad})
    for c in ckpts:
        if c.name not in bad and c.step in good_steps[-keep_last:]:
            assert c.name in plan.keep, (c, plan)
        if c.name in bad:
            assert plan.keep.get(c.name) != f"among the last {keep_last} steps", (c, plan)
    trainer = sorted((c for c in ckpts if c.step is not None and c.derived_from is None),
                     key=lambda c: (c.step, c.committed_at))
    good = [c for c in trainer if c.name not in bad]
    if trainer:
        assert trainer[-1].name in plan.keep
    if good:
        assert plan.latest == good[-1].name and good[-1].name in plan.keep
    else:
        assert plan.latest is None


def test_the_skipped_header_fits_a_response_head_whatever_the_reasons():
    """Forty skipped checkpoints whose reasons name non-ASCII tensors at length: the header stays
    ASCII and within its bound, names the newest first, and parses."""
    skipped = tuple(Skipped(f"{RUN}/{100 - i}", "verification failed at 2026-01-01T00:00:00Z: tensor "
                            + "\u00e9\u6f22" * 400) for i in range(40))
    value = _skipped_header(skipped)
    assert value.isascii() and len(value) <= MAX_SKIPPED_HEADER_BYTES
    parsed = json.loads(value)
    assert parsed and parsed[0]["ref"] == f"{RUN}/100" and parsed[0]["reason"].startswith("verification failed")
    one = json.loads(_skipped_header(skipped[:1]))
    assert one == [{"ref": f"{RUN}/100", "reason": skipped[0].reason[:MAX_SKIPPED_HEADER_BYTES // 8]}]


def test_a_fifo_in_place_of_a_verification_record_blocks_no_reader(tmp_path):
    """An attacker with write access to the root replaces a committed checkpoint's ``VERIFIED.json`` by
    a FIFO (opening it for reading waits for a writer forever). Every reader of the record (``ls``, the
    resolve of ``latest``, and the conversion's check of its source, ``export``) takes it for no record
    at all: nothing hangs, the export verifies the checkpoint again, records the outcome in its place,
    and writes the checkpoint's tensors."""
    import os

    srv = ServerProcess(tmp_path / "root").start()
    root = Path(srv.root)
    try:
        states = _save(srv, [1])
    finally:
        srv.stop()
    record = root / "runs" / RUN / "1" / "VERIFIED.json"
    record.unlink()
    os.mkfifo(record)
    target = ["--root", str(root)]

    def cli(*args: str) -> subprocess.CompletedProcess:  # the deadline only guards against a hang
        return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                              timeout=scaled(120))

    listed = cli("ls", RUN, *target)
    assert listed.returncode == 0 and "pending" in listed.stdout, listed.stdout + listed.stderr
    exported = cli("export", f"{RUN}/latest", str(tmp_path / "out"), "--json", *target)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert json.loads(exported.stdout)["ref"] == f"{RUN}/1"
    assert record.is_file() and json.loads(record.read_text())["ok"] is True  # verified again, recorded
    got: dict = {}
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        got |= load_file(shard)
    assert torch.equal(got["w"], states[1]["model"]["w"])
