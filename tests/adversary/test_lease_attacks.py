"""Attacks on read leases through the public surface, with a valid token of each scope.

The promises (docs/retention.md, Leases): a lease belongs to the token that took it: another token
can neither release nor take it over (403), an admin may break it (and the service logs that); one
token holds a bounded number of leases (429 past ``CKPTD_READ_LEASES_PER_TOKEN``); expired records
go. Looking at a checkpoint (its manifest, ``ckptd show``) takes no lease, and a load that fails
releases the lease it took, so neither keeps the checkpoint from ``rm``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from ckptd.service.auth import hash_token
from ckptd.storage.local import LocalStorage
from ckptd.store.leases import EXPIRED_KEPT_SECONDS, Leases
from ckptd_client import CheckpointClient
from ckptd_schemas import StateDictMismatch
from support import ServerProcess

WRITER, READER, READER2, ADMIN = ("writer-token-0123456789", "reader-token-0123456789", "reader2-token-012345678",
                                  "admin-token-0123456789ab")
TOKENS = ";".join([f"trainer sha256:{hash_token(WRITER)} write:ev*", f"evaluator sha256:{hash_token(READER)} read:*",
                   f"dashboard sha256:{hash_token(READER2)} read:*", f"ops sha256:{hash_token(ADMIN)} admin"])


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _cli(url: str, token: str, *args: str) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args, "--server", url], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CKPTD_TOKEN": token})


def _lease_files(root: Path) -> list[Path]:
    return sorted((root / "leases").rglob("*.json")) if (root / "leases").exists() else []


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    base = tmp_path_factory.mktemp("leases")
    s = ServerProcess(base / "root", log=base / "server.log",
                      env={"CKPTD_TOKENS": TOKENS, "CKPTD_READ_LEASES_PER_TOKEN": "3"}).start()
    with CheckpointClient(s.url, token=WRITER, incremental=False) as c:
        for step in range(1, 7):
            c.save({"w": torch.full((8, 8), float(step))}, f"ev/{step}").wait()
    yield s
    s.stop()


def test_a_lease_is_its_token_s_own_and_an_admin_breaks_it_logged(srv):
    url, lease = srv.url, f"{srv.url}/v1/checkpoints/ev/1/leases/eval-run-7"
    assert httpx.put(lease, headers=_h(READER), timeout=10).status_code == 200
    # a writer of the run, and another reader, may neither release it nor take it over
    for token in (WRITER, READER2):
        r = httpx.delete(lease, headers=_h(token), timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
        assert "belongs to another token" in r.json()["error"]["message"]
        r = httpx.put(lease, headers=_h(token), timeout=10)
        assert r.status_code == 403, r.text
    # so the checkpoint stays, and says who holds it
    out = _cli(url, WRITER, "rm", "ev/1")
    assert out.returncode == 1 and "leased by client-eval-run-7" in out.stdout, out.stdout + out.stderr
    rec = json.loads((Path(srv.root) / "leases/ev/1/client-eval-run-7.json").read_text())
    assert rec["owner"] == "evaluator"
    # its own token renews and releases it
    assert httpx.put(lease, headers=_h(READER), timeout=10).status_code == 200
    assert httpx.delete(lease, headers=_h(READER), timeout=10).status_code == 204
    assert httpx.delete(lease, headers=_h(READER), timeout=10).status_code == 204  # gone already: done
    # an admin breaks one, and the service logs who broke whose
    assert httpx.put(lease, headers=_h(READER), timeout=10).status_code == 200
    assert httpx.delete(lease, headers=_h(ADMIN), timeout=10).status_code == 204
    assert not (Path(srv.root) / "leases/ev/1/client-eval-run-7.json").exists()
    log = srv.log.read_text()
    assert "read lease eval-run-7 on ev/1 of token evaluator broken by admin ops" in log, log[-2000:]
    # or takes it over
    assert httpx.put(lease, headers=_h(READER), timeout=10).status_code == 200
    assert httpx.put(lease, headers=_h(ADMIN), timeout=10).status_code == 200
    assert "read lease eval-run-7 on ev/1 of token evaluator taken over by admin ops" in srv.log.read_text()
    assert httpx.delete(lease, headers=_h(READER), timeout=10).status_code == 403  # no longer the reader's
    assert httpx.delete(lease, headers=_h(ADMIN), timeout=10).status_code == 204
    assert _cli(url, WRITER, "rm", "ev/1").returncode == 0


def test_one_token_holds_a_bounded_number_of_leases(srv):
    base = f"{srv.url}/v1/checkpoints/ev/2/leases"
    for i in range(3):
        assert httpx.put(f"{base}/cap-{i}", headers=_h(READER2), timeout=10).status_code == 200
    r = httpx.put(f"{base}/cap-3", headers=_h(READER2), timeout=10)
    assert r.status_code == 429 and "CKPTD_READ_LEASES_PER_TOKEN" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["details"]["limit_name"] == "read_leases", r.text  # the limit it met, by name
    counted = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in
               httpx.get(f"{srv.url}/metrics", headers=_h(ADMIN), timeout=10).text.splitlines()
               if line.startswith("ckptd_limit_refusals_total{")}
    assert counted == {"read_leases": 1.0}, counted  # counted as that limit's, not as uploads
    assert not (Path(srv.root) / "leases/ev/2/client-cap-3.json").exists()
    assert httpx.put(f"{base}/cap-0", headers=_h(READER2), timeout=10).status_code == 200  # a renewal is not a new one
    assert httpx.put(f"{base}/other", headers=_h(READER), timeout=10).status_code == 200  # another token's own count
    assert httpx.delete(f"{base}/cap-1", headers=_h(READER2), timeout=10).status_code == 204
    assert httpx.put(f"{base}/cap-3", headers=_h(READER2), timeout=10).status_code == 200
    for h, t in (("cap-0", READER2), ("cap-2", READER2), ("cap-3", READER2), ("other", READER)):
        assert httpx.delete(f"{base}/{h}", headers=_h(t), timeout=10).status_code == 204
    assert _lease_files(Path(srv.root)) == []


def test_looking_at_a_checkpoint_or_failing_to_load_it_leaves_no_lease(srv):
    root = Path(srv.root)
    show = _cli(srv.url, READER, "show", "ev/3")
    assert show.returncode == 0, show.stdout + show.stderr
    assert httpx.get(f"{srv.url}/v1/checkpoints/ev/3", headers=_h(READER), timeout=10).status_code == 200
    assert httpx.get(f"{srv.url}/v1/checkpoints/ev/3/load-tree", headers=_h(READER), timeout=10).status_code == 200
    assert _lease_files(root) == []
    # a load that asks for a key the checkpoint lacks fails, and leaves nothing behind
    with CheckpointClient(srv.url, token=READER) as c:
        with pytest.raises(StateDictMismatch, match="missing"):
            c.load({"w": torch.zeros(8, 8), "extra": torch.zeros(2)}, "ev/3")
        with pytest.raises(StateDictMismatch):  # a shape the checkpoint does not have: after the key check
            c.load({"w": torch.zeros(4, 8)}, "ev/3")
    assert _lease_files(root) == []
    for ref in ("ev/3", "ev/4"):
        out = _cli(srv.url, WRITER, "rm", ref)
        assert out.returncode == 0 and out.stdout.strip() == f"removed {ref}", out.stdout + out.stderr


def test_a_byte_read_that_names_another_token_s_lease_is_leased_on_the_service_s_account(srv):
    lease = f"{srv.url}/v1/checkpoints/ev/5/leases/held-by-evaluator"
    assert httpx.put(lease, headers=_h(READER), timeout=10).status_code == 200
    file = next(iter(httpx.get(f"{srv.url}/v1/checkpoints/ev/5", headers=_h(READER2), timeout=10).json()["files"]))
    r = httpx.get(f"{srv.url}/v1/checkpoints/ev/5/files/{file}",
                  headers={**_h(READER2), "X-Ckptd-Lease": "held-by-evaluator", "Range": "bytes=0-7"}, timeout=10)
    assert r.status_code == 206
    held = {p.name for p in _lease_files(Path(srv.root))}
    assert "client-held-by-evaluator.json" in held and any(n.startswith("reader-") for n in held), held
    rec = json.loads((Path(srv.root) / "leases/ev/5/client-held-by-evaluator.json").read_text())
    assert rec["owner"] == "evaluator"  # the other token's read renewed nothing of it
    assert httpx.delete(lease, headers=_h(READER), timeout=10).status_code == 204


def test_expired_lease_records_go_when_leases_are_read(tmp_path):
    storage = LocalStorage(tmp_path)
    leases = Leases(storage)
    for holder, ttl in (("old", -(EXPIRED_KEPT_SECONDS + 1)), ("just-expired", -1), ("live", 60)):
        storage.put(f"leases/r/c/{holder}.json", json.dumps({"holder": holder, "owner": "ckptd",
                                                              "expires_at": time.time() + ttl}).encode())
    assert leases.active("r", "c") == ["live"]
    names = sorted(p.name for p in (tmp_path / "leases/r/c").iterdir())
    assert names == ["just-expired.json", "live.json"], names  # a late renewal still finds its record
    assert leases.active("r", "c", now=time.time() + EXPIRED_KEPT_SECONDS + 120) == []
    assert sorted(p.name for p in (tmp_path / "leases/r/c").iterdir()) == []
