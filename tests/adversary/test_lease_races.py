"""Leases raced against deletion through the public surface: a lease answered 200 protects its
checkpoint, whatever it races with, and ``rm`` says truly what it did (docs/retention.md, Leases and
deletion; the rule is ``ckptd.store.leases``).

An attacker fires ``PUT .../leases/HOLDER`` and ``DELETE /v1/checkpoints/RUN/NAME`` (``ckptd rm``) at
the same checkpoint at the same moment, round after round (the start order jittered), and, in the
other test, leases a whole run's checkpoints while ``POST /v1/runs/RUN/gc`` collects it. After each
round: every lease answered 200 leaves its checkpoint loadable (a real load through the client) until
it is released; no ``rm`` answered ``removed`` for a checkpoint a lease answered 200 for; every
``rm`` answer is true of the root afterwards (removed: gone; 409 ``checkpoint_leased``: there, and
the lease it names answered 200; 404: gone). ``CKPTD_LEASE_RACE_ROUNDS`` sets the rounds (the slow
test runs 1,000 of rm and 100 of gc).
"""

from __future__ import annotations

import os
import random
import threading
import time

import httpx
import pytest
import torch

from ckptd_client import CheckpointClient
from ckptd_schemas import CheckpointLeased, error_from_body
from support import ServerProcess, blank_like, scaled

ROUNDS = int(os.environ.get("CKPTD_LEASE_RACE_ROUNDS") or 150)
NEWEST = 10**6  # a step above every round's


def _state(i: int) -> dict:
    return {"w": torch.full((4,), float(i))}


def _save(url: str, run: str, names: list[str]) -> None:
    with CheckpointClient(url, incremental=False) as c:
        for n in names:
            c.save(_state(int(n)), f"{run}/{n}").wait()


def _loadable(url: str, run: str, name: str) -> bool:
    got = blank_like(_state(0))
    with CheckpointClient(url) as c:
        c.load(got, f"{run}/{name}")
    return bool(torch.equal(got["w"], _state(int(name))["w"]))


def _race(calls, spread: float) -> tuple[list, float]:
    """Run the calls at once, released by one barrier, each but the last after a random delay of up to
    ``spread`` seconds (the last, the deletion, at once: a lease then lands anywhere in its work); the
    answers, and how long the last one took."""
    out: list = [None] * len(calls)
    took = [0.0]
    go = threading.Barrier(len(calls))

    def one(i: int) -> None:
        go.wait()
        if i < len(calls) - 1:
            time.sleep(random.random() * spread)
        t0 = time.monotonic()
        out[i] = calls[i]()
        if i == len(calls) - 1:
            took[0] = time.monotonic() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(120))
    return out, took[0]


