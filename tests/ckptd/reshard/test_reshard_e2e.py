"""Resharding end to end over a real ``ckptd serve`` and real gloo ranks, bit for bit.

Sources are real multi-rank saves (FSDP2 + AdamW on 4 ranks, ZeRO-3-style flat
partitions on 4 ranks, DTensor tensor parallelism on 2 ranks); conversions run
through the CLI (subprocess and in process), the service and the executor; the
results are loaded by real ranks at the new world size and compared with the
tensors the source job held.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from math import prod
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ckptd.cli.main import main as ckptd_main
from ckptd.cli.output import human
from ckptd.reshard.executor import run_plan
from ckptd.reshard.layouts import build_layout, logical_param
from ckptd.reshard.planner import outline_reshard
from ckptd.reshard.spec import parse_spec
from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader, SessionStore
from stored_tensors import read_tensor, write_tensors
from ckptd_client import CheckpointClient, flat_partition
from ckptd_client._flatten import flatten
from ckptd_client._placement import local_piece
from ckptd_client.zero import partition_size
from ckptd_schemas import FlatChunk, Manifest, ReadRequest, plan_reads
from fsdp_job import LR, apply, build, full_tensors, save_job, state, train_step
from support import ServerProcess, run_ranks

pytestmark = pytest.mark.slow

ALIGN = 16
PAD = -7.0  # what the padding of a flat buffer holds: never part of any tensor


# -- helpers shared by the rank functions and the tests ------------------------------------------

def _put(sd: dict, name: str, value: Any) -> None:
    """Place ``value`` so that the flattened state dict calls it ``name`` (objects included:
    ``optim.param_groups`` must be the key ``param_groups`` of a dict)."""
    head, _, last = name.rpartition(".")
    (sd.setdefault(head, {}) if head else sd)[last] = value


def _file_ranks(m: Manifest) -> dict[str, int]:
    """Which rank wrote each data file of a checkpoint (every chunk of a file has one rank)."""
    out: dict[str, int] = {}
    for t in m.tensors:
        for c in t.chunks:
            assert out.setdefault(c.location.file, c.rank) == c.rank, f"file {c.location.file} mixes ranks"
    return out


def _foreign_files(m: Manifest, requests: list[ReadRequest], rank: int) -> list[str]:
    """Files outside ``rank``'s own that the read plan for ``requests`` fetches from."""
    assert len(requests) >= 3, f"rank {rank} has only {len(requests)} sharded regions to check"
    owners = _file_ranks(m)
    return sorted({f.file for f in plan_reads(m, requests).fetches if owners.get(f.file) != rank})


def _sharded_requests(sd: dict) -> list[ReadRequest]:
    """Read requests for this rank's local regions of every sharded leaf (DTensor, FlatShard)."""
    reqs = []
    for leaf in flatten(sd).leaves:
        if leaf.kind != "tensor" or isinstance(leaf.value, torch.Tensor) and not isinstance(leaf.value, DTensor):
            continue
        p = local_piece(leaf.fqn, leaf.value)
        if not p.numel:
            continue
        if p.flat is not None:
            reqs.append(ReadRequest(name=leaf.fqn, flat_start=p.flat[0], flat_length=p.flat[1]))
        else:
            reqs.append(ReadRequest(name=leaf.fqn, offsets=list(p.box.offsets), sizes=list(p.box.sizes)))
    return reqs


def _placeholders(m: Manifest, tensor: Any) -> dict:
    """A state dict with every tensor (``tensor(entry)``) and object of ``m``, to load into."""
    sd: dict = {}
    for t in m.tensors:
        _put(sd, t.name, tensor(t))
    for o in m.objects:
        _put(sd, o.name, [{}] if o.name.rsplit(".", 1)[-1] == "param_groups" else None)
    return sd


def _gather(sd: dict) -> dict[str, Any]:
    """Every leaf of a loaded state dict, whole (collective for DTensors)."""
    out = {}
    for leaf in flatten(sd).leaves:
        v = leaf.container[leaf.key]
        out[leaf.fqn] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) >= set(want), f"{what}: missing {sorted(set(want) - set(got))[:5]}"
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, f"{what}: {name} is {g.dtype}{list(g.shape)}"
        assert torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), f"{what}: {name}"


