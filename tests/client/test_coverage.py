"""The collective key check of a distributed load (:mod:`ckptd_client._coverage`), on real gloo ranks and
no service: ``agree_keys`` is called as ``load`` calls it, with each rank's own outcome, the checkpoint
it resolved and the keys it holds.

On three ranks, one after another on the same process group (each call must leave none of them waiting):

* every rank succeeded: the keys that no rank holds are reported, the same on every rank, across the
  byte boundaries of the bitmaps (nine keys); with ``cover`` they fail every rank, naming them;
* one rank failed: that rank raises its own error, every other rank a ``StateDictMismatch`` (or, for
  any other failure, a ``CkptdError``) naming the failing rank;
* the ranks resolved different checkpoints (``RUN/latest`` while a save committed): every rank raises;
* a flag passed true by one rank (the load's "this rank reads over HTTP") comes back true on every rank.

The same checks through a real service and client are in tests/client/test_strict_collective.py.
"""

from __future__ import annotations

from support import run_ranks

KEYS = [f"k{i}" for i in range(9)]  # two bytes of bitmap
CKPT = ("r/1", "s" * 32)


def _outcome(fn) -> dict:
    try:
        n, uncovered, flags = fn()
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return {"type": type(e).__name__, "message": str(e), "details": getattr(e, "details", {})}
    return {"type": None, "ranks": n, "uncovered": uncovered, **({"flags": flags} if flags else {})}


def agree_job(rank: int, world: int) -> list[dict]:
    from ckptd_client._coverage import agree_keys
    from ckptd_schemas import CkptdError, StateDictMismatch

    held = {0: {"k0", "k3"}, 1: {"k1", "k2", "k3", "k8"}, 2: {"k4", "k5", "k6"}}[rank]  # k7: nobody
    everything = held | ({"k7"} if rank == 2 else set())
    mine = StateDictMismatch(f"rank {rank}: key 'x' is not in r/1", rank=rank)
    other = CkptdError(f"rank {rank}: the service answered 503")
    return [
        _outcome(lambda: agree_keys(None, CKPT, KEYS, everything, cover=True)),  # all covered
        _outcome(lambda: agree_keys(None, CKPT, KEYS, held, cover=False)),  # k7 reported
        _outcome(lambda: agree_keys(None, CKPT, KEYS, held, cover=True)),  # k7 fails every rank
        _outcome(lambda: agree_keys(mine if rank == 1 else None, None if rank == 1 else CKPT, KEYS, held,
                                    cover=False)),
        _outcome(lambda: agree_keys(other if rank == 2 else None, None if rank == 2 else CKPT, KEYS, held,
                                    cover=False)),
        _outcome(lambda: agree_keys(None, ("r/2", "t" * 32) if rank == 0 else CKPT, KEYS, held, cover=False)),
        _outcome(lambda: agree_keys(None, CKPT, [], set(), cover=True)),  # a checkpoint without keys
        _outcome(lambda: agree_keys(None, CKPT, KEYS, everything, cover=True, flags=(rank == 2, False))),
    ]


def test_the_ranks_agree_on_keys_and_failures(tmp_path):
    results = [r["result"] for r in run_ranks(agree_job, 3, tmp=tmp_path)]
    covered, reported, refused, mismatch, failure, differ, empty, flagged = zip(*results)

    assert all(o == {"type": None, "ranks": 3, "uncovered": []} for o in covered)
    # flags ride on the same all-reduce: each true on every rank iff some rank passed it true
    assert all(o == {"type": None, "ranks": 3, "uncovered": [], "flags": (True, False)} for o in flagged), flagged
    assert all(o == {"type": None, "ranks": 3, "uncovered": ["k7"]} for o in reported)
    for o in refused:
        assert o["type"] == "StateDictMismatch" and o["details"] == {"missing_on_all_ranks": ["k7"]}
        assert "r/1 has keys that no rank's state_dict holds (checked across 3 ranks): ['k7']" in o["message"]

    assert mismatch[1] == {"type": "StateDictMismatch", "message": "rank 1: key 'x' is not in r/1",
                           "details": {"rank": 1}}  # its own error
    for r in (0, 2):
        assert mismatch[r]["type"] == "StateDictMismatch" and mismatch[r]["details"] == {"rank": 1}
        assert mismatch[r]["message"].startswith("load failed on rank 1 (StateDictMismatch: rank 1: key 'x'")
        assert mismatch[r]["message"].endswith(f"rank {r} stops as well")

    assert failure[2]["type"] == "CkptdError" and failure[2]["message"] == "rank 2: the service answered 503"
    for r in (0, 1):
        assert failure[r]["type"] == "CkptdError" and failure[r]["details"] == {"rank": 2}  # not a mismatch
        assert "load failed on rank 2 (CkptdError: rank 2: the service answered 503)" in failure[r]["message"]

    for o in differ:
        assert o["type"] == "CkptdError" and o["details"] == {"checkpoints": 2}
        assert "the ranks resolved different checkpoints" in o["message"]
    assert all(o == {"type": None, "ranks": 3, "uncovered": []} for o in empty)