def _rm_against_lease(tmp_path, rounds: int) -> None:
    s = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": "600"}).start()
    try:
        _save(s.url, "race", [str(NEWEST)])  # the newest: retention keeps it, the older ones are fair game
        tally: dict[str, int] = {}
        spread = 0.02
        with httpx.Client(base_url=s.url, timeout=scaled(60)) as lessee, \
                httpx.Client(base_url=s.url, timeout=scaled(60)) as remover, \
                CheckpointClient(s.url, incremental=False) as saver:
            for name in (str(i) for i in range(1, rounds + 1)):
                saver.save(_state(int(name)), f"race/{name}").wait()  # one at a time: the run stays small
                (lease, rm), took = _race([lambda: lessee.put(f"/v1/checkpoints/race/{name}/leases/r{name}"),
                                           lambda: remover.delete(f"/v1/checkpoints/race/{name}")], spread)
                spread = 0.8 * spread + 0.2 * took * 1.5  # the lease lands anywhere in the rm's work
                there = remover.get(f"/v1/checkpoints/race/{name}").status_code
                key = f"lease {lease.status_code}, rm {rm.status_code}"
                tally[key] = tally.get(key, 0) + 1
                assert lease.status_code in (200, 404, 409), lease.text
                if lease.status_code == 200:  # granted: the checkpoint stays, loadable, until released
                    assert there == 200, f"round {name}: lease answered 200 ({lease.text}), then rm: {rm.text}"
                    assert _loadable(s.url, "race", name), name
                if rm.status_code == 200:
                    assert rm.json() == {"ref": f"race/{name}", "removed": True, "reason": "removed"}, rm.text
                    assert there == 404 and lease.status_code != 200, (name, lease.text, rm.text)
                elif rm.status_code == 409:
                    err = error_from_body(rm.json(), 409)
                    assert type(err) is CheckpointLeased and f"client-r{name}" in err.message, rm.text
                    assert err.details["holders"] == [f"client-r{name}"], err.details
                    assert there == 200 and lease.status_code == 200, (name, lease.text, rm.text)
                else:
                    raise AssertionError(f"round {name}: rm answered {rm.status_code}: {rm.text}")
                if lease.status_code == 200:  # released: now rm goes, and says so
                    assert lessee.delete(f"/v1/checkpoints/race/{name}/leases/r{name}").status_code == 204
                    again = remover.delete(f"/v1/checkpoints/race/{name}")
                    assert again.status_code == 200 and again.json()["removed"] is True, again.text
                gone = remover.delete(f"/v1/checkpoints/race/{name}")  # gone already: says so
                assert gone.status_code == 404 and gone.json()["error"]["code"] == "checkpoint_not_found", gone.text
        print(f"{rounds} rounds of a lease against rm: {tally}")
    finally:
        s.stop()


def _gc_against_leases(tmp_path, rounds: int, per_round: int = 8) -> None:
    s = ServerProcess(tmp_path / "root", env={"CKPTD_READ_LEASE_SECONDS": "600"}).start()
    try:
        held_total = deleted_total = 0
        spread = 0.05
        with httpx.Client(base_url=s.url, timeout=scaled(60)) as h:
            for r in range(rounds):
                names = [str(r * per_round + i) for i in range(1, per_round + 1)]
                _save(s.url, "gcrace", names)
                calls = [lambda n=n: h.put(f"/v1/checkpoints/gcrace/{n}/leases/g{n}") for n in names[:-1]]
                (*leases, gc), took = _race([*calls, lambda: h.post("/v1/runs/gcrace/gc", json={"keep_last": 1})],
                                            spread)
                spread = 0.5 * spread + 0.5 * took * 1.5
                assert gc.status_code == 200, gc.text
                plan = gc.json()
                for n, lease in zip(names, leases):
                    there = h.get(f"/v1/checkpoints/gcrace/{n}").status_code
                    assert lease.status_code in (200, 404, 409), lease.text
                    if lease.status_code == 200:
                        assert n not in plan["deleted"] and there == 200, (n, lease.text, plan)
                        assert _loadable(s.url, "gcrace", n), n
                        assert h.delete(f"/v1/checkpoints/gcrace/{n}/leases/g{n}").status_code == 204
                        held_total += 1
                    if n in plan["deleted"]:
                        assert there == 404, (n, plan)
                        deleted_total += 1
                    elif plan["keep"].get(n, "").startswith("leased"):
                        assert lease.status_code == 200 and f"client-g{n}" in plan["keep"][n], (n, lease.text, plan)
        print(f"{rounds} rounds of leases against gc: {held_total} leases held, {deleted_total} deleted")
    finally:
        s.stop()


def test_a_lease_answered_200_survives_rm_raced_against_it(tmp_path):
    _rm_against_lease(tmp_path, ROUNDS)


def test_a_lease_answered_200_survives_gc_raced_against_it(tmp_path):
    _gc_against_leases(tmp_path, max(ROUNDS // 15, 4))


@pytest.mark.slow
@pytest.mark.timeout(scaled(1800))
def test_a_thousand_leases_raced_against_rm_and_a_hundred_against_gc(tmp_path):
    _rm_against_lease(tmp_path / "rm", max(ROUNDS, 1000))
    _gc_against_leases(tmp_path / "gc", max(ROUNDS // 10, 100))
