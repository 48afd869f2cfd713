"""A rank's collectives cost the same at any world size; ranks that disagree are still named.

* Rank 0 of torch's fake process group (every collective carries this rank's real payload, as if
  every other rank held the same) loads and saves through a real client and a real ``ckptd serve``
  at 16 and at 256 ranks: every collective's payload per rank is the same list at both sizes (the
  host's ranks from the launcher's ``LOCAL_WORLD_SIZE``). Before, the regions of every rank, the
  key bitmaps and the replica writers' digests were gathered to every rank: 16 times the bytes.
* The launcher's layout is taken only where it fits (pure).
* On real gloo ranks: the digest agreement finds the ranks that differ and the rare second round
  names the lowest failing rank and counts the others; the writers of plain tensors that ranks hold
  differently are planned by rank 0 and each rank gets its own keys' writers, one holder each; four
  ranks in two "hosts" of two share regions within their host only, and a failure on one host stops
  that host's ranks, not the other's.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from support import run_ranks

ROWS, COLS, TENSORS = 2, 8, 12


def _others_join(store, k: int, world: int, call: str) -> None:
    """The other world - 1 ranks made ``call`` in round ``k`` of ``_join`` (as the real ones would)."""
    store.set(f"ckptd/join/{k}/call", json.dumps([world, call]))
    store.add(f"ckptd/join/{k}/n", world - 1)


def fake_rank(url: str, world: int) -> dict:
    """Rank 0 of a fake group of ``world``: a load and two saves; each collective's bytes per rank."""
    os.environ.update(LOCAL_WORLD_SIZE="4", LOCAL_RANK="0")
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ckptd_client import CheckpointClient, solo

    names = [f"layers.{t}.weight" for t in range(TENSORS)]
    with solo(), CheckpointClient(url) as c:
        full = {n: torch.randn(ROWS * world, COLS) for n in names}
        c.save({**full, "step": torch.tensor(3), "norm": torch.ones(16)}, f"fake{world}/1").wait()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    store = dist.distributed_c10d._get_default_store()  # where ``_join`` meets
    mesh = init_device_mesh("cpu", (world,))

    def state() -> dict:
        sd = {n: DTensor.from_local(torch.zeros(ROWS, COLS), mesh, [Shard(0)], run_check=False,
                                    shape=torch.Size([ROWS * world, COLS]), stride=(COLS, 1)) for n in names}
        return {**sd, "step": torch.tensor(0), "norm": torch.zeros(16)}

    log: list = []
    real = {}

    def wrap(name, size):
        real[name] = getattr(dist, name)

        def f(*a, **kw):
            log.append((name, *size(*a, **kw)))
            return real[name](*a, **kw)
        setattr(dist, name, f)

    wrap("all_reduce", lambda t, *a, **kw: (t.nelement() * t.element_size(),))
    wrap("all_gather_object", lambda out, obj, *a, **kw: (len(pickle.dumps(obj)), len(out)))
    for name in ("broadcast_object_list", "gather_object", "scatter_object_list", "barrier"):
        wrap(name, lambda *a, **kw: ())
    calls: dict = {}
    with CheckpointClient(url, direct_reads=False) as c:
        for i, (what, ref) in enumerate((("load", f"fake{world}/1"), ("save", f"s{world}a/1"),
                                         ("save", f"s{world}b/1"))):
            _others_join(store, i, world, f"{what} {ref}")
            del log[:]
            if what == "load":
                c.load(state(), ref)
            else:
                c.save(state(), ref)._future.result()  # rank 0's part: the others never come
            calls[f"{i} {what}"] = list(log)
        c._pending = []  # nothing to wait for at close: the fake world's session never commits
    return calls


def test_a_rank_s_collective_payloads_do_not_grow_with_the_world_size(server):
    ctx = multiprocessing.get_context("spawn")
    got = {}
    for world in (16, 256):
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:  # a fresh process per world: one default group each
            got[world] = pool.submit(fake_rank, server.url, world).result(timeout=300)
    assert got[16] == got[256], (got[16], got[256])
    assert any(c[0] == "all_reduce" for c in got[16]["0 load"]) and got[16]["1 save"], got[16]


