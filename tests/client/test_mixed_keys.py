"""Plain tensors whose keys differ between ranks (pipeline stages): saved, and loaded at any world size.

Each rank of a pipeline holds its own layers and their optimizer state, plus keys every stage
holds (the step). The writer of each plain tensor is agreed among the ranks that hold it
(``ckptd_client._saveplan``): one collective, run again only when some rank's plain tensors change.
Real gloo ranks save through a real ``ckptd serve``; ranks at world sizes 1, 2 and 3 load the
checkpoint back (at 3, ranks restore keys another rank wrote) bit for bit.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd_schemas.balance import lpt_assign
from support import run_ranks

N_LAYERS = 4
STAGES = {1: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]], 3: [[0], [1, 2], [3]]}
LR = 1e-2


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_each_replica_is_written_by_one_of_its_holders(data):
    world = data.draw(st.integers(1, 6))
    keys = [f"t{i}" for i in range(data.draw(st.integers(0, 15)))]
    sizes = {k: data.draw(st.integers(0, 1000)) for k in keys}
    holders = {k: data.draw(st.lists(st.integers(0, world - 1), min_size=1, unique=True)) for k in keys}
    owner = lpt_assign(list(sizes.items()), world, holders=holders)
    assert set(owner) == set(keys) and all(owner[k] in holders[k] for k in keys)
    everyone = {k: list(range(world)) for k in keys}
    assert lpt_assign(list(sizes.items()), world, holders=everyone) == lpt_assign(list(sizes.items()), world)


def _stage(layers: list[int], seed: int) -> torch.nn.Module:
    """The pipeline stage holding ``layers`` of a 4-layer model (layer i: Linear(6+i, 5+i))."""
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(6 + i, 5 + i) for i in range(N_LAYERS)})
    for i in range(N_LAYERS):
        if i not in layers:
            del m.layers[str(i)]
    return m


def _state(m: torch.nn.Module, opt: torch.optim.Optimizer, step: int, flat_optim: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flat_optim)
    return {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt, options=options),
            "step": torch.tensor(step), "epoch": 3}


def _flat(sd: dict) -> dict:
    from ckptd_client._flatten import flatten

    return {leaf.fqn: leaf.value.detach().clone() if isinstance(leaf.value, torch.Tensor) else leaf.value
            for leaf in flatten(sd).leaves}


def save_job(rank: int, world: int, url: str) -> dict:
    """Train this rank's stage a few steps (each layer on its own inputs), save in two formats."""
    import torch.distributed.checkpoint as dcp

    from ckptd_client import CheckpointClient

    m = _stage(STAGES[world][rank], seed=0)
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    for step in range(3):
        loss = sum(layer(torch.randn(4, 6 + int(i), generator=torch.Generator().manual_seed(100 * step + int(i))))
                   .pow(2).sum() for i, layer in m.layers.items())
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = {}
    with CheckpointClient(url) as c:
        for fmt, flat_optim in (("flat", True), ("nested", False)):
            sd = _state(m, opt, 3, flat_optim)
            c.save(sd, f"pp-{fmt}/3").wait()
            out[fmt] = _flat(sd)
        # DCP's own planner on top of ckptd's storage writer: replicas are deduplicated among holders too
        dcp.save(_state(m, opt, 3, True), storage_writer=c.dcp_writer("pp-dcp/3"))
    return out


