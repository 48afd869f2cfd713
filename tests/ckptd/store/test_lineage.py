"""Lineage across runs: a run started from another run's checkpoint records it as its ``parent``.

Through a real ``ckptd serve``: the parent is in the marker, the manifest and the listings;
``ckptd show`` prints the chain; retention (``gc``, ``rm`` and ``DELETE``) never deletes a parent
while a visible checkpoint of another run names it, unless told (``--drop-parents``, admin only);
what a client or a hostile writer sends as a parent is checked (named, of another run, visible,
the same on every rank); an edit of the parent in the root makes the child invisible, never a
parent unprotected while its child is listed.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import httpx
import pytest
import torch

from ckptd.service.auth import hash_token
from ckptd.storage import LocalStorage
from ckptd.store.paths import Paths
from ckptd.store.retention import plan_retention
from ckptd_client import CheckpointClient
from ckptd_schemas import CheckpointNotFound, CheckpointSummary, InvalidName, InvalidRequest, SessionConflict
from support import ServerProcess

ADMIN, PRE_WRITER, FT_READER = "admin-token-0123456789", "pre-writer-token-0123456789", "ft-reader-token-0123456789"
TOKENS = (f"admin sha256:{hash_token(ADMIN)} admin\n"
          f"prewriter sha256:{hash_token(PRE_WRITER)} write:pre\n"
          f"ftreader sha256:{hash_token(FT_READER)} read:ft")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lineage")
    tokens = tmp / "tokens"
    tokens.write_text(TOKENS)
    # no read leases: the chain loads pre/1, and a lease would be the first reason it stays
    s = ServerProcess(tmp / "root", env={"CKPTD_TOKENS_FILE": str(tokens), "CKPTD_READ_LEASE_SECONDS": "0"}).start()
    yield s
    s.stop()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def _ckptd(srv, *args: str, token: str | None = ADMIN) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"CKPTD_TOKEN": token} if token else {})}
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args, "--server", srv.url],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def chain(srv):
    """pre/1, pre/2; ft/10 started from pre/1; ft2/5 started from ft/10."""
    with CheckpointClient(srv.url, token=ADMIN) as c:
        c.save(_state(1), "pre/1").wait()
        c.save(_state(2), "pre/2").wait()
        sd = _state(0)
        report = c.load(sd, "pre/1")
        assert report.ref == "pre/1"
        c.save(sd, "ft/10", parent=report.ref).wait()
        c.save(_state(3), "ft2/5", parent="ft/10").wait()
    return srv


def test_the_parent_is_recorded_in_the_manifest_the_listing_and_the_chain_shown(chain):
    with CheckpointClient(chain.url, token=ADMIN) as c:
        assert c.manifest("ft/10").parent == "pre/1"
        assert c.manifest("ft2/5").parent == "ft/10"
        assert c.manifest("pre/1").parent is None
        assert [(x.name, x.parent) for x in c.list_checkpoints("ft")] == [("10", "pre/1")]
    out = _ckptd(chain, "show", "ft2/5")
    assert out.returncode == 0, out.stderr
    assert "lineage    ft2/5 <- ft/10 <- pre/1" in out.stdout
    ls = _ckptd(chain, "ls", "ft")
    assert "parent pre/1" in ls.stdout


@contextlib.contextmanager
def family(root, pre_steps=(1, 2)):
    """A fresh server (no tokens) on ``root`` holding pre/STEP for each step and ft/1 started from
    pre/1; yields a client of it."""
    srv = ServerProcess(root).start()
    try:
        with CheckpointClient(srv.url) as c:
            for s in pre_steps:
                c.save(_state(s), f"pre/{s}").wait()
            c.save(_state(9), "ft/1", parent="pre/1").wait()
            yield srv, c
    finally:
        srv.stop()


def test_retention_keeps_a_parent_of_another_runs_checkpoint_until_told(tmp_path):
    with family(tmp_path / "root", (1, 2, 3)) as (srv, c):
        plan = c.gc("pre", keep_last=1)
        assert plan["deleted"] == ["2"]
        assert plan["keep"]["1"] == "parent of ft/1"
        # one checkpoint's removal: the same protections, the reason returned, not an error
        assert c.remove("pre/1") == {"ref": "pre/1", "removed": False, "reason": "parent of ft/1"}
        assert c.remove("pre/3")["reason"] == "newest committed checkpoint"
        assert [x.name for x in c.list_checkpoints("pre")] == ["1", "3"]
        # told to: the parent goes, and the child still loads (it holds its own bytes)
        assert c.gc("pre", keep_last=1, drop_parents=True, dry_run=True)["delete"] == ["1"]
        assert c.gc("pre", keep_last=1, drop_parents=True)["deleted"] == ["1"]
        sd = _state(0)
        c.load(sd, "ft/1")
        assert torch.equal(sd["w"], _state(9)["w"])
        out = _ckptd(srv, "show", "ft/1", token=None)
        assert "ft/1 <- pre/1 (no longer visible)" in out.stdout


def test_a_parent_stays_protected_only_while_its_child_is_visible(tmp_path):
    with family(tmp_path / "root") as (srv, c):
        c.save(_state(8), "ft/2").wait()
        assert c.remove("pre/1", dry_run=True)["reason"] == "parent of ft/1"
        # the child goes (its own run's retention), and with it the protection
        assert c.remove("ft/1")["reason"] == "removed"
        assert c.remove("pre/1", dry_run=True) == {"ref": "pre/1", "removed": False, "reason": "would be removed"}
        assert c.remove("pre/1")["removed"] is True
        with pytest.raises(CheckpointNotFound):
            c.remove("pre/1")


def test_an_edited_parent_in_the_root_hides_the_child_rather_than_unprotecting_silently(tmp_path):
    root = tmp_path / "root"
    with family(root, (1, 2, 3)) as (srv, c):
        storage = LocalStorage(root, durable=False)
        key = Paths.marker("ft", "1")
        marker = json.loads(storage.read(key))
        marker["parent"] = "pre/2"  # someone rewrites the lineage in the marker alone
        storage.delete(key)
        storage.put(key, json.dumps(marker).encode())
        assert c.list_checkpoints("ft") == []  # marker and manifest disagree: not visible
        with pytest.raises(CheckpointNotFound):
            c.manifest("ft/1")
        # pre/2 gains no protection from a child nobody can see; pre/1 lost its child too
        assert c.gc("pre", keep_last=1, dry_run=True)["delete"] == ["1", "2"]


def test_parents_that_are_not_a_named_visible_checkpoint_of_another_run_are_refused(chain):
    with CheckpointClient(chain.url, token=ADMIN) as c:
        with pytest.raises(InvalidName, match="another run"):
            c.save(_state(1), "ft/11", parent="pre/latest")
        with pytest.raises(InvalidName, match="another run"):
            c.save(_state(1), "ft/11", parent="ft/10")
        with pytest.raises(InvalidRequest, match="parent 'pre/404' is not a visible checkpoint"):
            c.save(_state(1), "ft/11", parent="pre/404").wait()
    # the service checks too: a writer that does not use the client
    h = {"Authorization": f"Bearer {ADMIN}"}
    for parent, what in (("pre/latest", "name the checkpoint"), ("ft/10", "of run ft itself"),
                         ("pre/404", "not a visible checkpoint"), ("no-slash", "invalid checkpoint ref")):
        r = httpx.post(f"{chain.url}/v1/checkpoints/ft/12/sessions", headers=h, timeout=10,
                       json={"session": "a" * 32, "world_size": 1, "step": 12, "parent": parent})
        assert r.status_code == 400, (parent, r.text)
        assert what in r.json()["error"]["message"], (parent, r.text)


def test_every_rank_must_name_the_same_parent(chain):
    h = {"Authorization": f"Bearer {ADMIN}"}
    url = f"{chain.url}/v1/checkpoints/ft/13/sessions"
    body = {"session": "b" * 32, "world_size": 2, "step": 13, "parent": "pre/1"}
    assert httpx.post(url, headers=h, json=body, timeout=10).status_code == 200
    assert httpx.post(url, headers=h, json=body, timeout=10).status_code == 200  # a rank joins
    for other in ({**body, "parent": "pre/2"}, {k: v for k, v in body.items() if k != "parent"}):
        r = httpx.post(url, headers=h, json=other, timeout=10)
        assert r.status_code == 409 and r.json()["error"]["code"] == SessionConflict.code, r.text
    httpx.delete(f"{url}/{'b' * 32}", headers=h, timeout=10)


def test_removal_needs_write_access_to_the_run_and_dropping_parents_needs_admin(chain):
    def delete(token: str, ref: str) -> httpx.Response:
        return httpx.delete(f"{chain.url}/v1/checkpoints/{ref}", headers={"Authorization": f"Bearer {token}"},
                            params={"dry_run": "true"}, timeout=10)

    assert delete(FT_READER, "ft/10").status_code == 403  # read access only
    assert delete(PRE_WRITER, "ft/10").status_code == 403  # another run
    assert httpx.delete(f"{chain.url}/v1/checkpoints/pre/1", timeout=10).status_code == 401
    r = delete(PRE_WRITER, "pre/1")
    assert r.status_code == 200 and r.json() == {"ref": "pre/1", "removed": False, "reason": "parent of ft/10"}
    # naming a parent takes read access to its run: a writer of run pre cannot pin (or probe) run ft's
    # checkpoints by naming them, and the refusal says nothing about whether they exist
    for parent in ("ft/10", "ft/404"):
        r = httpx.post(f"{chain.url}/v1/checkpoints/pre/77/sessions", timeout=10,
                       headers={"Authorization": f"Bearer {PRE_WRITER}"},
                       json={"session": "f" * 32, "world_size": 1, "step": 77, "parent": parent})
        assert r.status_code == 403 and "may not read run ft" in r.text, r.text
    r = httpx.post(f"{chain.url}/v1/runs/pre/gc", headers={"Authorization": f"Bearer {PRE_WRITER}"},
                   json={"keep_last": 1, "drop_parents": True, "dry_run": True}, timeout=10)
    assert r.status_code == 403
    out = _ckptd(chain, "rm", "pre/1", "--dry-run", token=PRE_WRITER)
    assert out.returncode == 1 and out.stdout.strip() == "kept pre/1: parent of ft/10", (out.stdout, out.stderr)


def test_the_cli_on_a_root_applies_the_same_protection(tmp_path):
    root = tmp_path / "root"
    with family(root):
        pass

    def ckptd(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args, "--root", str(root)],
                              capture_output=True, text=True, timeout=60)

    out = ckptd("rm", "pre/1")
    assert out.returncode == 1 and "kept pre/1: parent of ft/1" in out.stdout
    out = ckptd("gc", "pre", "--keep-last", "1", "--json")
    assert json.loads(out.stdout)["keep"]["1"] == "parent of ft/1"
    out = ckptd("gc", "pre", "--keep-last", "1", "--drop-parents")
    assert out.returncode == 0 and "deleted pre/1" in out.stdout
    out = ckptd("rm", "pre/latest")
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_the_policy_never_deletes_a_parent_it_is_told_about():
    from datetime import datetime, timezone

    ckpts = [CheckpointSummary(run="r", name=str(s), step=s, derived_from=None, session="s" * 32,
                               committed_at=datetime(2026, 1, 1, tzinfo=timezone.utc), manifest_xxh3="0" * 16)
             for s in range(6)]
    plan = plan_retention("r", ckpts, keep_last=1, children={"2": ["a/1"], "4": ["b/7", "c/1", "d/1", "e/1"]})
    assert plan.delete == ["0", "1", "3"]
    assert plan.keep["2"] == "parent of a/1" and plan.keep["4"] == "parent of b/7, c/1, d/1 and 1 more"
    only = plan_retention("r", ckpts, keep_last=1, children={"2": ["a/1"]}, only={"2", "3", "5"})
    assert only.delete == ["3"] and set(only.keep) == {"2", "5"}


def test_a_dcp_writer_records_the_parent(chain):
    import torch.distributed.checkpoint as dcp

    with CheckpointClient(chain.url, token=ADMIN) as c:
        dcp.save(_state(5), storage_writer=c.dcp_writer("ft/20", parent="pre/2"), no_dist=True)
        assert c.manifest("ft/20").parent == "pre/2"
        sd = {k: torch.zeros_like(v) for k, v in _state(5).items()}
        dcp.load(sd, storage_reader=c.dcp_reader("ft/20"), no_dist=True)
        assert torch.equal(sd["w"], _state(5)["w"])
