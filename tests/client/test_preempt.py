"""Preemption: a SIGTERM to one rank makes every rank save the same step and commit it; a deadline
that cannot be met leaves the previous checkpoint as the latest, loadable one."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ckptd_client import CheckpointClient, PreemptionGuard
from ckptd_schemas import Unavailable

from support import assert_bits_equal, blank_like, make_state, run_ranks

pytestmark = pytest.mark.slow


def _state(rank: int, step: int) -> dict:
    sd = make_state(7)  # replicated tensors (written once, balanced over ranks), a new value each step
    sd["model"]["w"] += step
    return {"model": sd["model"]}


def _train(rank: int, world: int, url: str, run: str, signal_at: int, signalled: int, deadline: float,
           late: float) -> dict:
    client = CheckpointClient(url)
    client.save(_state(rank, 0), f"{run}/0").wait()  # the last good checkpoint before preemption
    out: dict = {"saved": None, "error": None}
    with PreemptionGuard(deadline=deadline) as guard:
        for step in range(1, 50):
            time.sleep(0.02)  # a training step
            if rank == signalled and step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler signals this rank only
                time.sleep(late)  # and the loop takes this long to reach the next boundary
            if guard.should_save():
                out["step"], out["signal"] = step, guard.received
                try:
                    guard.save(client, _state(rank, step), f"{run}/{step}")
                    out["saved"] = step
                except Unavailable as e:
                    out["error"] = e.message
                break
    client.close(wait=False)
    return out


def test_a_signal_to_one_rank_saves_the_same_step_on_every_rank(server, tmp_path):
    srv = server
    if True:
        recs = run_ranks(_train, 3, srv.url, "pre", 4, 1, 60.0, 0.0, tmp=tmp_path)
        outs = [r["result"] for r in recs]
        assert [o["saved"] for o in outs] == [4, 4, 4], outs
        assert outs[1]["signal"] == signal.SIGTERM and outs[0]["signal"] is None
        client = CheckpointClient(srv.url)
        assert client.manifest("pre/latest").ref == "pre/4"
        want = _state(0, 4)
        got = blank_like(want)
        client.load(got, "pre/latest")
        assert_bits_equal(got, want)


def test_a_missed_deadline_leaves_the_previous_checkpoint_latest(server, tmp_path):
    srv = server
    if True:
        # rank 2 is signalled and reaches a step boundary only after its deadline: no rank starts a
        # save that cannot finish in time (they agree on the time left), the ranks are not left blocked
        recs = run_ranks(_train, 3, srv.url, "late", 2, 2, 1.0, 1.5, tmp=tmp_path)
        outs = [r["result"] for r in recs]
        assert all(o["saved"] is None and "deadline" in o["error"] and "untouched" in o["error"] for o in outs), outs
        client = CheckpointClient(srv.url)
        assert [c.name for c in client.list_checkpoints("late")] == ["0"]
        want = _state(0, 0)
        got = blank_like(want)
        client.load(got, "late/latest")
        assert_bits_equal(got, want)