def load_job(rank: int, world: int, url: str, ref: str, flat_optim: bool, expected: dict | list[dict],
             dcp_reader: bool) -> dict:
    """A fresh stage (other weights, another learning rate): load, compare every leaf bit for bit
    with ``expected`` (one dict for every rank, or one per rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from ckptd_client import CheckpointClient

    m = _stage(STAGES[world][rank], seed=1 + rank)
    opt = torch.optim.Adam(m.parameters(), lr=0.5)
    sd = _state(m, opt, 0, flat_optim)
    with CheckpointClient(url) as c:
        if dcp_reader:
            dcp.load(sd, storage_reader=c.dcp_reader(ref))
            report = None
        else:
            report = c.load(sd, ref)
    got = _flat(sd)
    expected = expected[rank] if isinstance(expected, list) else expected
    for k, v in got.items():
        want = expected[k]
        if isinstance(want, torch.Tensor):
            assert v.dtype == want.dtype and v.shape == want.shape, k
            assert torch.equal(v.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), \
                f"{k} differs on rank {rank} of {world}"
        else:
            assert v == want, f"{k}: {v!r} != {want!r} on rank {rank} of {world}"
    set_optimizer_state_dict(m, opt, sd["optim"], options=StateDictOptions(flatten_optimizer_state_dict=flat_optim))
    assert all(g["lr"] == LR for g in opt.param_groups)
    return {"keys": sorted(got), "coverage": None if report is None else report.coverage_ranks}


def _union(records: list[dict], fmt: str) -> dict:
    out: dict = {}
    for rec in records:
        for k, v in rec["result"][fmt].items():
            if k in out and isinstance(v, torch.Tensor):
                assert torch.equal(out[k], v), f"{k} differs between ranks"
            out[k] = v
    return out


@pytest.mark.slow
def test_pipeline_stages_save_and_load_at_1_2_and_3_ranks(server, tmp_path):
    from ckptd_client import CheckpointClient

    saved = run_ranks(save_job, 2, server.url, tmp=tmp_path)
    flat, nested = _union(saved, "flat"), [rec["result"]["nested"] for rec in saved]
    with CheckpointClient(server.url) as c:
        m = c.manifest("pp-flat/3")
        step = m.tensor("step")
        assert len(step.chunks) == 1  # held by both stages, written by one
        for t in m.tensors:
            if t.name.startswith("model.layers."):
                layer = int(t.name.split(".")[2])
                assert [ch.rank for ch in t.chunks] == [layer // 2], t.name  # written by the stage holding it
        pg = c.manifest("pp-nested/3").param_groups
        assert len(pg) == 1 and pg[0].params == [f"layers.{i}.{p}" for i in range(N_LAYERS) for p in ("weight", "bias")]
    keys = {}
    for world in (2, 1, 3):
        recs = run_ranks(load_job, world, server.url, "pp-flat/3", True, flat, False, tmp=tmp_path)
        keys[world] = [r["result"]["keys"] for r in recs]
        assert set().union(*keys[world]) == set(flat)
        assert all(r["result"]["coverage"] == world for r in recs)
    # at 3 ranks, rank 1 restores layer 1 (written by rank 0) and layer 2 (written by rank 1)
    assert "model.layers.1.weight" in keys[3][1] and "model.layers.2.weight" in keys[3][1]
    # the nested optimizer format names its parameters per rank: it loads at the world size it was saved at
    run_ranks(load_job, 2, server.url, "pp-nested/3", False, nested, False, tmp=tmp_path)
    # the same checkpoint through DCP's reader, and DCP's own save through ckptd, at 3 ranks
    run_ranks(load_job, 3, server.url, "pp-flat/3", True, flat, True, tmp=tmp_path)
    run_ranks(load_job, 3, server.url, "pp-dcp/3", True, flat, False, tmp=tmp_path)


def cache_job(rank: int, world: int, url: str) -> dict:
    """Count the object collectives of each save (rank 0's plan gathered and scattered when the keys
    differ): the writers are agreed again only on a change."""
    import torch.distributed as dist

    from ckptd_client import CheckpointClient
    from ckptd_client._saveplan import ReplicaWriters

    calls = [0]
    names = ("all_gather_object", "gather_object", "scatter_object_list")
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*a, **kw):
            calls[0] += 1
            return real[name](*a, **kw)
        return call

    for n in names:
        setattr(dist, n, counting(n))
    base = {"step": torch.tensor(1), f"stage{rank}.w": torch.full((64, 8), float(rank))}
    rounds = [base, base, {**base, "stage1.extra": torch.ones(3)} if rank == 1 else base,
              {**base, "stage1.extra": torch.ones(3)} if rank == 1 else base,
              {**base, "stage1.extra": torch.ones(3, 2)} if rank == 1 else base]  # a shape change counts too
    counts = []
    with CheckpointClient(url) as c:
        for i, sd in enumerate(rounds):
            before = calls[0]
            c.save(sd, f"cache/{i}").wait()
            counts.append(calls[0] - before)
        # the collective's cost: the writers of 2,000 plain tensors per rank (half of them shared)
        sizes = {f"{'shared' if i % 2 else f'r{rank}'}.layer{i}.weight": 4096 * (1 + i % 7) for i in range(2000)}
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            ReplicaWriters._assign(sizes, rank, world)
        agree = (time.perf_counter() - t0) / 20
        same = {f"layer{i}.weight": 4096 * (1 + i % 7) for i in range(2000)}
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            ReplicaWriters._assign(same, rank, world)
        agree_same = (time.perf_counter() - t0) / 20
    for n in names:
        setattr(dist, n, real[n])
    return {"counts": counts, "agree_s": agree, "agree_same_s": agree_same}


@pytest.mark.slow
def test_writers_are_agreed_once_while_the_keys_stay_the_same(server, tmp_path, capsys):
    from ckptd_client import CheckpointClient

    recs = [r["result"] for r in run_ranks(cache_job, 2, server.url, tmp=tmp_path)]
    # a change on either rank (keys differ: a digest all-reduce, then rank 0 gathers the key sets and
    # scatters the writers) repeats it on every rank
    assert all(r["counts"] == [2, 0, 2, 0, 2] for r in recs), recs
    with CheckpointClient(server.url) as c:
        for i in range(5):
            m = c.manifest(f"cache/{i}")
            assert [ch.rank for ch in m.tensor("stage1.w").chunks] == [1]
            assert [ch.rank for ch in m.tensor("stage0.w").chunks] == [0]
    with capsys.disabled():
        print(f"\nwriters of 2,000 plain tensors per rank, 2 gloo ranks: {recs[0]['agree_s'] * 1e3:.1f} ms "
              f"(key sets differ), {recs[0]['agree_same_s'] * 1e3:.1f} ms (same keys); a save with unchanged "
              f"keys: 0 collectives beyond the save's own all-reduce")


def conflict_job(rank: int, world: int, url: str) -> dict:
    from ckptd_client import CheckpointClient

    # per-rank state under one key is a replica by the state dict's own rule: one holder's bytes are kept
    with CheckpointClient(url) as c:
        c.save({"shared": torch.full((4,), float(rank)), f"own{rank}": torch.full((2,), float(rank))},
               "conflict/1").wait()
    return {}


@pytest.mark.slow
def test_same_key_plain_tensors_are_replicas_written_once(server, tmp_path):
    from ckptd_client import CheckpointClient

    run_ranks(conflict_job, 2, server.url, tmp=tmp_path)
    with CheckpointClient(server.url) as c:
        m = c.manifest("conflict/1")
        assert len(m.tensor("shared").chunks) == 1
        assert [ch.rank for ch in m.tensor("own1").chunks] == [1]
