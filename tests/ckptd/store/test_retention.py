"""Retention (``ckptd gc``): steps ordered as numbers, only committed checkpoints count, the newest
and the leased ones always stay, a save in progress protects nothing and loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader, SessionStore
from ckptd.store.leases import Leases
from stored_tensors import read_tensor, write_tensors
from ckptd.store.retention import collect, plan_retention
from ckptd_schemas import CheckpointSummary, InvalidRequest, OpenSession
from support import scaled

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _summary(name: str, step: int | None, i: int, derived: bool = False) -> CheckpointSummary:
    return CheckpointSummary(run="r", name=name, step=step, derived_from="r/src" if derived else None,
                             session="s" * 32, committed_at=T0 + timedelta(seconds=i), manifest_xxh3="0" * 16)


ckpt_lists = st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 120)), st.booleans()), max_size=25).map(
    lambda xs: [_summary(f"c{i}-{s}", s, i, derived=d) for i, (s, d) in enumerate(xs)])


@settings(max_examples=300, deadline=None)
@given(ckpts=ckpt_lists, keep_last=st.integers(1, 5), keep_every=st.one_of(st.none(), st.integers(1, 30)),
       data=st.data())
def test_the_policy_keeps_what_it_promises_and_deletes_the_rest(ckpts, keep_last, keep_every, data):
    names = [c.name for c in ckpts]
    leased = set(data.draw(st.lists(st.sampled_from(names), max_size=3))) if names else set()
    plan = plan_retention("r", ckpts, keep_last=keep_last, keep_every=keep_every, leased=leased)
    assert set(plan.keep).isdisjoint(plan.delete) and set(plan.keep) | set(plan.delete) == set(names)
    trainer = [c for c in ckpts if c.step is not None and c.derived_from is None]
    if trainer:  # the checkpoint RUN/latest resolves to
        newest = max(trainer, key=lambda c: (c.step, c.committed_at))
        assert newest.name in plan.keep
    steps = sorted({c.step for c in ckpts if c.step is not None})
    for c in ckpts:
        must_keep = (c.name in leased or c.step is None or c.step in steps[-keep_last:]
                     or (keep_every is not None and c.step % keep_every == 0))
        if must_keep:
            assert c.name in plan.keep, (c, plan)
    for name in plan.delete:  # deleted only if no rule keeps it
        c = next(x for x in ckpts if x.name == name)
        assert c.step is not None and c.step not in steps[-keep_last:] and name not in leased


def test_steps_are_numbers_not_text():
    ckpts = [_summary(n, int(n), i) for i, n in enumerate(["100", "9", "10", "99"])]
    plan = plan_retention("r", ckpts, keep_last=1)
    assert list(plan.keep) == ["100"] and plan.delete == ["9", "10", "99"]


def test_nonsense_limits_are_refused():
    with pytest.raises(InvalidRequest, match="keep_last must be at least 1"):
        plan_retention("r", [], keep_last=0)
    with pytest.raises(InvalidRequest, match="keep_every"):
        plan_retention("r", [], keep_last=1, keep_every=0)


@pytest.fixture()
def root(tmp_path):
    storage = LocalStorage(tmp_path, durable=False)
    return storage, CheckpointReader(storage), SessionStore(storage)


def _commit_steps(sessions: SessionStore, run: str, steps: list[int]) -> dict[int, torch.Tensor]:
    out = {}
    for s in steps:
        out[s] = torch.full((3, 4), float(s))
        write_tensors(sessions, f"{run}/{s}", {"model.w": out[s]}, step=s)
    return out


def test_gc_deletes_marker_then_data_keeps_leased_newest_and_in_progress(root):
    storage, reader, sessions = root
    values = _commit_steps(sessions, "run", [1, 2, 5, 9, 10, 11, 12])
    write_tensors(sessions, "run/12-full", {"model.w": values[12]}, step=12)  # a derived-like copy of step 12
    Leases(storage).acquire("run", "2", "exporter", ttl=600)
    # step 13 is being saved: staged, not committed
    sessions.open("run", "13", OpenSession(session=uuid.uuid4().hex, world_size=2, step=13))

    dry = collect(storage, "run", keep_last=2, keep_every=5, dry_run=True)
    assert sorted(dry.delete, key=int) == ["1", "9"] and dry.deleted == []
    assert [c.name for c in reader.checkpoints_page("run")[0]][:3] == ["1", "2", "5"]  # nothing went

    plan = collect(storage, "run", keep_last=2, keep_every=5)
    assert sorted(plan.deleted, key=int) == ["1", "9"]
    assert plan.keep["2"].startswith("leased") and "multiple of 5" in plan.keep["10"]
    left = {c.name for c in reader.checkpoints_page("run")[0]}
    assert left == {"2", "5", "10", "11", "12", "12-full"}
    for name in ("1", "9"):
        assert reader.marker("run", name) is None and not (storage.root / "runs/run" / name).exists()
    for s in (2, 5, 11, 12):
        assert torch.equal(read_tensor(reader, f"run/{s}", "model.w"), values[s])
    assert "13" in storage.list("runs/run")  # the save in progress is not touched


def test_keep_last_one_never_leaves_the_run_without_a_good_checkpoint(root):
    storage, reader, sessions = root
    _commit_steps(sessions, "solo", [1])
    sid = uuid.uuid4().hex
    sessions.open("solo", "2", OpenSession(session=sid, world_size=1, step=2))  # successor not committed
    assert collect(storage, "solo", keep_last=1).deleted == []
    assert reader.resolve("solo", "latest")[0] == "1"
    _commit_steps(sessions, "solo", [3])  # now a successor committed: the old one may go
    assert collect(storage, "solo", keep_last=1).deleted == ["1"]
    assert reader.resolve("solo", "latest")[0] == "3"


def test_a_lease_taken_while_gc_runs_still_protects(root, monkeypatch):
    storage, reader, sessions = root
    _commit_steps(sessions, "race", [1, 2, 3])
    real = Leases.delete

    def delete(self, run, name, remove):
        if name == "1":  # a reader leased step 1 after gc listed the run, before its deletion
            Leases(storage).acquire(run, name, "late-reader", ttl=600)
        return real(self, run, name, remove)

    monkeypatch.setattr(Leases, "delete", delete)
    plan = collect(storage, "race", keep_last=1)
    assert plan.deleted == ["2"] and plan.keep["1"].startswith("leased")
    assert reader.marker("race", "1") is not None


def test_cli_gc_dry_run_json_and_real(tmp_path):
    storage = LocalStorage(tmp_path, durable=False)
    _commit_steps(SessionStore(storage), "cli", [1, 2, 3])

    def ckptd(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args, "--root", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)

    r = ckptd("gc", "cli", "--keep-last", "2", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["delete"] == ["1"]
    assert (tmp_path / "runs/cli/1/COMMITTED").exists()
    r = ckptd("gc", "cli", "--keep-last", "2")
    assert r.returncode == 0 and "deleted cli/1" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "runs/cli/1").exists()
    r = ckptd("gc", "cli", "--keep-last", "0")
    assert r.returncode == 2 and "keep_last must be at least 1" in r.stderr


def test_service_policy_collects_after_each_commit_and_spares_what_was_just_read(tmp_path):
    from ckptd_client import CheckpointClient
    from support import ServerProcess

    srv = ServerProcess(tmp_path / "root", env={"CKPTD_RETENTION_KEEP_LAST": "2",
                                                "CKPTD_READ_LEASE_SECONDS": "600"}).start()
    try:
        c = CheckpointClient(srv.url)
        c.save({"w": torch.zeros(4)}, "pol/1").wait()
        file = next(iter(c.manifest("pol/1").files))  # reading the manifest leases nothing; reading bytes does:
        assert httpx.get(f"{srv.url}/v1/checkpoints/pol/1/files/{file}", timeout=10).status_code == 200
        for s in (2, 3, 4):
            c.save({"w": torch.full((4,), float(s))}, f"pol/{s}").wait()
        deadline = time.monotonic() + scaled(30)
        names: list[str] = []
        while time.monotonic() < deadline:  # the policy runs in the background after each commit
            names = [x.name for x in c.list_checkpoints("pol")]
            if names == ["1", "3", "4"]:
                break
            time.sleep(0.2)
        assert names == ["1", "3", "4"]  # 2 went; 1 is leased; 3 and 4 are the last two steps
        got = {"w": torch.zeros(4)}
        c.load(got, "pol/latest")
        assert torch.equal(got["w"], torch.full((4,), 4.0))
        c.close()
    finally:
        srv.stop()


def test_cli_gc_through_the_service(server):
    from ckptd_client import CheckpointClient

    c = CheckpointClient(server.url)
    for s in (1, 2, 3):
        c.save({"w": torch.full((2,), float(s))}, f"srv/{s}").wait()
    c.close()

    def ckptd(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args, "--server", server.url],
                              capture_output=True, text=True, timeout=120)

    r = ckptd("gc", "srv", "--keep-last", "1", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["delete"] == ["1", "2"]
    r = ckptd("gc", "srv", "--keep-last", "2")
    assert r.returncode == 0 and "deleted srv/1" in r.stdout, r.stdout + r.stderr
    assert [x.name for x in CheckpointClient(server.url).list_checkpoints("srv")] == ["2", "3"]
    r = ckptd("gc", "srv", "--keep-last", "0")
    assert r.returncode == 2 and "keep_last" in r.stderr


def test_a_held_lease_spares_a_checkpoint_until_the_holder_is_done(root):
    storage, reader, sessions = root
    _commit_steps(sessions, "held", [1, 2, 3])
    ttl = scaled(2.0)  # renewed every third of it: a renewal may be late by a whole second and more
    with Leases(storage).hold("held", "1", "export", ttl=ttl) as holder:
        time.sleep(1.5 * ttl)  # renewed in the background: still active past its first ttl
        assert holder in Leases(storage).active("held", "1")
        assert collect(storage, "held", keep_last=1).keep["1"].startswith("leased")
    assert Leases(storage).active("held", "1") == []
    assert collect(storage, "held", keep_last=1).deleted == ["1"]
