"""Replicated regions read once per host (client/_share.py).

The policy is pure and property-tested; the exchange runs in real gloo ranks against a real
``ckptd serve``: over HTTP, three ranks of one host that all hold the same plain tensors fetch each
of them once between them, and every rank ends with the checkpoint's bytes; when every rank reads
the service's files directly, no rank gathers a sharing plan at all. When one rank's load fails,
every rank raises instead of waiting for it.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd_client._share import assign_readers
from support import run_ranks


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_shared_region_gets_one_reader_among_its_holders(data):
    world = data.draw(st.integers(1, 7))
    hosts = [data.draw(st.sampled_from("ab")) for _ in range(world)]
    shared = set(data.draw(st.lists(st.sampled_from("ab"), max_size=2)))
    keys = [f"t{i}" for i in range(data.draw(st.integers(0, 12)))]
    sizes = {k: data.draw(st.integers(1, 1000)) for k in keys}
    wants = [{k: sizes[k] for k in data.draw(st.lists(st.sampled_from(keys), unique=True)) } if keys else {}
             for _ in range(world)]
    out = assign_readers(wants, hosts, shared)
    seen = set()
    for k, reader, receivers in out:
        host = hosts[reader]
        holders = sorted(r for r in range(world) if hosts[r] == host and k in wants[r])
        assert host in shared and len(holders) > 1
        assert sorted([reader, *receivers]) == holders
        assert (host, k) not in seen
        seen.add((host, k))
    for host in shared:  # nothing shared is left out
        for k in keys:
            holders = [r for r in range(world) if hosts[r] == host and k in wants[r]]
            assert (len(holders) > 1) == ((host, k) in seen)
    assert out == assign_readers(wants, hosts, shared)  # every rank computes the same answer


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=30), st.integers(2, 8))
def test_reading_is_balanced_when_every_rank_holds_everything(sizes, world):
    wants = [{f"t{i}": n for i, n in enumerate(sizes)} for _ in range(world)]
    load = [0] * world
    for k, reader, _ in assign_readers(wants, ["h"] * world, {"h"}):
        load[reader] += wants[reader][k]
    assert max(load) - min(load) <= max(sizes)  # greedy largest-first: within one region


def _state(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(7)
    full = torch.randn(301, 64, generator=g)
    mesh = init_device_mesh("cpu", (world,))
    return {"emb": torch.randn(500, 256, generator=g),            # replicated: every rank holds it
            "head": torch.randn(37, 129, generator=g).to(torch.bfloat16),
            "steps": torch.arange(5, dtype=torch.int64),
            "w": distribute_tensor(full, mesh, [Shard(0)])}       # sharded: each rank its rows


def share_job(rank: int, world: int, url: str) -> dict:
    from ckptd_client import CheckpointClient

    want = _state(rank, world)
    with CheckpointClient(url) as c:
        c.save(want, "share/1").wait()
    out = {}
    for mode, kw in (("http", {"direct_reads": False}), ("direct", {}), ("off", {"direct_reads": False,
                                                                            "share_replicas": False})):
        got = {k: (torch.zeros_like(v) if not hasattr(v, "to_local") else v.clone()) for k, v in want.items()}
        got["w"].to_local().zero_()
        with CheckpointClient(url, **kw) as c:
            rep = c.load(got, "share/1")
        for k in ("emb", "head", "steps"):
            assert torch.equal(got[k], want[k]), f"{mode}: {k} differs on rank {rank}"
        assert torch.equal(got["w"].to_local(), want["w"].to_local()), f"{mode}: w differs on rank {rank}"
        out[mode] = {"read": rep.bytes_read, "shared_in": rep.bytes_shared_in}
    return out


def test_replicated_tensors_are_fetched_once_per_host(server, tmp_path):
    world = 3
    recs = [r["result"] for r in run_ranks(share_job, world, server.url, tmp=tmp_path)]
    replicated = 500 * 256 * 4 + 37 * 129 * 2 + 5 * 8
    http = [r["http"] for r in recs]
    off = [r["off"] for r in recs]
    # over HTTP with sharing: the replicated bytes are fetched once in all, and received by the others
    assert sum(r["shared_in"] for r in http) == (world - 1) * replicated
    assert sum(r["read"] for r in off) - sum(r["read"] for r in http) >= (world - 1) * replicated
    assert all(r["shared_in"] == 0 for r in off)
    # reading the service's files directly, the page cache shares them already: nothing is sent
    assert all(r["direct"]["shared_in"] == 0 for r in recs)


def gather_job(rank: int, world: int, url: str) -> dict:
    import torch.distributed as dist

    from ckptd_client import CheckpointClient

    want = _state(rank, world)
    with CheckpointClient(url) as c:
        c.save(want, "share/3").wait()
    real, calls = dist.all_gather_object, []

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    dist.all_gather_object = counted
    out = {}
    try:
        for mode, kw in (("direct", {}), ("one_over_http", {"direct_reads": rank != 1})):
            before = len(calls)
            got = {k: (torch.zeros_like(v) if not hasattr(v, "to_local") else v.clone()) for k, v in want.items()}
            got["w"].to_local().zero_()
            with CheckpointClient(url, **kw) as c:
                rep = c.load(got, "share/3")
            for k in ("emb", "head", "steps"):
                assert torch.equal(got[k], want[k]), f"{mode}: {k} differs on rank {rank}"
            assert torch.equal(got["w"].to_local(), want["w"].to_local()), f"{mode}: w differs on rank {rank}"
            out[mode] = {"gathers": len(calls) - before, "read": rep.bytes_read, "direct": rep.bytes_read_direct,
                         "shared_in": rep.bytes_shared_in}
    finally:
        dist.all_gather_object = real
    return out


def test_no_rank_gathers_a_sharing_plan_when_every_rank_reads_its_files_directly(server, tmp_path):
    """Every rank reads the service's files itself: the load's agreement says so to all of them, and
    none gathers who reads what (nothing would be shared). When one rank reads over HTTP, the same
    agreement tells every rank to share, and the replicated regions are read once on the host."""
    world = 3
    recs = [r["result"] for r in run_ranks(gather_job, world, server.url, tmp=tmp_path)]
    for r, rec in enumerate(recs):
        assert rec["direct"]["gathers"] == 0, (r, rec)
        assert rec["direct"]["direct"] > 0 and rec["direct"]["shared_in"] == 0, (r, rec)
        assert rec["one_over_http"]["gathers"] >= 1, (r, rec)
    assert recs[1]["one_over_http"]["direct"] == 0
    replicated = 500 * 256 * 4 + 37 * 129 * 2 + 5 * 8
    assert sum(rec["one_over_http"]["shared_in"] for rec in recs) == (world - 1) * replicated


def failing_job(rank: int, world: int, url: str) -> dict:
    from ckptd_client import CheckpointClient

    want = _state(rank, world)
    with CheckpointClient(url) as c:  # collective: every rank saves (the replicated tensors once)
        c.save({k: v for k, v in want.items() if k != "w"}, "share/2").wait()
    got = {k: torch.zeros_like(v) for k, v in want.items() if k != "w"}
    if rank == 1:
        got["extra"] = torch.zeros(3)  # not in the checkpoint: this rank's strict load refuses
    try:
        with CheckpointClient(url, direct_reads=False) as c:
            c.load(got, "share/2")
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def test_a_rank_that_fails_does_not_leave_the_others_waiting(server, tmp_path):
    recs = [r["result"] for r in run_ranks(failing_job, 3, server.url, tmp=tmp_path, timeout=120)]
    assert recs[1]["type"] == "StateDictMismatch" and "extra" in recs[1]["message"]
    for r in (recs[0], recs[2]):  # the others raise the same kind of error, naming the rank and the key
        assert r["type"] == "StateDictMismatch" and "rank 1" in r["message"] and "extra" in r["message"], r


def group_job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from ckptd_client._dist import agree, cpu_group

    # a gloo default group carries the client's CPU collectives itself: no extra group
    (any_flag,), token = agree((rank == 1,), f"from {rank}".encode())
    return {"group_is_default": cpu_group() is None, "any": any_flag, "bcast": token.decode(),
            "backend": dist.get_backend_config()}


def test_cpu_collectives_use_the_default_group_when_it_has_a_cpu_backend(tmp_path):
    recs = [r["result"] for r in run_ranks(group_job, 2, tmp=tmp_path)]
    assert all(r["group_is_default"] and r["any"] and r["bcast"] == "from 0" for r in recs), recs
