"""Preemption: a SIGTERM to one rank makes every rank save the same step and commit it; a deadline
that cannot be met leaves the previous checkpoint as the latest, loadable one (slow: real gloo ranks).

The guard alone (:mod:`ckptd_client.preempt`, one process, no process group), fast:

* its handlers are installed for the block and the previous ones restored after it; a signal is only
  recorded (the first one: a second does not move its time), and ``should_save`` answers it at a
  step boundary, only every ``every``-th call (``every`` below 1 counts as 1);
* ``remaining`` is the whole deadline until a signal, less the time since one after it; a save that
  would begin with no time left raises ``Unavailable`` before it sends anything;
* with time left, ``save`` saves through the client and returns the committed status.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from ckptd_client import CheckpointClient, PreemptionGuard
from ckptd_client.preempt import PreemptionGuard as ModuleGuard
from ckptd_schemas import Unavailable

from support import assert_bits_equal, blank_like, make_state, run_ranks, scaled


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


@pytest.mark.slow
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


@pytest.mark.slow
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


# -- the guard in one process ------------------------------------------------------------------------------------

def _signal_self(signum: int) -> None:
    """Deliver ``signum`` to this process and let its Python handler run (between two bytecodes)."""
    os.kill(os.getpid(), signum)
    for _ in range(100):
        time.sleep(0.001)


def test_the_guard_is_what_the_package_exports():
    assert PreemptionGuard is ModuleGuard


def test_handlers_are_installed_for_the_block_and_restored_after():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    with ModuleGuard() as guard:
        for s in (signal.SIGTERM, signal.SIGUSR1):
            assert signal.getsignal(s) == guard._on_signal
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_is_recorded_and_answered_at_the_next_boundary():
    with ModuleGuard(signals=(signal.SIGUSR1, signal.SIGUSR2), deadline=30.0) as guard:
        assert guard.should_save() is False and guard.received is None
        assert guard.remaining() == 30.0  # the whole deadline before any signal
        _signal_self(signal.SIGUSR2)
        assert guard.received == signal.SIGUSR2  # recorded by the handler, nothing else done
        first_at = guard.remaining()
        assert 0 < first_at <= 30.0
        _signal_self(signal.SIGUSR1)  # a second signal: the first one's number and time stay
        assert guard.received == signal.SIGUSR2
        assert guard.should_save() is True and guard.should_save() is True
        assert guard.remaining() <= first_at


def test_should_save_asks_only_every_nth_call():
    with ModuleGuard(signals=(signal.SIGUSR1,), every=3) as guard:
        _signal_self(signal.SIGUSR1)
        assert [guard.should_save() for _ in range(6)] == [False, False, True, False, False, True]
    with ModuleGuard(signals=(signal.SIGUSR1,), every=0) as guard:  # below 1: every call
        _signal_self(signal.SIGUSR1)
        assert [guard.should_save() for _ in range(2)] == [True, True]


def test_a_save_with_no_time_left_is_refused_before_anything_is_sent():
    # a client of a port nothing listens on: a save that began would fail otherwise than named here
    client = CheckpointClient("http://127.0.0.1:9", retry_seconds=0.0)
    try:
        with ModuleGuard(signals=(signal.SIGUSR1,), deadline=0.0) as guard:
            _signal_self(signal.SIGUSR1)
            assert guard.should_save() and guard.remaining() <= 0
            with pytest.raises(Unavailable) as info:
                guard.save(client, make_state(1, mib=0.01), "pre/3", step=3)
        assert "deadline of 0 s passed before the save of pre/3 could begin" in info.value.message
        assert "previous checkpoint is untouched" in info.value.message and info.value.details == {"ref": "pre/3"}
    finally:
        client.close(wait=False)


def test_a_save_with_time_left_commits_and_returns_its_status(server):
    with CheckpointClient(server.url) as client:
        with ModuleGuard(signals=(signal.SIGUSR1,), deadline=scaled(120.0)) as guard:
            _signal_self(signal.SIGUSR1)
            assert guard.should_save()
            st = guard.save(client, make_state(2, mib=0.01), "pre/5", step=5)
        assert st.state == "committed" and st.manifest_xxh3
        assert client.manifest("pre/latest").ref == "pre/5"
