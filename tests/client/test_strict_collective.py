"""Strictness is collective, and a refusal reaches every rank.

``load(strict=True)`` (the default) on several ranks: every key of every rank must exist in the
checkpoint; a rank may hold any subset, and the ranks together may restore a subset of the checkpoint
(reported as ``uncovered``). A key the checkpoint lacks raises ``StateDictMismatch`` on every rank
naming the key, and with ``cover=True`` so does a checkpoint key that no rank asks for (a tensor or an
object); no rank is left waiting, and the same ranks load again afterwards. ``strict=False`` loads
what matches and reports the rest.

``save`` of a state dict that no checkpoint can hold (a sparse tensor, a sub-byte dtype), or of an
object only an unrestricted unpickler rebuilds, on one rank: every rank raises, the others naming
that rank and key, and nothing is committed. Real gloo ranks, a real ``ckptd serve``.
"""

from __future__ import annotations

import pytest
import torch

from support import run_ranks


def _values() -> dict:
    g = torch.Generator().manual_seed(4)
    return {"a": torch.randn(5, 3, generator=g), "b": torch.randint(0, 9, (7,), generator=g),
            "c": torch.randn(4, generator=g).bfloat16(), "dt": torch.randn(9, 2, generator=g)}


def save_job(rank: int, world: int, url: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptd_client import CheckpointClient

    v = _values()
    mesh = init_device_mesh("cpu", (world,))
    sd = {"a": v["a"], "b": v["b"], "c": v["c"], "dt": distribute_tensor(v["dt"], mesh, [Shard(0)]),
          "meta": {"epoch": 3, "name": "run"}}
    with CheckpointClient(url) as c:
        c.save(sd, "strict/1").wait()


def _attempt(c, sd: dict, strict: bool = True, cover: bool = True) -> dict:
    try:
        report = c.load(sd, "strict/1", strict=strict, cover=cover)
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return {"type": type(e).__name__, "message": str(e), "details": getattr(e, "details", {})}
    return {"type": None, "tensors": report.tensors, "objects": report.objects, "missing": report.missing,
            "unexpected": report.unexpected, "coverage": report.coverage_ranks, "uncovered": report.uncovered}


def load_job(rank: int, world: int, url: str) -> dict:
    """Several loads in a row on the same 3 ranks, each from a different key set."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptd_client import CheckpointClient

    v = _values()
    mesh = init_device_mesh("cpu", (world,))

    def subset(tensors: list[str], objects: bool) -> dict:
        sd: dict = {k: torch.zeros_like(v[k]) for k in tensors if k != "dt"}
        if "dt" in tensors:
            sd["dt"] = distribute_tensor(torch.zeros_like(v["dt"]), mesh, [Shard(0)])
        if objects:
            sd["meta"] = {"epoch": 0, "name": ""}
        return sd

    mine = {0: ["a", "dt"], 1: ["b", "dt"], 2: ["c", "dt"]}[rank]  # each rank a subset, together all
    out = {}
    with CheckpointClient(url) as c:
        sd = subset(mine, objects=rank == 0)
        out["subsets"] = _attempt(c, sd)
        out["subsets_equal"] = all(torch.equal(sd[k] if k != "dt" else sd[k].full_tensor(), v[k]) for k in mine) \
            and (rank != 0 or sd["meta"] == {"epoch": 3, "name": "run"})
        extra = subset(mine, objects=rank == 0)
        if rank == 2:
            extra["zzz"] = torch.zeros(2)  # not in the checkpoint
        out["absent_key"] = _attempt(c, extra)
        out["unrequested_tensor"] = _attempt(c, subset([k for k in mine if k != "b"], objects=rank == 0))
        out["unrequested_object"] = _attempt(c, subset(mine, objects=False))
        out["subset_by_default"] = _attempt(c, subset([k for k in mine if k != "b"], objects=False), cover=False)
        loose = subset([k for k in mine if k != "b"], objects=False)
        if rank == 2:
            loose["zzz"] = torch.zeros(2)
        out["not_strict"] = _attempt(c, loose, strict=False, cover=False)
        out["not_strict_equal"] = all(torch.equal(loose[k] if k != "dt" else loose[k].full_tensor(), v[k])
                                      for k in mine if k != "b")
        out["again"] = _attempt(c, subset(mine, objects=rank == 1))  # the ranks are still in step
    return out


def test_strict_load_is_collective_and_names_the_key_on_every_rank(server, tmp_path):
    run_ranks(save_job, 2, server.url, tmp=tmp_path)
    recs = [r["result"] for r in run_ranks(load_job, 3, server.url, tmp=tmp_path, timeout=120)]
    for r, rec in enumerate(recs):
        assert rec["subsets"]["type"] is None and rec["subsets"]["coverage"] == 3, (r, rec["subsets"])
        assert rec["subsets_equal"], r
        assert rec["again"]["type"] is None, (r, rec["again"])
        # a key no rank asks for, tensor or object: every rank, naming it
        for case, key in (("unrequested_tensor", "'b'"), ("unrequested_object", "'meta.epoch'")):
            assert rec[case]["type"] == "StateDictMismatch" and key in rec[case]["message"], (r, case, rec[case])
        # without cover (the default) the same subset loads, and every rank learns what no rank restored
        sd_ = rec["subset_by_default"]
        assert sd_["type"] is None and sd_["coverage"] == 3, (r, sd_)
        assert sd_["uncovered"] == ["b", "meta.epoch", "meta.name"], (r, sd_)
        # a key one rank asks for that the checkpoint lacks: every rank, naming the key (the others: the rank too)
        assert rec["absent_key"]["type"] == "StateDictMismatch", (r, rec["absent_key"])
        assert "'zzz'" in rec["absent_key"]["message"], (r, rec["absent_key"])
        if r != 2:
            assert "rank 2" in rec["absent_key"]["message"], (r, rec["absent_key"])
        # not strict: what matches is loaded, the rest reported
        ns = rec["not_strict"]
        assert ns["type"] is None and rec["not_strict_equal"], (r, ns)
        assert "b" in ns["unexpected"] and "meta.epoch" in ns["unexpected"], (r, ns)
        assert ns["missing"] == (["zzz"] if r == 2 else []), (r, ns)
    assert recs[0]["unrequested_object"]["details"]["missing_on_all_ranks"] == ["meta.epoch", "meta.name"]


CASES = ["sparse", "uint4", "meta", "object"]


class _Unpicklable:
    """An object only an unrestricted unpickler can rebuild (not on any allow-list)."""


def refused_save_job(rank: int, world: int, url: str) -> dict:
    """One save per case, in a row on the same ranks: rank 1 holds what cannot be saved under ``bad``."""
    from ckptd_client import CheckpointClient

    out = {}
    with CheckpointClient(url, retry_seconds=5) as c:
        for case in CASES:
            sd = {"w": torch.ones(4), "step": 1}
            if rank == 1:
                sd["bad"] = {"sparse": lambda: torch.eye(3).to_sparse(),
                             "uint4": lambda: torch.zeros(4, dtype=torch.uint8).view(torch.uint4),
                             "meta": lambda: torch.empty(3, device="meta"), "object": _Unpicklable}[case]()
            try:
                c.save(sd, f"refused-{case}/1").wait(timeout=60)
                out[case] = {"type": None}
            except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
                out[case] = {"type": type(e).__name__, "base": [k.__name__ for k in type(e).__mro__],
                             "message": str(e)}
        c.save({"w": torch.ones(4), "step": 1}, "refused-after/1").wait(timeout=60)  # the ranks are in step
    return out


def test_a_state_dict_one_rank_cannot_save_fails_every_rank_naming_the_key(server, tmp_path):
    from ckptd_client import CheckpointClient
    from ckptd_schemas import CheckpointNotFound

    recs = [r["result"] for r in run_ranks(refused_save_job, 2, server.url, tmp=tmp_path, timeout=180)]
    for case in CASES:
        for r, rec in enumerate(recs):
            assert rec[case]["type"] is not None and "CkptdError" in rec[case]["base"], (case, r, rec[case])
            assert "'bad'" in rec[case]["message"], (case, r, rec[case])
        assert "rank 1" in recs[0][case]["message"], (case, recs[0][case])
        with CheckpointClient(server.url) as c, pytest.raises(CheckpointNotFound):
            c.manifest(f"refused-{case}/1")