def test_the_launcher_s_layout_is_taken_only_where_it_fits():
    from ckptd_client._share import launcher_ranks

    assert launcher_ranks(5, 16, {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == [4, 5, 6, 7]
    assert launcher_ranks(0, 1, {"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}) == [0]
    for env, rank, world in (({}, 3, 8), ({"LOCAL_WORLD_SIZE": "4"}, 3, 8),
                             ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "2"}, 3, 8),  # not rank % 4
                             ({"LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "0"}, 3, 8),  # 8 ranks are no hosts of 3
                             ({"LOCAL_WORLD_SIZE": "x", "LOCAL_RANK": "0"}, 0, 8),
                             ({"LOCAL_WORLD_SIZE": "0", "LOCAL_RANK": "0"}, 0, 8)):
        assert launcher_ranks(rank, world, env) is None, env


def agree_job(rank: int, world: int) -> dict:
    from ckptd_client._dist import check, failure
    from ckptd_client._saveplan import ReplicaWriters
    from ckptd_schemas import StateDictMismatch

    out: dict = {"same": check(False, b"one digest"), "differ": check(False, b"x" if rank == 2 else b"y"),
                 "none": check(False, b""),
                 "flags": check(rank == 3, b"", flags=(rank == 2, rank == 3, False))}  # a failed rank's: not counted
    err = StateDictMismatch(f"rank {rank}: key 'k{rank}' differs") if rank in (1, 3) else None
    first = check(err is not None, b"d")[0]
    out["first"] = first
    out["failure"] = failure(first, err)
    # plain tensors held differently (pipeline stages): rank 0 plans, each rank gets its own keys' writers
    sizes = {"step": 8, f"stage{rank // 2}.w": 100 * (1 + rank // 2), f"own{rank}": 10}
    out["owners"] = ReplicaWriters._assign(sizes, rank, world)
    out["owners_same"] = ReplicaWriters._assign({"a": 5, "b": 7, "c": 1}, rank, world)
    return out


@pytest.mark.slow  # several seconds: with the slow tests, so the default run stays within its budget
def test_ranks_that_disagree_are_found_in_one_reduction_and_named_in_a_second_round(tmp_path):
    recs = [r["result"] for r in run_ranks(agree_job, 4, tmp=tmp_path)]
    for r, rec in enumerate(recs):
        assert rec["same"] == (None, True, ()) and rec["none"] == (None, True, ()), (r, rec)
        assert rec["differ"] == (None, False, ()), (r, rec)  # one rank of four passed another digest
        assert rec["flags"] == (3, True, (True, False, False)), (r, rec)  # or-ed over the ranks that passed
        assert rec["first"] == 1, (r, rec)
        message, kinds, count = rec["failure"]
        assert message == "StateDictMismatch: rank 1: key 'k1' differs" and "StateDictMismatch" in kinds, rec
        assert count == 2, rec
    owners = {}
    for r, rec in enumerate(recs):  # each rank learns the writers of exactly its own keys, each a holder
        assert set(rec["owners"]) == {"step", f"stage{r // 2}.w", f"own{r}"}, (r, rec["owners"])
        for k, w in rec["owners"].items():
            assert owners.setdefault(k, w) == w, k  # the same writer on every rank that holds the key
    holders = {"step": {0, 1, 2, 3}, "stage0.w": {0, 1}, "stage1.w": {2, 3}, **{f"own{r}": {r} for r in range(4)}}
    assert all(owners[k] in holders[k] for k in holders), owners
    assert all(rec["owners_same"] == recs[0]["owners_same"] for rec in recs)
    assert sorted(recs[0]["owners_same"].values()) == [0, 1, 2]  # balanced over the ranks: one each


def host_job(rank: int, world: int) -> dict:
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))  # two "hosts": ranks 0,1 and 2,3
    import torch.distributed as dist

    from ckptd_client._dist import raise_on_all
    from ckptd_client._share import exchange, host_group, share_plan

    _, ranks = host_group()
    regions = {("emb",): 4096, ("head",): 64}  # every rank needs both
    sharing = share_plan(regions, direct=False)
    tensors = {k: torch.full((n // 4,), float(rank)) for k, n in regions.items()}
    for k in regions:
        if k not in sharing.skip:  # this rank "reads" it: the reader's own value
            tensors[k].fill_(100 + rank)
    raise_on_all(None, group=sharing.group)
    exchange(sharing, tensors)
    failed = None
    try:
        raise_on_all(RuntimeError("disk gone") if rank == 3 else None, group=sharing.group)
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        failed = str(e)
    dist.barrier()
    return {"ranks": ranks, "transfers": sharing.transfers, "values": {k[0]: t[0].item() for k, t in tensors.items()},
            "failed": failed}


@pytest.mark.slow  # several seconds: with the slow tests, so the default run stays within its budget
def test_replicated_regions_are_shared_within_the_launcher_s_hosts_only(tmp_path):
    recs = [r["result"] for r in run_ranks(host_job, 4, tmp=tmp_path)]
    for r, rec in enumerate(recs):
        host = [0, 1] if r < 2 else [2, 3]
        assert rec["ranks"] == host, rec
        assert rec["transfers"] and all({src, dst} == set(host) for _, src, dst in rec["transfers"]), rec
        readers = {k[0]: src for k, src, _ in rec["transfers"]}
        assert rec["values"] == {k: 100.0 + readers[k] for k in ("emb", "head")}, rec  # the host's reader's bytes
        assert readers["emb"] != readers["head"]  # balanced: one region each
    assert recs[0]["failed"] is None and recs[1]["failed"] is None  # the other host is not stopped
    assert recs[3]["failed"] == "disk gone"
    assert recs[2]["failed"] == "load failed on rank 3 (RuntimeError: disk gone); rank 2 stops as well"


@pytest.mark.parametrize("world", [1, 3, 50])
def test_the_heap_balance_is_the_scan_s(world):
    from ckptd_schemas.balance import lpt_assign

    items = [(f"t{i}", (i * 7919) % 97) for i in range(200)]
    everyone = {k: range(world) for k, _ in items}  # with holders: the scan over every rank
    assert lpt_assign(items, world) == lpt_assign(items, world, holders=everyone)
