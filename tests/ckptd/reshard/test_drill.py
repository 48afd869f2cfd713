"""Conversion drills (``ckptd drill``, ``POST /v1/drill``, ``CKPTD_DRILL_EVERY``) over real parts: a checkpoint
saved by real gloo ranks (FSDP2 DTensors through a real ``ckptd serve``), drilled offline and through the
service; a flipped byte named by tensor and layout; bad input refused with one line; the policy drilling
every N commits and counted in ``/metrics``; and, every time, the record as the only thing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ckptd.reshard.drill_layouts import check_layout, data_parallel_degree, resolve_layout, split_layouts
from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader, SessionStore
from stored_tensors import write_tensors
from ckptd_schemas import InvalidRequest, Topology
from ckptd_schemas.format.engines import HostEngine
from support import ServerProcess, run_ranks, scaled

from .test_digest import Corrupting

WORLD = 2
SHAPES = {  # FSDP2 shards of these over 2 ranks: uneven rows (torch.chunk), a row-parallel weight for tp's Shard(1)
    "model.embed.weight": (51, 32),
    "model.layers.0.attn.wq.weight": (64, 32),
    "model.layers.0.attn.o_proj.weight": (32, 64),
    "model.layers.0.norm.weight": (32,),
}


def _tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    out["optim.state.layers.0.attn.wq.weight.exp_avg"] = torch.randn(64, 32, generator=g)
    return out


def save_job(rank: int, world: int, url: str) -> None:
    """FSDP2-style training saves: every tensor a DTensor Shard(0) over a 1-D mesh, plus a plain step tensor
    and an object; two checkpoints, ``train/1`` and ``train/2``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptd_client import CheckpointClient

    mesh = init_device_mesh("cpu", (world,))
    client = CheckpointClient(url)
    for step in (1, 2):
        sd: dict = {"model": {}, "optim": {"state": {}}, "step": torch.tensor(step), "loader": {"epoch": step}}
        for k, v in _tensors(step).items():
            group, rest = k.split(".", 1)
            d = distribute_tensor(v, mesh, [Shard(0)])
            if group == "model":
                sd["model"][rest] = d
            else:
                p, moment = rest.removeprefix("state.").rsplit(".", 1)
                sd["optim"]["state"][p] = {moment: d}
        assert client.save(sd, f"train/{step}").wait().state == "committed"
    client.close()


def _ckptd(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=scaled(timeout))


def _tree(root: str | Path, under: str = "") -> set[str]:
    """Every file under the root (or ``under`` it), leases aside: a drill's lease is gone when it ends."""
    base = Path(root)
    return {str(p.relative_to(base)) for p in (base / under).rglob("*")
            if p.is_file() and p.relative_to(base).parts[0] != "leases"}


def _leases(root: str | Path) -> list[Path]:
    return [p for p in (Path(root) / "leases").rglob("*") if p.is_file()] if (Path(root) / "leases").exists() else []


