"""Ranks that do not all make the same collective call fail fast, every one, naming what differs.

Step counters that drifted (ranks 0 and 1 save ``drift/10``, rank 2 ``drift/11``), a rank that skips
a save, a rank that loads while the others save, ranks that load different checkpoints, a rank that
saves alone (``solo()``: a world of one) while the others save together: each rank that made the call
raises ``CollectiveMismatch`` naming the call of each group of ranks and the ranks that did not join,
within ``join_seconds`` (before, such jobs hung with no output, leaving sessions open on the service).
No session is left open; a rank that makes its call late raises the same error, and the ranks then save
and load in step again. ``dcp.save`` and ``dcp.load`` with different refs fail on every rank the same
way. Real gloo ranks, a real ``ckptd serve``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support import run_ranks, scaled

WORLD = 3


def _sd(rank: int) -> dict:
    return {"w": torch.arange(6, dtype=torch.float32), "step": 1}  # the same on every rank: a replica


def _outcome(fn) -> dict:
    """What the call raised (type, message, details), or None when it passed."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test reads what each rank raised (DCP's is a BaseException)
        return {"type": type(e).__name__, "message": str(e), "details": getattr(e, "details", {})}
    return {"type": None}


def mismatch_job(rank: int, world: int, url: str, join_seconds: float) -> dict:
    """Each scenario in turn on the same ranks; the ranks are back in step after each."""
    import torch.distributed as dist

    from ckptd_client import CheckpointClient, solo

    out: dict = {}
    wait_s = scaled(120)
    with CheckpointClient(url, join_seconds=join_seconds, retry_seconds=5) as c:
        c.save(_sd(rank), "drift/1").wait(timeout=wait_s)
        # step counters that drifted: rank 2 one step ahead
        out["refs"] = _outcome(lambda: c.save(_sd(rank), "drift/11" if rank == 2 else "drift/10").wait(timeout=wait_s))
        # rank 2 skips a save; once the others gave up, it makes that call late
        if rank != 2:
            out["skipped"] = _outcome(lambda: c.save(_sd(rank), "drift/12").wait(timeout=wait_s))
        dist.barrier()
        if rank == 2:
            out["skipped"] = _outcome(lambda: c.save(_sd(rank), "drift/12").wait(timeout=wait_s))
        # a load beside two saves
        sd = {"w": torch.zeros(6), "step": 0}
        out["calls"] = _outcome(lambda: c.load(sd, "drift/1") if rank == 0 else c.save(_sd(rank), "drift/13"))
        # loads of different checkpoints
        out["loads"] = _outcome(lambda: c.load(sd, "drift/1" if rank != 1 else "drift/latest"))
        # in step again: a save and a load pass
        out["again"] = _outcome(lambda: c.save(_sd(rank), "drift/14").wait(timeout=wait_s))
        out["again_load"] = _outcome(lambda: c.load(sd, "drift/14"))
        out["again_equal"] = torch.equal(sd["w"], torch.arange(6, dtype=torch.float32))
        # rank 0 saves alone, a world of one, while the others save together (last: out of step after)
        def alone() -> None:
            with solo():
                c.save(_sd(rank), "drift/15").wait(timeout=wait_s)
        out["world"] = _outcome(alone if rank == 0 else lambda: c.save(_sd(rank), "drift/15").wait(timeout=wait_s))
    return out


def _open_sessions(server, run: str) -> list:
    """Upload sessions of the run left on the service: those of checkpoints not committed (the service's
    live uploads page), and any beside the one a committed checkpoint was committed from (its root)."""
    import httpx

    items = httpx.get(f"{server.url}/v1/ui/runs/{run}/uploads", timeout=30).json()["items"]
    beside = [d.name for d in Path(server.root).glob(f"runs/{run}/*")
              if (d / "COMMITTED").exists() and len(list((d / "sessions").iterdir())) != 1]
    return items + beside


