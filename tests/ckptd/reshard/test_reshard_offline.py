"""Offline resharding over a real storage root: A -> B -> A is the identity, digests match,
casts, refusals (nothing written), and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ckptd.reshard.executor import run_plan
from ckptd.reshard.planner import outline_reshard, plan_reshard
from ckptd.reshard.spec import parse_spec
from ckptd.storage import LocalStorage
from ckptd_schemas.format.engines import HostEngine, TorchEngine
from ckptd.store import CheckpointReader, SessionStore
from stored_tensors import read_tensor, write_tensors
from ckptd_schemas import CheckpointNotFound, IntegrityError, InvalidRequest

SPECS = ["full", "replicate:dp=2", "fsdp2:dp=3", "fsdp2:dp=4", "zero3:dp=4,align=16", "zero1:dp=3", "fsdp1:dp=2",
         "tp=2", "tp=2,dp=2", "owner:dp=3", "owner:dp=4,max-per-rank=5", "pp=2"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("reshard-root")
    st_ = LocalStorage(path, durable=False)
    return st_, CheckpointReader(st_), SessionStore(st_)


def _model(seed: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed.weight": torch.randn(rows + 3, 5, generator=g)}
    for i in range(3):
        t[f"model.layers.{i}.attn.wq.weight"] = torch.randn(rows, 5, generator=g)
        t[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(5, rows + i, generator=g).bfloat16()
        t[f"model.layers.{i}.norm.weight"] = torch.randn(5, generator=g)
    t["model.head.weight"] = torch.randn(7, 5, generator=g)
    for name in list(t):
        if name.endswith("wq.weight"):
            t[f"optim.state.{name[6:]}.exp_avg"] = torch.randn(rows, 5, generator=g)
            t[f"optim.state.{name[6:]}.step"] = torch.tensor(float(seed))
    return t


def _reshard(root, src: str, spec: str, engine: str | None = None, **kw) -> str:
    storage, reader, sessions = root
    r = src.split("/")
    plan = outline_reshard(reader.manifest(*r), parse_spec(spec), **kw)
    out = f"{r[0]}/{uuid.uuid4().hex[:10]}"
    run_plan(reader, sessions, plan, out, uuid.uuid4().hex, device="cpu", jobs=2,
             engine={None: None, "host": HostEngine(), "torch": TorchEngine("cpu")}[engine])
    return out


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=st.sampled_from(SPECS), b=st.sampled_from(SPECS), rows=st.integers(2, 11), seed=st.integers(0, 99),
       engine=st.sampled_from(["host", "torch"]))
def test_a_to_b_to_a_is_the_identity(root, a, b, rows, seed, engine):
    """On either engine (the host's numpy, torch on the CPU: the GPU's code)."""
    storage, reader, sessions = root
    tensors = _model(seed, rows)
    src = f"rt/{uuid.uuid4().hex[:10]}"
    write_tensors(sessions, src, tensors, step=seed)
    ref_a = _reshard(root, src, a, engine)
    ref_b = _reshard(root, ref_a, b, engine)
    ref_a2 = _reshard(root, ref_b, a, engine)
    ma, ma2 = reader.manifest(*ref_a.split("/")), reader.manifest(*ref_a2.split("/"))
    assert [(t.name, t.digest) for t in ma.tensors] == [(t.name, t.digest) for t in ma2.tensors]
    # same layout -> same chunk geometry
    geo = lambda m: sorted((t.name, c.rank, c.kind, tuple(getattr(c, "offsets", ())), getattr(c, "start", 0))
                           for t in m.tensors for c in t.chunks)
    assert geo(ma) == geo(ma2)
    for name, t in tensors.items():
        assert torch.equal(read_tensor(reader, ref_a2, name).reshape(-1).view(torch.uint8),
                           t.reshape(-1).view(torch.uint8)), name
    assert reader.manifest(*ref_b.split("/")).derived_from == ref_a


def test_cast_to_bf16_for_export(root):
    storage, reader, sessions = root
    tensors = _model(1, 6)
    write_tensors(sessions, "cast/1", tensors, step=1)
    out = _reshard(root, "cast/1", "full", dtype="bfloat16")
    m = reader.manifest(*out.split("/"))
    assert {t.dtype for t in m.tensors} == {"bfloat16"}
    for name, t in tensors.items():
        assert torch.equal(read_tensor(reader, out, name), t.bfloat16()), name


def test_refusals_write_nothing(root):
    storage, reader, sessions = root
    write_tensors(sessions, "refuse/1", {"model.layers.0.w": torch.randn(3, 3)}, step=1)
    before = sorted(storage.list("runs/refuse"))
    with pytest.raises(InvalidRequest, match="Grammar"):
        parse_spec("fsdp2:dp=")
    with pytest.raises(InvalidRequest, match="tp=4 cannot split"):
        plan_reshard(reader.manifest("refuse", "1"), parse_spec("tp=4"))
    with pytest.raises(InvalidRequest, match="pp=2 needs at least 2 layers"):
        plan_reshard(reader.manifest("refuse", "1"), parse_spec("pp=2"))
    with pytest.raises(CheckpointNotFound, match="refuse/2"):
        reader.manifest("refuse", "2")
    assert sorted(storage.list("runs/refuse")) == before


def test_a_corrupt_source_fails_the_conversion_and_commits_nothing(root, tmp_path):
    storage, reader, sessions = root
    write_tensors(sessions, "corrupt/1", {"model.w": torch.randn(64, 64)}, step=1)
    m = reader.manifest("corrupt", "1")
    (fname,) = m.files
    path = storage.root / "runs/corrupt/1/sessions" / m.session / "files" / fname
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    plan = outline_reshard(m, parse_spec("fsdp2:dp=2"))
    with pytest.raises(IntegrityError, match=fname):
        run_plan(reader, sessions, plan, "corrupt/out", uuid.uuid4().hex, device="cpu")
    assert reader.marker("corrupt", "out") is None


def _ckptd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_reshard_dry_run_and_run(tmp_path):
    storage = LocalStorage(tmp_path)
    write_tensors(SessionStore(storage), "cli/5", _model(5, 9), step=5)
    out = _ckptd("reshard", "cli/5", "--to", "zero3:dp=4,align=16", "--dry-run", "--root", str(tmp_path))
    assert out.returncode == 0 and "M_S3" in out.stdout and "work units" in out.stdout, out.stderr
    assert storage.list("runs/cli") == ["5"]  # a dry run writes nothing
    out = _ckptd("reshard", "cli/5", "--to", "owner:dp=2", "--json", "--root", str(tmp_path))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["ref"] == "cli/5-owner-dp2" and len(res["per_rank_bytes"]) == 2
    assert _ckptd("verify", res["ref"], "--root", str(tmp_path)).returncode == 0
    bad = _ckptd("reshard", "cli/5", "--to", "fsdp2:dp=two", "--root", str(tmp_path))
    assert bad.returncode == 2 and "Grammar" in bad.stderr
    missing = _ckptd("reshard", "cli/6", "--to", "full", "--root", str(tmp_path))
    assert missing.returncode == 1 and "cli/6" in missing.stderr


def test_a_one_rank_target_is_cut_into_units_for_parallel_workers(root):
    storage, reader, sessions = root
    tensors = _model(3, 9)
    write_tensors(sessions, "units/1", tensors, step=3)
    m = reader.manifest("units", "1")
    one = plan_reshard(m, parse_spec("full"))
    four = plan_reshard(m, parse_spec("full"), min_units=4)
    assert len(one.units) == 1 and len(four.units) >= 4
    assert {u.rank for u in four.units} == {0}
    listed = lambda p: sorted((c.tensor, tuple(c.offsets or ()), c.flat_start) for u in p.units for c in u.chunks)
    assert listed(one) == listed(four)  # the same chunks, each once, in more files
    out = _reshard(root, "units/1", "full", min_units=4)
    for name, t in tensors.items():
        assert torch.equal(read_tensor(reader, out, name), t), name


@pytest.mark.parametrize("spec", ["full", "fsdp2:dp=3", "zero3:dp=2,align=16", "tp=2", "owner:dp=3"])
def test_the_dry_run_reads_what_the_run_reads(root, spec):
    """``--dry-run``'s bytes to read are the bytes the conversion then reads, to the byte: neighbouring
    target chunks share a verification block, read once (tensors of several 1 MiB blocks)."""
    from ckptd.reshard.preview import preview

    storage, reader, sessions = root
    ref = f"dry{abs(hash(spec)) % 10**6}/1"
    g = torch.Generator().manual_seed(3)
    write_tensors(sessions, ref, {"model.w": torch.randn(700, 1024, generator=g),
                                  "model.v": torch.randn(300, 777, generator=g), "model.b": torch.randn(333)}, step=1)
    run, name = ref.split("/")
    outline = outline_reshard(reader.manifest(run, name), parse_spec(spec), min_units=2)
    plan = outline.plan()
    planned = sum(n for *_, n in preview(plan).unit_reads)
    res = run_plan(reader, sessions, outline, f"{run}/out", uuid.uuid4().hex, engine=HostEngine(), jobs=2)
    assert planned == plan.bytes_to_read == res.bytes_read, (planned, res.bytes_read)


@pytest.mark.parametrize("spec", SPECS)
def test_shares_partition_the_plan_and_an_outline_plans_no_read(root, spec, monkeypatch):
    """A job is cut into units from the target layout alone (no read planned: what the service records and
    a worker receives); any number of shares is disjoint and together the whole plan, unit for unit; a
    conversion run from the outline (each unit planned as its thread starts it) writes the same tensors."""
    import ckptd.reshard.planner as planner
    from ckptd.reshard.planner import outline_reshard

    storage, reader, sessions = root
    ref = f"share{abs(hash(spec)) % 10**6}/1"
    tensors = _model(5, 7)
    write_tensors(sessions, ref, tensors, step=1)
    m = reader.manifest(*ref.split("/"))
    whole = plan_reshard(m, parse_spec(spec), min_units=3)
    real = planner.plan_reads
    with monkeypatch.context() as mp:
        mp.setattr(planner, "plan_reads", lambda *a, **k: pytest.fail("an outline planned a read"))
        outline = outline_reshard(m, parse_spec(spec), min_units=3)
        header = outline.plan(reads=False)
    assert header.units == [] and header.units_total == len(outline.cuts) == len(whole.units)
    assert outline.bytes_to_write == whole.bytes_to_write
    assert planner.plan_reads is real
    for n in (1, 2, 3, 7):
        shares = [outline.plan(i, n) for i in range(n)]
        units = sorted((u for p in shares for u in p.units), key=lambda u: u.index)
        assert [u.model_dump() for u in units] == [u.model_dump() for u in whole.units], n
        assert all(u.index % n == i for i, p in enumerate(shares) for u in p.units)
    out = f"{ref.split('/')[0]}/from-outline"
    run_plan(reader, sessions, outline, out, uuid.uuid4().hex, engine=HostEngine(), jobs=2)
    for name, t in tensors.items():
        assert torch.equal(read_tensor(reader, out, name), t), name


def test_an_outline_converts_in_processes_as_in_threads(root):
    """From ``PROCESS_MIN_CHUNKS`` target chunks (forced here on a small job), ``run_plan`` shares an
    outline's units over ``jobs`` spawned processes, each cutting them again from the source: the same
    tensors as a conversion in threads, every byte written reported to ``progress``, and the result says
    how many processes ran."""
    from ckptd.reshard.planner import outline_reshard

    storage, reader, sessions = root
    tensors = _model(7, 9)
    write_tensors(sessions, "procs/1", tensors, step=1)
    outline = outline_reshard(reader.manifest("procs", "1"), parse_spec("fsdp2:dp=3"), min_units=3)
    written: list[int] = []
    res = run_plan(reader, sessions, outline, "procs/dp3", uuid.uuid4().hex, device="cpu", jobs=2, processes=True,
                   progress=written.append)
    assert res.processes == 2 and res.units == len(outline.cuts) >= 3
    assert sum(written) == sum(n for c in outline.cuts for *_, n in c.chunks)
    threads = run_plan(reader, sessions, outline, "procs/dp3-threads", uuid.uuid4().hex, device="cpu", jobs=2)
    assert threads.processes == 1
    for name, t in tensors.items():
        assert torch.equal(read_tensor(reader, "procs/dp3", name), t), name
        assert torch.equal(read_tensor(reader, "procs/dp3-threads", name), t), name