def _drills(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.labels["result"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "ckptd_drills_total"}


def _wait_drills(url: str, want: dict[str, float], timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + scaled(timeout)
    while (got := _drills(url)) != want:
        assert time.monotonic() < deadline, f"ckptd_drills_total {got}, expected {want}"
        time.sleep(0.2)
    return got


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real ``ckptd serve`` with ``CKPTD_DRILL_EVERY=2`` (and the default layouts half,double,full), and 2
    gloo ranks that save ``train/1`` and ``train/2`` through it: the second commit makes the policy drill
    ``train/latest``."""
    tmp = tmp_path_factory.mktemp("drill")
    srv = ServerProcess(tmp / "root", env={"CKPTD_DRILL_EVERY": "2"}).start()
    try:
        run_ranks(save_job, WORLD, srv.url, tmp=tmp)
        deadline = time.monotonic() + scaled(120)
        while not sum(_drills(srv.url).values()):  # the policy's drill of train/2 has ended: each test starts quiet
            assert time.monotonic() < deadline, "the policy never drilled"
            time.sleep(0.2)
        time.sleep(0.5)  # a second drill, were the policy wrong, would be counted by now
        # what the policy did, seen before any test drills anything
        drill = f"{srv.url}/v1/checkpoints/train/{{}}/drill"
        srv.after_saves = {"drills": _drills(srv.url), "tree": _tree(srv.root),
                           "train/1": httpx.get(drill.format(1), timeout=10).status_code,
                           "train/2": httpx.get(drill.format(2), timeout=10).json(),
                           "latest": httpx.get(drill.format("latest"), timeout=10).json()}
        yield srv
    finally:
        srv.stop()


# -- the layouts a drill names (pure) ----------------------------------------------------------------------

def test_layout_lists_and_the_data_parallel_degree():
    assert split_layouts("half,double,full") == ["half", "double", "full"]
    assert split_layouts("half, zero3:dp=8,align=16,tp=2,dp=2,full") == ["half", "zero3:dp=8,align=16", "tp=2,dp=2",
                                                                          "full"]
    assert split_layouts("owner:dp=4,max-per-rank=5,group=role") == ["owner:dp=4,max-per-rank=5,group=role"]
    assert data_parallel_degree(Topology(world_size=8)) == 8  # no mesh: every rank data parallel
    assert data_parallel_degree(Topology(world_size=8, mesh={"dp": 8})) == 8
    assert data_parallel_degree(Topology(world_size=8, mesh={"dp": 4, "tp": 2})) == 4
    assert data_parallel_degree(Topology(world_size=8, mesh={"dp_replicate": 2, "dp_shard": 2, "tp": 2})) == 4
    assert data_parallel_degree(Topology(world_size=8, mesh={"tp": 2, "dim1": 4})) == 4  # world over tp
    assert data_parallel_degree(Topology(world_size=2, mesh={"tp": 2})) == 1
    topo = Topology(world_size=6, mesh={"dp": 3, "tp": 2})
    assert str(resolve_layout("half", topo)) == "fsdp2:dp=1" and str(resolve_layout("double", topo)) == "fsdp2:dp=6"
    assert str(resolve_layout("fsdp2:dp=4", topo)) == "fsdp2:dp=4"
    with pytest.raises(InvalidRequest, match="Grammar"):
        check_layout("triple")


def test_a_bad_drill_layout_setting_stops_serve_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "serve", "--root", str(tmp_path), "--port", "0"],
                         capture_output=True, text=True, timeout=scaled(60),
                         env={**os.environ, "CKPTD_DRILL_LAYOUTS": "half,fsdp2:dp="})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "CKPTD_DRILL_LAYOUTS" in out.stderr and "Traceback" not in out.stderr


# -- end to end ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_policy_drills_after_n_commits_and_counts_it(saved):
    """Two commits of run ``train`` with CKPTD_DRILL_EVERY=2: one drill job of ``train/2`` into
    half, double and full of its data-parallel degree (2: fsdp2:dp=1, fsdp2:dp=4, full), recorded beside it
    and counted ok; ``train/1`` is not drilled."""
    seen = saved.after_saves
    assert seen["drills"] == {"ok": 1.0, "failed": 0.0}, seen["drills"]
    assert seen["train/1"] == 404  # drilled on the 2nd commit only
    assert {x for x in seen["tree"] if x.endswith("DRILL.json")} == {"runs/train/2/DRILL.json"}
    rec = seen["train/2"]
    assert rec["ok"] and rec["ref"] == "train/2" and seen["latest"] == rec, rec
    assert [(x["layout"], x["spec"], x["ok"]) for x in rec["layouts"]] == [
        ("half", "fsdp2:dp=1", True), ("double", "fsdp2:dp=4", True), ("full", "full", True)]
    reader = CheckpointReader(LocalStorage(saved.root))
    n = len(reader.manifest("train", "2").tensors)  # 5 DTensors and the step
    assert n == 6 and all(x["tensors"] == n and x["bytes"] > 0 and not x["problems"] for x in rec["layouts"])
    marker = reader.marker("train", "2")
    assert rec["manifest_xxh3"] == marker.manifest_xxh3
    # the policy's drill is a job like any other: one record, done, with the drill's record as its result,
    # readable at GET /v1/jobs/{id}; nothing listed as active, nothing else in the checkpoint
    jobs = [x for x in seen["tree"] if x.startswith("jobs/") and not x.startswith("jobs/replicas/")]
    assert len(jobs) == 1 and jobs[0].count("/") == 1, jobs
    job = json.loads((Path(saved.root) / jobs[0]).read_text())
    assert (job["kind"], job["state"], job["source"], job["layouts"]) == ("drill", "done", "train/2",
                                                                          ["half", "double", "full"]), job
    assert job["result"] == rec and job["owner"] is not None
    assert httpx.get(f"{saved.url}/v1/jobs/{job['id']}", timeout=10).json() == job
    assert {Path(x).parts[3] for x in seen["tree"] if x.startswith("runs/train/2/")} == {
        "COMMITTED", "VERIFIED.json", "DRILL.json", "sessions"}


@pytest.mark.slow
def test_offline_drill_of_a_gloo_saved_checkpoint_passes_and_writes_only_its_record(saved):
    root = saved.root
    before = _tree(root)
    out = _ckptd("drill", "train/1", "--to", "full", "--to", "fsdp2:dp=3", "--to", "tp=2", "--to", "double",
                 "--root", root)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("OK train/1") and "double (fsdp2:dp=4)" in out.stdout, out.stdout
    assert _tree(root) - before == {"runs/train/1/DRILL.json"} and before <= _tree(root)
    assert not _leases(root)  # the lease it held while reading is released
    rec = json.loads((Path(root) / "runs/train/1/DRILL.json").read_text())
    marker = CheckpointReader(LocalStorage(root)).marker("train", "1")
    assert rec["ok"] and rec["manifest_xxh3"] == marker.manifest_xxh3
    assert [x["spec"] for x in rec["layouts"]] == ["full", "fsdp2:dp=3", "tp=2", "fsdp2:dp=4"]
    assert all(x["ok"] and x["tensors"] == 6 and x["bytes_read"] > 0 for x in rec["layouts"])


@pytest.mark.slow
def test_drill_through_the_service_passes_and_is_counted(saved):
    counts = _drills(saved.url)
    before = _tree(saved.root, "runs")
    out = _ckptd("drill", "train/2", "--to", "full", "--to", "fsdp2:dp=3", "--to", "half", "--json",
                 "--server", saved.url)
    assert out.returncode == 0, out.stdout + out.stderr
    rec = json.loads(out.stdout)
    assert rec["ok"] and [x["spec"] for x in rec["layouts"]] == ["full", "fsdp2:dp=3", "fsdp2:dp=1"]
    assert _tree(saved.root, "runs") == before  # DRILL.json rewritten in place, nothing else
    from ckptd_client import CatalogClient

    with CatalogClient(saved.url) as client:
        assert client.drill_record("train/2") == rec
    _wait_drills(saved.url, {**counts, "ok": counts["ok"] + 1})
    assert not _leases(saved.root)


def _corrupt_checkpoint(root: str, ref: str) -> Path:
    """A one-rank checkpoint whose ``model.big`` has one byte flipped in its chunk; the file holding it."""
    storage = LocalStorage(root)
    g = torch.Generator().manual_seed(7)
    write_tensors(SessionStore(storage), ref, {"model.small": torch.randn(10, 5, generator=g),
                                               "model.big": torch.randn(300, 1000, generator=g)}, step=1)
    run, name = ref.split("/")
    m = CheckpointReader(storage).manifest(run, name)
    loc = m.tensor("model.big").chunks[0].location
    path = Path(root) / "runs" / run / name / "sessions" / m.session / "files" / loc.file
    data = bytearray(path.read_bytes())
    at = loc.offset + loc.length // 2
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    return path


@pytest.mark.slow
def test_a_flipped_byte_fails_the_drill_naming_tensor_and_layout(saved):
    root = saved.root
    path = _corrupt_checkpoint(root, "bad/1")
    damaged = path.read_bytes()
    before = _tree(root)
    out = _ckptd("drill", "bad/1", "--to", "full", "--to", "fsdp2:dp=2", "--root", root)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.startswith("FAIL bad/1"), out.stdout
    for layout in ("full", "fsdp2:dp=2"):
        assert f"layout {layout}: tensor 'model.big': its stored bytes are damaged" in out.stdout, out.stdout
    assert _tree(root) - before == {"runs/bad/1/DRILL.json"} and before <= _tree(root)
    assert path.read_bytes() == damaged  # the data is left as it was found
    rec = json.loads((Path(root) / "runs/bad/1/DRILL.json").read_text())
    assert not rec["ok"]
    for x in rec["layouts"]:
        assert not x["ok"] and any(p["tensor"] == "model.big" and p["layout"] == x["layout"]
                                   and "damaged" in p["message"] for p in x["problems"]), x
    # through the service: exit 1, the same problems, counted failed
    counts = _drills(saved.url)
    out = _ckptd("drill", "bad/1", "--to", "fsdp2:dp=2", "--server", saved.url)
    says = "layout fsdp2:dp=2: tensor 'model.big': its stored bytes are damaged"
    assert out.returncode == 1 and says in out.stdout, out.stdout + out.stderr
    _wait_drills(saved.url, {**counts, "failed": counts["failed"] + 1})


@pytest.mark.slow
def test_bad_input_exits_2_with_one_line_and_writes_nothing(saved):
    root = saved.root
    write_tensors(SessionStore(LocalStorage(root)), "fresh/1", {"model.layers.0.w": torch.randn(3, 3)}, step=1)
    before = _tree(root)
    cases = [
        (["fresh/1", "--to", "fsdp2:dp=", "--root", root], "invalid layout spec 'fsdp2:dp='"),
        (["fresh/1", "--to", "full", "--to", "zero9:dp=2", "--root", root], "unknown layout 'zero9'"),
        (["fresh/1", "--to", "full", "--to", "tp=4", "--root", root], "tp=4 cannot split"),
        (["fresh/1", "--to", "triple", "--server", saved.url], "invalid layout spec 'triple'"),
        (["fresh/1", "--to", "tp=4", "--server", saved.url], "tp=4 cannot split"),
        (["fresh/1", "--to", "full", "--jobs", "0", "--root", root], "--jobs"),
        (["fresh", "--to", "full", "--root", root], "ref"),
    ]
    for args, says in cases:
        out = _ckptd("drill", *args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert says in out.stderr and "Traceback" not in out.stderr and not out.stdout, (args, out.stderr)
        if "--jobs" not in args:  # argparse's own refusals print the usage line too
            assert len(lines) == 1, (args, out.stderr)
    assert _tree(root) == before and not (Path(root) / "runs/fresh/1/DRILL.json").exists()


@pytest.mark.parametrize("layout", ["fsdp2:dp=2", "tp=2"])
def test_a_wrong_byte_in_the_assembly_is_a_problem_naming_tensor_and_layout(tmp_path, monkeypatch, layout):
    """A drill runs the reshard's own work units into a digest sink that stores nothing: one byte flipped in
    one assembled target chunk, of row-major runs (fsdp2) or of ``tp``'s ``Shard(1)`` boxes (placed whole),
    fails the tensor, naming it and the layout; the other tensor passes, and nothing but the record is
    written."""
    from ckptd.reshard import drill

    storage = LocalStorage(tmp_path)
    g = torch.Generator().manual_seed(3)
    state = {"model.layers.0.attn.o_proj.weight": torch.randn(32, 64, generator=g),
             "model.layers.0.norm.weight": torch.randn(32, generator=g)}
    write_tensors(SessionStore(storage), "flip/1", state, step=1)
    flip = Corrupting(HostEngine(), least=1024)  # a chunk of o_proj, not the norm's 128 bytes
    monkeypatch.setattr(drill, "HostEngine", lambda: flip)
    before = _tree(tmp_path)
    rec = drill.drill_checkpoint(storage, "flip/1", [layout])
    assert flip.hit and not rec.ok, rec
    (x,) = rec.layouts
    assert [(p.layout, p.tensor) for p in x.problems] == [(layout, "model.layers.0.attn.o_proj.weight")], x.problems
    assert "differs from the source's" in x.problems[0].message and x.tensors == 2
    assert _tree(tmp_path) - before == {"runs/flip/1/DRILL.json"}
    monkeypatch.undo()  # the same drill with the host engine as it is: every tensor passes
    assert drill.drill_checkpoint(storage, "flip/1", [layout], record=False).ok