@pytest.mark.slow  # several seconds: with the slow tests, so the default run stays within its budget
def test_ranks_that_make_different_calls_fail_fast_on_every_rank_naming_what_differs(server, tmp_path):
    from ckptd_client import CheckpointClient
    from ckptd_schemas import CheckpointNotFound

    recs = [r["result"] for r in run_ranks(mismatch_job, WORLD, server.url, scaled(10), tmp=tmp_path, timeout=200)]
    for r, rec in enumerate(recs):
        for case in ("refs", "skipped", "calls", "loads"):
            assert rec[case]["type"] == "CollectiveMismatch", (r, case, rec[case])
        assert "ranks 0,1 save drift/10, rank 2 save drift/11" in rec["refs"]["message"], (r, rec["refs"])
        assert rec["refs"]["details"]["calls"] == {"save drift/10": [0, 1], "save drift/11": [2]}, rec["refs"]
        assert "ranks 0,1 save drift/12; rank 2 did not join" in rec["skipped"]["message"], (r, rec["skipped"])
        assert rec["skipped"]["details"]["missing"] == [2], (r, rec["skipped"])
        assert "ranks 1,2 save drift/13, rank 0 load drift/1" in rec["calls"]["message"], (r, rec["calls"])
        assert "ranks 0,2 load drift/1, rank 1 load drift/latest" in rec["loads"]["message"], (r, rec["loads"])
        assert rec["again"]["type"] is None and rec["again_load"]["type"] is None, (r, rec["again"], rec["again_load"])
        assert rec["again_equal"], r
    assert "after the others had stopped waiting" in recs[2]["skipped"]["message"], recs[2]["skipped"]
    # the rank that saved alone committed its world of one; the others named it as not joining
    assert recs[0]["world"]["type"] is None, recs[0]["world"]
    for r in (1, 2):
        assert recs[r]["world"]["type"] == "CollectiveMismatch", (r, recs[r]["world"])
        assert "ranks 1,2 save drift/15; rank 0 did not join" in recs[r]["world"]["message"], recs[r]["world"]
    assert _open_sessions(server, "drift") == []
    with CheckpointClient(server.url) as c:
        for name in ("10", "11", "12", "13"):
            with pytest.raises(CheckpointNotFound):
                c.manifest(f"drift/{name}")
        assert c.manifest("drift/14").topology.world_size == WORLD


def dcp_job(rank: int, world: int, url: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from ckptd_client import CheckpointClient

    out: dict = {}
    with CheckpointClient(url) as c:
        sd = {"w": torch.arange(4, dtype=torch.float32)}
        out["save"] = _outcome(lambda: dcp.save(sd, storage_writer=c.dcp_writer(f"dcpdrift/{10 + rank}")))
        dcp.save(sd, storage_writer=c.dcp_writer("dcpdrift/1"))
        back = {"w": torch.zeros(4)}
        out["load"] = _outcome(lambda: dcp.load(back, storage_reader=c.dcp_reader(
            "dcpdrift/1" if rank == 0 else "dcpdrift/latest")))
        dcp.load(back, storage_reader=c.dcp_reader("dcpdrift/1"))
        out["equal"] = torch.equal(back["w"], sd["w"])
    return out


def test_dcp_save_and_load_with_different_refs_fail_on_every_rank(server, tmp_path):
    from ckptd_client import CheckpointClient
    from ckptd_schemas import CheckpointNotFound

    recs = [r["result"] for r in run_ranks(dcp_job, 2, server.url, tmp=tmp_path, timeout=240)]
    for r, rec in enumerate(recs):
        for case, said in (("save", "rank 0 save dcpdrift/10, rank 1 save dcpdrift/11"),
                           ("load", "rank 0 load dcpdrift/1, rank 1 load dcpdrift/latest")):
            assert rec[case]["type"] is not None, (r, case)
            assert "CollectiveMismatch" in rec[case]["message"] and said in rec[case]["message"], (r, case, rec[case])
        assert rec["equal"], r
    assert _open_sessions(server, "dcpdrift") == []
    with CheckpointClient(server.url) as c:
        for name in ("10", "11"):
            with pytest.raises(CheckpointNotFound):
                c.manifest(f"dcpdrift/{name}")


def test_rank_lists_and_the_sentence_stay_short():
    """The error names ranks as runs, the largest groups first, and stays a sentence at any world size."""
    from ckptd_client._join import mismatch, rank_list

    assert rank_list([2]) == "rank 2"
    assert rank_list([1, 0]) == "ranks 0,1"
    assert rank_list([0, 1, 2, 3, 5, 7, 8, 9]) == "ranks 0-3,5,7-9"
    huge = rank_list(range(0, 200_000, 2))
    assert huge.endswith(",... (100000 ranks)") and len(huge) < 200, huge
    calls = {f"save gpt/{i}": [i] for i in range(20)} | {"save gpt/100": list(range(20, 10_020))}
    said = mismatch(calls, missing=range(10_020, 10_024), waited=60).message
    assert said.startswith("the ranks do not make the same collective call: ranks 20-10019 save gpt/100, "
                           "rank 0 save gpt/0"), said
    assert "and 13 other calls; ranks 10020-10023 did not join within 60 s" in said and len(said) < 400, said
    err = mismatch(calls, missing=range(10_020, 10_100), waited=60)
    assert type(err).__name__ == "CollectiveMismatch" and err.code == "collective_mismatch"
    assert len(err.details["calls"]["save gpt/100"]) == 64 and err.details["missing_count"] == 80
