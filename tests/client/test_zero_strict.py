"""Strict loads are collective: a rank may hold any subset of the checkpoint (``ckptd_client._coverage``).

A ZeRO-style flat partition saved at dp=2 and loaded at dp=3: each rank's slice touches only some
parameters, so no rank holds every key; the strict default passes because every rank's keys are in
the checkpoint and the ranks' keys together cover it. A checkpoint key that no rank holds, or a
rank key that the checkpoint lacks, fails on every rank, naming the key. Real gloo ranks, a real
``ckptd serve``.
"""

from __future__ import annotations

from math import prod

import pytest
import torch

from support import run_ranks

pytestmark = pytest.mark.slow

PARAMS = [("l1.weight", (45, 24)), ("l1.bias", (45,)), ("l2.weight", (13, 45)), ("l2.bias", (13,))]
ALIGN = 16


def _global_flat(world: int, seed: int) -> tuple[torch.Tensor, int]:
    """The concatenation of every parameter (each padded with zeros to ALIGN), padded to world slices."""
    from ckptd_client.zero import partition_size

    g = torch.Generator().manual_seed(seed)
    parts = []
    for _, shape in PARAMS:
        n = prod(shape)
        parts += [torch.randn(n, generator=g), torch.zeros(-(-n // ALIGN) * ALIGN - n)]
    part = partition_size([s for _, s in PARAMS], world, ALIGN)
    flat = torch.cat(parts)
    return torch.cat([flat, torch.zeros(world * part - flat.numel())]), part


def _state(rank: int, world: int, params: list, weights: torch.Tensor, moments: torch.Tensor) -> dict:
    from ckptd_client.zero import flat_partition

    return {"model": flat_partition(params, weights, rank=rank, world=world, align=ALIGN),
            "optim": {"exp_avg": flat_partition(params, moments, rank=rank, world=world, align=ALIGN)},
            "step": torch.tensor(7)}


def save_job(rank: int, world: int, url: str) -> list[str]:
    from ckptd_client import CheckpointClient

    weights, part = _global_flat(world, seed=0)
    moments, _ = _global_flat(world, seed=1)
    sl = slice(rank * part, (rank + 1) * part)
    sd = _state(rank, world, PARAMS, weights[sl].clone(), moments[sl].clone())
    with CheckpointClient(url) as c:
        c.save(sd, "zero/7").wait()
    return sorted(sd["model"])


def load_job(rank: int, world: int, url: str, drop: str | None, extra_on: int | None, cover: bool = True) -> dict:
    """Load this rank's dp=``world`` slice (strict default, ``cover``: the ranks together must restore every
    key); compare it with the saved bytes. ``drop``: a parameter no rank holds; ``extra_on``: the rank that
    holds a key the checkpoint lacks."""
    from ckptd_client import CheckpointClient

    _, part = _global_flat(world, seed=0)
    weights, moments = torch.full((part,), -1.0), torch.full((part,), -1.0)
    sd = _state(rank, world, PARAMS, weights, moments)
    if drop is not None:  # no rank restores this parameter
        sd["model"].pop(drop, None)
        sd["optim"]["exp_avg"].pop(drop, None)
    if rank == extra_on:
        sd["model"]["l3.weight"] = torch.zeros(4)
    try:
        with CheckpointClient(url) as c:
            report = c.load(sd, "zero/7", cover=cover)
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return {"type": type(e).__name__, "message": str(e), "details": getattr(e, "details", {})}
    want_w, _ = _global_flat(world, seed=0)
    want_m, _ = _global_flat(world, seed=1)
    sl = slice(rank * part, (rank + 1) * part)
    # the padding between parameters is not part of any parameter: it keeps the buffer's fill value
    pad = torch.ones(world * part, dtype=torch.bool)  # and the dropped parameter: nothing restores it
    cursor = 0
    for name, shape in PARAMS:
        if name != drop:
            pad[cursor:cursor + prod(shape)] = False
        cursor += -(-prod(shape) // ALIGN) * ALIGN
    pad = pad[sl]
    for got, want in ((weights, want_w[sl]), (moments, want_m[sl])):
        assert torch.equal(got[~pad].view(torch.uint8), want[~pad].view(torch.uint8)), f"rank {rank} differs"
        assert bool((got[pad] == -1).all())
    return {"type": None, "tensors": report.tensors, "coverage": report.coverage_ranks,
            "unexpected": report.unexpected, "uncovered": report.uncovered}


def test_zero_partition_saved_at_dp2_loads_strictly_at_dp3(server, tmp_path):
    saved = [r["result"] for r in run_ranks(save_job, 2, server.url, tmp=tmp_path)]
    assert saved[0] == ["l1.weight"]  # at dp=2 too, rank 0's slice touches one parameter
    recs = [r["result"] for r in run_ranks(load_job, 3, server.url, None, None, tmp=tmp_path)]
    assert all(r["type"] is None for r in recs), recs
    assert recs[0]["tensors"] == ["model.l1.weight", "optim.exp_avg.l1.weight", "step"]
    assert "model.l2.bias" in recs[0]["unexpected"]  # not this rank's, and covered by another
    assert all(r["coverage"] == 3 for r in recs)
    restored = set().union(*(r["tensors"] for r in recs))
    assert restored == {f"model.{n}" for n, _ in PARAMS} | {f"optim.exp_avg.{n}" for n, _ in PARAMS} | {"step"}


def test_a_checkpoint_key_no_rank_holds_fails_on_every_rank_when_cover_is_asked(server, tmp_path):
    run_ranks(save_job, 2, server.url, tmp=tmp_path)
    recs = [r["result"] for r in run_ranks(load_job, 3, server.url, "l2.bias", None, tmp=tmp_path)]
    for r in recs:
        assert r["type"] == "StateDictMismatch", r
        assert "no rank's state_dict holds" in r["message"] and "'model.l2.bias'" in r["message"], r
        assert r["details"]["missing_on_all_ranks"] == ["model.l2.bias", "optim.exp_avg.l2.bias"], r
    # by default a subset loads (as with DCP), and every rank's report names what no rank restored
    recs = [r["result"] for r in run_ranks(load_job, 3, server.url, "l2.bias", None, False, tmp=tmp_path)]
    for r in recs:
        assert r["type"] is None and r["coverage"] == 3, r
        assert r["uncovered"] == ["model.l2.bias", "optim.exp_avg.l2.bias"], r


def test_a_rank_key_missing_from_the_checkpoint_fails_on_every_rank(server, tmp_path):
    run_ranks(save_job, 2, server.url, tmp=tmp_path)
    recs = [r["result"] for r in run_ranks(load_job, 3, server.url, None, 1, tmp=tmp_path)]
    assert recs[1]["type"] == "StateDictMismatch" and "'model.l3.weight'" in recs[1]["message"], recs[1]
    for r in (recs[0], recs[2]):
        assert r["type"] == "StateDictMismatch" and "rank 1" in r["message"], r
        assert "'model.l3.weight'" in r["message"], r