def _ckptd_subprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=180)


def _ckptd(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI in this process (same code as the ``ckptd`` command, without a new interpreter)."""
    capsys.readouterr()
    rc = ckptd_main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("reshard-e2e") / "root").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def store(server):
    storage = LocalStorage(server.root, durable=False)
    return storage, CheckpointReader(storage), SessionStore(storage)


def _convert(store, src: str, spec: str, out: str | None = None) -> str:
    """Offline conversion on the server's own root (what ``ckptd reshard --root`` runs)."""
    _, reader, sessions = store
    run, name = src.split("/")
    out = out or f"{run}/{uuid.uuid4().hex[:10]}"
    run_plan(reader, sessions, outline_reshard(reader.manifest(run, name), parse_spec(spec)), out, uuid.uuid4().hex,
             device="cpu", jobs=2)
    return out


# -- 1. FSDP2 + AdamW on 4 ranks -> fsdp2:dp=2 -> 2 ranks keep training; -> full -> one process ---------

def fsdp_load_job(rank: int, world: int, url: str, ref: str) -> dict:
    model, opt = build(world, seed=123, lr=1.0)
    train_step(model, opt, 0, rank, world)  # materialise optimizer state with the wrong values
    sd = state(model, opt)
    client = CheckpointClient(url)
    m = client.manifest(ref)
    foreign = _foreign_files(m, _sharded_requests(sd), rank)
    report = client.load(sd, ref)
    client.close()
    apply(model, opt, sd)
    loaded = full_tensors(state(model, opt))
    lr = opt.param_groups[0]["lr"]
    return {"tensors": loaded, "lr": lr, "foreign": foreign, "restored": len(report.tensors),
            "loss_next": train_step(model, opt, 3, rank, world),
            "loss_after": train_step(model, opt, 4, rank, world)}


@pytest.fixture(scope="module")
def fsdp_saved(server, tmp_path_factory):
    rec = run_ranks(save_job, 4, server.url, "fsdp/3", tmp=tmp_path_factory.mktemp("fsdp-save"))[0]
    return rec["result"]


def test_fsdp2_dp4_resharded_to_dp2_by_the_cli_continues_training_on_2_ranks(server, store, fsdp_saved,
                                                                             tmp_path):
    out = _ckptd_subprocess("reshard", "fsdp/3", "--to", "fsdp2:dp=2", "--root", server.root, "--json",
                            "--device", "cpu")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["ref"] == "fsdp/3-fsdp2-dp2" and len(res["per_rank_bytes"]) == 2
    _, reader, _ = store
    m = reader.manifest("fsdp", "3-fsdp2-dp2")
    src = reader.manifest("fsdp", "3")
    assert m.derived_from == "fsdp/3" and m.step == 3 and m.topology.world_size == 2
    assert src.topology.world_size == 4 and src.topology.layouts["model"] == "fsdp2:dp=4"
    assert [t.name for t in m.tensors] == [t.name for t in src.tensors] and all(t.digest for t in m.tensors)
    # latest stays the trainer's checkpoint: a derived checkpoint of the same step does not shadow it
    assert CheckpointClient(server.url).manifest("fsdp/latest").session == src.session

    records = run_ranks(fsdp_load_job, 2, server.url, "fsdp/3-fsdp2-dp2", tmp=tmp_path)
    for r, rec in enumerate(records):
        assert rec["result"]["foreign"] == [], f"rank {r} of 2 reads other ranks' files: {rec['result']['foreign']}"
    got = records[0]["result"]
    assert got["lr"] == LR and got["restored"] == len(fsdp_saved["tensors"])
    _assert_bitwise(got["tensors"], fsdp_saved["tensors"], "fsdp2:dp=2")
    assert got["loss_next"] == pytest.approx(fsdp_saved["loss_next"], rel=1e-6, abs=1e-7)
    assert got["loss_after"] == pytest.approx(fsdp_saved["loss_after"], rel=1e-5, abs=1e-6)


def test_fsdp2_dp4_to_full_loads_in_one_process_without_torch_distributed(server, fsdp_saved):
    assert not dist.is_initialized()
    out = _ckptd_subprocess("reshard", "fsdp/3", "--to", "full", "--server", server.url, "--json")
    assert out.returncode == 0, out.stderr
    ref = json.loads(out.stdout)["ref"]
    assert ref == "fsdp/3-full"
    client = CheckpointClient(server.url)
    m = client.manifest(ref)
    assert m.topology.world_size == 1 and {c.rank for t in m.tensors for c in t.chunks} == {0}
    assert all(len(t.chunks) == 1 for t in m.tensors)  # whole tensors
    sd = _placeholders(m, lambda t: torch.full(t.shape, float("nan"), dtype=getattr(torch, t.dtype)))
    report = client.load(sd, ref)
    client.close()
    assert not report.missing and not report.unexpected
    got = _gather(sd)
    _assert_bitwise(got, fsdp_saved["tensors"], "full")
    assert got["optim.param_groups.0.lr"] == LR


# -- 2. ZeRO-3 flat partitions on 4 ranks -> fsdp2:dp=3; FSDP2 -> zero2:dp=2 with flat buffers ------

def zero_members() -> tuple[list[tuple[str, tuple]], list[tuple[str, tuple]]]:
    """Parameters (bf16) and, as a separate flat buffer, their AdamW moments (fp32), in buffer order.
    Many matrices of very different sizes, so ``owner:`` balancing and its cap both matter."""
    params = [("model.embed.weight", (37, 16))]
    for i in range(8):
        params += [(f"model.layers.{i}.wq.weight", (5 + i, 7)), (f"model.layers.{i}.wq.bias", (5 + i,)),
                   (f"model.layers.{i}.mlp.down_proj.weight", (3, 4 + i))]
    params += [("model.norm.weight", (7,)), ("model.head.weight", (9, 16))]
    optim = [(f"optim.state.{n[6:]}.{k}", s) for n, s in params for k in ("exp_avg", "exp_avg_sq")]
    return params, optim


def zero_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    params, optim = zero_members()
    out = {n: torch.randn(s, generator=g).bfloat16() for n, s in params}
    out.update({n: torch.randn(s, generator=g) for n, s in optim})
    return out


def _flat_local(members, full, rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's partition of the padded flat concatenation (padding holds PAD)."""
    part = partition_size([s for _, s in members], world, ALIGN)
    buf = torch.full((part * world,), PAD, dtype=dtype)
    cursor = 0
    for name, shape in members:
        n = prod(shape)
        buf[cursor:cursor + n] = full[name].reshape(-1)
        cursor += -(-n // ALIGN) * ALIGN
    return buf[rank * part:(rank + 1) * part].clone()


def zero_save_job(rank: int, world: int, url: str, ref: str) -> None:
    params, optim = zero_members()
    full = zero_full()
    pflat = _flat_local(params, full, rank, world, torch.bfloat16)
    oflat = _flat_local(optim, full, rank, world, torch.float32)
    sd = {**flat_partition(params, pflat, rank=rank, world=world, align=ALIGN),
          **flat_partition(optim, oflat, rank=rank, world=world, align=ALIGN), "step": 17}
    client = CheckpointClient(url)
    client.save(sd, ref).wait()
    client.close()


def dtensor_load_job(rank: int, world: int, url: str, ref: str) -> dict:
    """Load every tensor of ``ref`` as a DTensor Shard(0) over ``world`` ranks (scalars plain)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    client = CheckpointClient(url)
    m = client.manifest(ref)

    def make(t) -> torch.Tensor:
        z = torch.full(t.shape, float("nan"), dtype=getattr(torch, t.dtype))
        return distribute_tensor(z, mesh, [Shard(0)]) if t.shape else z

    sd = _placeholders(m, make)
    foreign = _foreign_files(m, _sharded_requests(sd), rank)
    client.load(sd, ref)
    client.close()
    got = _gather(sd)
    return {"foreign": foreign, "tensors": got if rank == 0 else None}


def zero_load_job(rank: int, world: int, url: str, refs: list[tuple[str, int]]) -> list[dict]:
    """Load zero1/zero2 checkpoints the way ZeRO holds them: group ``model`` whole on every rank, every
    other group as one flat buffer per group (manifest order, ``align`` padding), scalars whole."""
    client = CheckpointClient(url)
    out = []
    for ref, align in refs:
        m = client.manifest(ref)
        sd: dict = _placeholders(m, lambda t: torch.full(t.shape, float("nan"), dtype=getattr(torch, t.dtype)))
        groups: dict[str, list] = {}
        for t in m.tensors:
            if t.group != "model" and t.shape:
                groups.setdefault(t.group, []).append(t)
        buffers = {}
        for g, members in groups.items():
            assert len({t.dtype for t in members}) == 1
            shapes = [(t.name, tuple(t.shape)) for t in members]
            buf = torch.full((partition_size([s for _, s in shapes], world, align),), PAD,
                             dtype=getattr(torch, members[0].dtype))
            for name, shard in flat_partition(shapes, buf, rank=rank, world=world, align=align).items():
                _put(sd, name, shard)
            buffers[g] = (shapes, buf)
        foreign = _foreign_files(m, _sharded_requests(sd), rank)
        client.load(sd, ref)
        plain = {k: v for k, v in _gather(sd).items() if isinstance(v, torch.Tensor)}
        out.append({"foreign": foreign, "buffers": buffers, "plain": plain})
    client.close()
    return out


@pytest.fixture(scope="module")
def zero_saved(server, tmp_path_factory):
    run_ranks(zero_save_job, 4, server.url, "zero/17", tmp=tmp_path_factory.mktemp("zero-save"))
    return zero_full()


def _expected_buffer(shapes, full, rank: int, world: int, align: int, dtype: torch.dtype) -> torch.Tensor:
    part = partition_size([s for _, s in shapes], world, align)
    buf = torch.full((part * world,), PAD, dtype=dtype)
    cursor = 0
    for name, shape in shapes:
        n = prod(shape)
        buf[cursor:cursor + n] = full[name].reshape(-1)
        cursor += -(-n // align) * align
    return buf[rank * part:(rank + 1) * part]


def test_zero3_flat_partitions_from_4_ranks_load_as_fsdp2_dp3(server, store, zero_saved, tmp_path):
    _, reader, _ = store
    src = reader.manifest("zero", "17")
    assert src.topology.layouts == {"model": "flat:dp=4", "optim": "flat:dp=4"}
    assert all(isinstance(c, FlatChunk) for t in src.tensors for c in t.chunks)
    # what the client saved from flat_partition is exactly the planner's zero3:dp=4,align=16 layout
    layout = build_layout(parse_spec(f"zero3:dp=4,align={ALIGN}"), src.tensors)
    assert sorted((t.name, c.rank, c.start, c.length) for t in src.tensors for c in t.chunks) == \
        sorted((c.tensor, c.rank, *c.region.flat) for c in layout.chunks)

    ref = _convert(store, "zero/17", "fsdp2:dp=3", "zero/17-fsdp2-dp3")
    m = reader.manifest("zero", "17-fsdp2-dp3")
    assert m.topology.world_size == 3 and m.derived_from == "zero/17"
    assert [o.value for o in m.objects if o.name == "step"] == [17]
    records = run_ranks(dtensor_load_job, 3, server.url, ref, tmp=tmp_path)
    for r, rec in enumerate(records):
        assert rec["result"]["foreign"] == [], f"rank {r} of 3 reads other ranks' files"
    got = records[0]["result"]["tensors"]
    _assert_bitwise(got, zero_saved, "zero3 -> fsdp2:dp=3")
    assert got["step"] == 17


def test_fsdp2_to_zero2_dp2_loads_into_flat_buffers(server, store, fsdp_saved, tmp_path):
    _, reader, _ = store
    refs = []
    for align in (1, ALIGN):
        spec = "zero2:dp=2" + (f",align={align}" if align != 1 else "")
        ref = _convert(store, "fsdp/3", spec, f"fsdp/3-zero2-a{align}")
        m = reader.manifest(*ref.split("/"))
        assert m.topology.layouts["model"] == "replicate:dp=2" and m.topology.layouts["optim"] == spec
        for t in m.tensors:  # weights (and scalars) whole, written once; moments flat-partitioned
            whole = t.group == "model" or not t.shape
            assert all((c.kind == "box") == whole for c in t.chunks), t.name
            assert len(t.chunks) == 1 if whole else len(t.chunks) >= 1
        refs.append((ref, align))
    records = run_ranks(zero_load_job, 2, server.url, refs, tmp=tmp_path)
    want = fsdp_saved["tensors"]
    for r, rec in enumerate(records):
        for (ref, align), res in zip(refs, rec["result"]):
            what = f"{ref} rank {r}"
            assert res["foreign"] == [], f"{what}: its flat partitions come from other ranks' files"
            _assert_bitwise(res["plain"], {k: v for k, v in want.items() if k in res["plain"]}, what)
            assert {k for k in want if k.startswith("model.") or want[k].dim() == 0} <= set(res["plain"])
            ((shapes, buf),) = res["buffers"].values()  # one flat group: the optimizer's moments
            expected = _expected_buffer(shapes, want, r, 2, align, buf.dtype)
            assert torch.equal(buf.view(torch.uint8), expected.view(torch.uint8)), f"{what}: flat buffer"


# -- 3. DTensor tensor parallelism (Colwise/Rowwise) on 2 ranks -> full, -> tp=1,dp=2 -----------------

class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(10, 22)
        self.fc2 = torch.nn.Linear(22, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def tp_save_job(rank: int, world: int, url: str, ref: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(5)
    model = MLP()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(6, 10, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    placements = {k: str(v.placements) for k, v in sd["model"].items()}
    client = CheckpointClient(url)
    client.save(sd, ref).wait()
    client.close()
    return {"tensors": full_tensors(sd), "placements": placements}


def test_tensor_parallel_colwise_rowwise_to_full_and_to_dp2(server, store, capsys, tmp_path):
    rec = run_ranks(tp_save_job, 2, server.url, "tp/2", tmp=tmp_path)[0]["result"]
    want = rec["tensors"]
    assert rec["placements"] == {"fc1.weight": "(Shard(dim=0),)", "fc1.bias": "(Shard(dim=0),)",
                                 "fc2.weight": "(Shard(dim=1),)", "fc2.bias": "(Replicate(),)"}
    _, reader, _ = store
    src = reader.manifest("tp", "2")
    assert src.topology.mesh == {"tp": 2}

    # tp=2 reproduces the source's own placement of every sharded tensor (column fc1, row fc2)
    tp2 = reader.manifest("tp", _convert(store, "tp/2", "tp=2").split("/")[1])
    geo = lambda m: sorted((t.name, c.rank, tuple(c.offsets), tuple(c.sizes)) for t in m.tensors
                           for c in t.chunks if len(t.chunks) > 1)
    assert geo(tp2) == geo(src) and geo(src)

    rc, out, err = _ckptd(capsys, "reshard", "tp/2", "--to", "full", "--root", server.root, "--device", "cpu")
    assert rc == 0, err
    assert "committed tp/2-full" in out and "every tensor's digest matches the source" in out
    m = reader.manifest("tp", "2-full")
    assert [t.digest for t in tp2.tensors] == [t.digest for t in m.tensors]
    sd = _placeholders(m, lambda t: torch.full(t.shape, float("nan"), dtype=getattr(torch, t.dtype)))
    client = CheckpointClient(server.url)
    client.load(sd, "tp/2-full")
    client.close()
    _assert_bitwise(_gather(sd), want, "tp=2 -> full")

    ref = _convert(store, "tp/2", "tp=1,dp=2", "tp/2-dp2")
    assert reader.manifest("tp", "2-dp2").topology.mesh == {"dp": 2, "tp": 1}
    records = run_ranks(dtensor_load_job, 2, server.url, ref, tmp=tmp_path)
    for r, rec2 in enumerate(records):
        assert rec2["result"]["foreign"] == [], f"rank {r} of dp=2 reads other ranks' files"
    _assert_bitwise(records[0]["result"]["tensors"], want, "tp=2 -> tp=1,dp=2")


# -- 4. owner:dp=4,max-per-rank=5 <-> fsdp2:dp=2, per-rank bytes and imbalance ------------------------

def _matrices_per_rank(m: Manifest) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for t in m.tensors:
        if len(t.shape) >= 2:
            for c in t.chunks:
                out.setdefault(c.rank, set()).add(logical_param(t))
    return out


def _bytes_per_rank(m: Manifest) -> list[int]:
    out = [0] * m.topology.world_size
    for t in m.tensors:
        for c in t.chunks:
            out[c.rank] += c.location.raw_length
    return out


def test_owner_with_a_cap_round_trips_through_fsdp2_and_reports_balance(server, store, zero_saved, capsys):
    _, reader, sessions = store
    spec = "owner:dp=4,max-per-rank=5"
    rc, out, err = _ckptd(capsys, "reshard", "zero/17", "--to", spec, "--dry-run", "--root", server.root)
    assert rc == 0, err
    assert "imbalance" in out and out.count("\n") > 4
    assert not any(n.startswith("17-owner") for n in store[0].list("runs/zero"))  # a dry run writes nothing

    rc, out, err = _ckptd(capsys, "reshard", "zero/17", "--to", spec, "--root", server.root, "--json",
                          "--device", "cpu")
    assert rc == 0, err
    res = json.loads(out)
    owner = reader.manifest("zero", res["ref"].split("/")[1])
    assert res["ref"] == "zero/17-owner-dp4-max-per-rank5" and owner.derived_from == "zero/17"
    # every logical matrix whole on one rank, its moments beside it; the cap binds (18 matrices, 4 ranks)
    where: dict[str, set[int]] = {}
    for t in owner.tensors:
        assert len(t.chunks) == 1 and list(t.chunks[0].sizes) == t.shape, t.name
        where.setdefault(logical_param(t), set()).add(t.chunks[0].rank)
    assert all(len(r) == 1 for r in where.values()), where
    counts = {r: len(ms) for r, ms in _matrices_per_rank(owner).items()}
    assert sum(counts.values()) == 18 and max(counts.values()) == 5, counts
    # the summary: per-rank bytes and imbalance, consistent with what was written
    loads = _bytes_per_rank(owner)
    assert res["per_rank_bytes"] == loads
    mean, peak = sum(loads) / 4, max(loads)
    assert res["imbalance"] == pytest.approx(peak / mean - 1) and res["imbalance"] > 0

    rc, out, err = _ckptd(capsys, "show", res["ref"], "--root", server.root)
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("per rank"))
    assert f"imbalance {peak / mean - 1:.1%}" in line, line
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("  rank ")]
    assert [" ".join(r[2:4]) for r in rows] == [human(n) for n in loads], out

    rc, out, err = _ckptd(capsys, "reshard", "zero/17", "--to", spec, "--root", server.root, "--device", "cpu",
                          "--out", "zero/owner-human")
    assert rc == 0, err
    assert f"imbalance {peak / mean - 1:.1%}" in out

    # and back: owner -> fsdp2:dp=2 -> owner is the identity, bit for bit
    fsdp = _convert(store, res["ref"], "fsdp2:dp=2")
    back = reader.manifest(*_convert(store, fsdp, spec).split("/"))
    geo = lambda m: sorted((t.name, c.rank, tuple(c.offsets), tuple(c.sizes)) for t in m.tensors for c in t.chunks)
    assert geo(back) == geo(owner)
    assert [(t.name, t.digest) for t in back.tensors] == [(t.name, t.digest) for t in owner.tensors]
    for name, t in zero_saved.items():
        got = read_tensor(reader, f"zero/{back.name}", name)
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name

    # the other direction offline: fsdp2:dp=2 written whole -> owner -> fsdp2:dp=2
    write_tensors(sessions, "ownoff/1", zero_saved, step=1)
    a = reader.manifest(*_convert(store, "ownoff/1", "fsdp2:dp=2").split("/"))
    b = reader.manifest(*_convert(store, _convert(store, f"ownoff/{a.name}", spec), "fsdp2:dp=2").split("/"))
    assert geo(a) == geo(b) and [t.digest for t in a.tensors] == [t.digest for t in b.tensors]
    assert {t.name: t.digest for t in a.tensors} == {t.name: t.digest for t in owner.tensors}
