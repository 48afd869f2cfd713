"""Reshard jobs over a real ``ckptd serve``: a service job runs while 4 gloo ranks keep saving,
leases, the CLI against the service, refusals that write nothing, and the Kubernetes worker path
(``ckptd reshard --write-plan`` + one ``ckptd reshard-worker`` per unit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ckptd.store.leases import Leases
from ckptd.reshard.spec import GRAMMAR
from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader
from stored_tensors import read_tensor
from ckptd_client import CheckpointClient
from support import ServerProcess, run_ranks, scaled

pytestmark = pytest.mark.slow

SHAPES = {"w0": (301, 256), "w1": (257, 129), "w2": (64, 255), "bias": (301,)}
MAX_STEPS = 40
JOB_MBPS = 1.0  # the service's bandwidth cap for conversions: the job takes seconds, saves keep going


def _initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"model.{k}": torch.randn(s, generator=g) for k, s in SHAPES.items()}
    out.update({f"optim.state.{k}.exp_avg": torch.randn(s, generator=g) for k, s in SHAPES.items() if k != "bias"})
    return out


def expected_at(step: int) -> dict[str, torch.Tensor]:
    """The trainer's tensors at ``step``: the same float ops in the same order, so bit for bit."""
    out = _initial()
    for _ in range(step):
        for t in out.values():
            t.add_(0.5)
    return out


def train_job(rank: int, world: int, url: str, stop_file: str) -> list[tuple[int, float, float, str]]:
    """Every step changes the state and saves it (each save committed before the next step),
    until the test drops ``stop_file``; returns (step, started, committed, state) per save."""
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _initial().items()}
    client = CheckpointClient(url)
    saves = []
    for step in range(1, MAX_STEPS + 1):
        with torch.no_grad():
            for t in state.values():
                t.add_(0.5)
        sd: dict = {"model": {}, "optim": {"state": {}}, "step": step, "sched": {"milestones": (3, 7)}}
        for k, v in state.items():
            group, rest = k.split(".", 1)
            if group == "model":
                sd["model"][rest] = v
            else:
                p, moment = rest.removeprefix("state.").rsplit(".", 1)
                sd["optim"]["state"][p] = {moment: v}
        started = time.time()
        st = client.save(sd, f"train/{step}").wait()
        saves.append((step, started, time.time(), st.state))
        stop = torch.tensor([int(os.path.exists(stop_file))])
        dist.broadcast(stop, 0)  # every rank stops after the same step
        if stop.item():
            break
    client.close()
    return saves


class Trainer:
    """4 ranks of ``train_job`` in the background."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.stop_file = tmp / "stop"
        self.records: list[dict] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(url, tmp), daemon=True)
        self.thread.start()

    def _run(self, url: str, tmp: Path) -> None:
        try:
            self.records = run_ranks(train_job, 4, url, str(self.stop_file), tmp=tmp, timeout=180)
        except BaseException as e:  # noqa: BLE001 - re-raised by stop()
            self.error = e

    def stop(self) -> list[tuple[int, float, float, str]]:
        self.stop_file.touch()
        self.thread.join(200)
        assert not self.thread.is_alive(), "the training ranks did not stop"
        if self.error is not None:
            raise self.error
        assert self.records is not None
        return self.records[0]["result"]


def _wait_committed(reader: CheckpointReader, run: str, name: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while reader.marker(run, name) is None:
        assert time.monotonic() < deadline, f"{run}/{name} never committed"
        time.sleep(0.1)


def _ckptd(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def _tree(root: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))


def _assert_values(reader: CheckpointReader, ref: str, step: int) -> None:
    for name, t in expected_at(step).items():
        got = read_tensor(reader, ref, name)
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), f"{ref}: {name}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("reshard-jobs") / "root",
                        env={"CKPTD_RESHARD_MAX_MBPS": str(JOB_MBPS)}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reader(server):
    return CheckpointReader(LocalStorage(server.root, durable=False))


@pytest.fixture(scope="module")
def trainer(server, tmp_path_factory):
    t = Trainer(server.url, tmp_path_factory.mktemp("trainer"))
    yield t
    t.stop_file.touch()
    t.thread.join(200)


@pytest.fixture(scope="module")
def trained(trainer, reader):
    """The trainer's checkpoints, once it has stopped (at least 3 steps)."""
    _wait_committed(reader, "train", "3")
    return trainer.stop()


def test_a_service_job_converts_while_4_ranks_keep_saving(server, reader, trainer):
    _wait_committed(reader, "train", "1")
    lease_dir = Path(server.root) / "leases" / "train" / "1"
    http = httpx.Client(base_url=server.url, timeout=30)
    submitted = time.time()
    r = http.post("/v1/reshard", json={"source": "train/1", "to": "fsdp2:dp=2", "device": "cpu"})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["state"] in ("queued", "running") and job["source"] == "train/1"
    assert job["out"] == "train/1-fsdp2-dp2" and job["spec"] == "fsdp2:dp=2" and job["bytes_total"] > 0
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    # the source is leased from the moment the job is accepted
    assert (lease_dir / f"{job['id']}.json").exists()
    assert Leases(reader.storage).active("train", "1") == [job["id"]]

    states, progress = set(), []
    deadline = time.monotonic() + scaled(120)
    while True:
        leased = (lease_dir / f"{job['id']}.json").exists()  # looked at before the status: race-free
        job = http.get(f"/v1/jobs/{job['id']}").json()
        states.add(job["state"])
        progress.append(job["bytes_done"])
        if job["state"] in ("queued", "running"):
            assert leased, f"job {job['id']} is {job['state']} but holds no lease on its source"
        else:
            break
        assert time.monotonic() < deadline, f"job still {job['state']} after 120 s"
        time.sleep(0.1)
    finished = time.time()
    assert job["state"] == "done", job.get("error")
    assert "running" in states and progress == sorted(progress) and job["bytes_done"] == job["bytes_total"]
    res = job["result"]
    assert res["ref"] == "train/1-fsdp2-dp2" and res["units"] >= 2
    for _ in range(50):  # released right after the final status is written
        if not Leases(reader.storage).active("train", "1"):
            break
        time.sleep(0.1)
    assert Leases(reader.storage).active("train", "1") == []

    saves = trainer.stop()
    assert all(st == "committed" for *_, st in saves), saves
    # Training kept saving while the job ran: a whole save (started after the job was accepted, committed
    # before it finished) fits in the job; on a loaded machine a save may take half the job's time.
    during = [step for step, started, committed, _ in saves if started > submitted and committed < finished]
    assert during, f"no save committed during the {finished - submitted:.1f}s job; all {saves}"
    steps = [c.step for c in reader.checkpoints_page("train")[0] if c.derived_from is None]
    assert steps == list(range(1, len(saves) + 1))
    assert reader.resolve("train", "latest")[0] == str(len(saves))  # the derived checkpoint shadows nothing

    m = reader.manifest("train", "1-fsdp2-dp2")
    assert m.derived_from == "train/1" and m.step == 1 and m.topology.world_size == 2
    out = _ckptd("verify", "train/1-fsdp2-dp2", "--server", server.url)
    assert out.returncode == 0 and out.stdout.startswith("OK train/1-fsdp2-dp2"), out.stdout + out.stderr
    _assert_values(reader, "train/1-fsdp2-dp2", 1)
    http.close()


def test_a_jobs_plan_is_read_as_recorded_never_planned_again(server, reader, trained):
    """The web view's plan of a job is the one recorded when the job was planned: with the source's
    manifest moved away (a planner would need it), the view still answers, the same."""
    http = httpx.Client(base_url=server.url, timeout=60)
    r = http.post("/v1/reshard", json={"source": "train/2", "to": "fsdp2:dp=3", "out": "train/2-planned"})
    assert r.status_code == 202, r.text
    job = r.json()
    deadline = time.monotonic() + scaled(120)
    while job["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
        job = http.get(f"/v1/jobs/{job['id']}").json()
    assert job["state"] == "done", job
    url = f"/v1/ui/runs/train/jobs/{job['id']}/plan"
    first = http.get(url)
    assert first.status_code == 200 and first.json()["world_size"] == 3 and first.json()["units_total"] >= 3
    manifest = next((Path(server.root) / "runs" / "train" / "2" / "sessions").glob("*/manifest-*.json"))
    aside = manifest.with_name("aside")
    manifest.rename(aside)
    try:
        again = http.get(url)
    finally:
        aside.rename(manifest)
    assert again.status_code == 200 and again.json() == first.json()
    http.close()


def test_cli_reshard_against_the_server_end_to_end(server, reader, trained):
    out = _ckptd("reshard", "train/2", "--to", "zero3:dp=3,align=16", "--server", server.url, "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["ref"] == "train/2-zero3-dp3-align16" and res["bytes_written"] > 0 and res["units"] == 3
    m = reader.manifest("train", "2-zero3-dp3-align16")
    assert m.derived_from == "train/2" and m.topology.world_size == 3
    assert {c.kind for t in m.tensors for c in t.chunks} == {"flat"}
    out = _ckptd("verify", res["ref"], "--server", server.url, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["ok"], out.stdout
    _assert_values(reader, res["ref"], 2)
    assert Leases(reader.storage).active("train", "2") == []


def test_refusals_are_4xx_and_write_nothing(server, reader, trained):
    http = httpx.Client(base_url=server.url, timeout=30)
    # a checkpoint whose upload never finished: one rank of two sent its index
    c = http.post("/v1/checkpoints/train/999/sessions", json={"session": "s999", "world_size": 2, "step": 999})
    assert c.status_code == 200, c.text
    before = _tree(server.root)

    for bad in ("fsdp2:dp=", "fsdp3:dp=2", "owner:dp=0", "zero3:dp=2,align=x", "tp=2,pp=2", ""):
        r = http.post("/v1/reshard", json={"source": "train/1", "to": bad})
        assert 400 <= r.status_code < 500, (bad, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_request" and f"Grammar: {GRAMMAR}" in err["message"], (bad, err)
        r = http.post("/v1/reshard/preview", json={"source": "train/1", "to": bad})
        assert 400 <= r.status_code < 500 and "Grammar" in r.json()["error"]["message"], (bad, r.text)
    r = http.post("/v1/reshard", json={"source": "train/1", "to": "full", "dtype": "float8"})
    assert 400 <= r.status_code < 500 and "float8" in r.json()["error"]["message"], r.text
    for src in ("train/999", "train/1000", "nosuch/latest"):
        r = http.post("/v1/reshard", json={"source": src, "to": "fsdp2:dp=2"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "checkpoint_not_found", (src, r.text)
        assert src.split("/")[0] in r.json()["error"]["message"]
    r = http.get("/v1/jobs/0123456789abcdef")
    assert r.status_code == 404 and "0123456789abcdef" in r.json()["error"]["message"]

    out = _ckptd("reshard", "train/1", "--to", "fsdp2:dp=two", "--server", server.url)
    assert out.returncode == 2 and "Grammar" in out.stderr, out.stderr
    out = _ckptd("reshard", "train/999", "--to", "full", "--server", server.url)
    assert out.returncode == 1 and "train/999" in out.stderr, out.stderr
    assert _tree(server.root) == before  # no job record, no lease, no output session
    assert not (Path(server.root) / "jobs").exists() or all(
        json.loads(p.read_text())["source"] != "train/999" for p in (Path(server.root) / "jobs").glob("*.json"))
    http.close()


def test_worker_path_commits_once_after_the_last_unit(server, reader, trained, tmp_path):
    """``--write-plan`` stores which conversion, not its plan: a few hundred bytes naming the source
    checkpoint (its session), the target and the workers, whatever the world size; each worker plans and
    runs its own share of the units, and the last one to record its share commits."""
    plan = tmp_path / "plan.json"
    out = _ckptd("reshard", "train/3", "--to", "fsdp2:dp=2", "--write-plan", str(plan), "--root", server.root,
                 "--out", "train/3-k8s")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["out"] == "train/3-k8s" and info["units"] == 2 and info["workers"] == 2 and plan.exists()
    doc = json.loads(plan.read_text())
    assert doc["source"] == "train/3" and doc["source_session"] == reader.marker("train", "3").session
    assert doc["workers"] == 2 and "units" not in doc and len(plan.read_bytes()) < 1024
    assert reader.marker("train", "3-k8s") is None
    info["units"] = info["workers"]

    bad = _ckptd("reshard-worker", "--plan", str(plan), "--index", str(info["units"]), "--root", server.root)
    assert bad.returncode == 1 and f"workers 0..{info['units'] - 1}" in bad.stderr, bad.stderr

    other = tmp_path / "other.json"  # the job of a source of the same name but another session
    other.write_text(json.dumps({**doc, "source_session": "0" * 32}))
    bad = _ckptd("reshard-worker", "--plan", str(other), "--index", "0", "--root", server.root)
    assert bad.returncode in (1, 2) and "another checkpoint" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    assert not list(tmp_path.glob("other.json.units/*"))

    results = []
    for i in range(info["units"]):
        assert reader.marker("train", "3-k8s") is None, f"committed before unit {i} ran"
        w = _ckptd("reshard-worker", "--plan", str(plan), "--index", str(i), "--root", server.root)
        assert w.returncode == 0, w.stderr
        results.append(json.loads(w.stdout))
    assert [r["worker"] for r in results] == list(range(info["units"]))
    assert sorted(u for r in results for u in r["units"]) == [0, 1]
    assert ["committed" in r for r in results] == [False] * (info["units"] - 1) + [True]
    marker = reader.marker("train", "3-k8s")
    assert marker is not None and marker.session == info["session"]
    assert [c.name for c in reader.checkpoints_page("train")[0]].count("3-k8s") == 1
    m = reader.manifest("train", "3-k8s")
    assert m.derived_from == "train/3" and m.topology.world_size == 2 and all(t.digest for t in m.tensors)

    v = _ckptd("verify", "train/3-k8s", "--root", server.root)
    assert v.returncode == 0 and v.stdout.startswith("OK train/3-k8s"), v.stdout + v.stderr
    _assert_values(reader, "train/3-k8s", 3)
    (sched,) = [o for o in m.objects if o.name == "sched.milestones"]
    assert sched.encoding == "torch"  # carried over through the finalizer's objects file
    sd = {"sched": {"milestones": None}}
    CheckpointClient(server.url).load(sd, "train/3-k8s", strict=False)
    assert sd["sched"]["milestones"] == (3, 7)

    # A retried pod (or a second finalizer that lost the race) finds the output committed by its own
    # session: it succeeds without touching anything.
    manifest_bytes = reader.manifest_bytes("train", "3-k8s")
    for i in (info["units"] - 1, 0):
        w = _ckptd("reshard-worker", "--plan", str(plan), "--index", str(i), "--root", server.root)
        assert w.returncode == 0, w.stderr
        assert json.loads(w.stdout)["committed"] == marker.manifest_xxh3
    assert reader.marker("train", "3-k8s") == marker and reader.manifest_bytes("train", "3-k8s") == manifest_bytes


def test_workers_run_in_parallel_like_pods(server, reader, trained, tmp_path):
    plan = tmp_path / "plan.json"
    out = _ckptd("reshard", "train/2", "--to", "fsdp2:dp=3", "--write-plan", str(plan), "--root", server.root,
                 "--out", "train/2-pods")
    assert out.returncode == 0, out.stderr
    units = json.loads(out.stdout)["workers"]
    assert units == 3
    pods = [subprocess.Popen([sys.executable, "-m", "ckptd.cli.main", "reshard-worker", "--plan", str(plan),
                              "--root", server.root], env={**os.environ, "JOB_COMPLETION_INDEX": str(i)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(units)]
    results = []
    for p in pods:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr
        results.append(json.loads(stdout))
    assert sorted(r["worker"] for r in results) == list(range(units))
    marker = reader.marker("train", "2-pods")
    assert marker is not None
    assert {r["committed"] for r in results if "committed" in r} == {marker.manifest_xxh3}
    v = _ckptd("verify", "train/2-pods", "--root", server.root)
    assert v.returncode == 0, v.stdout + v.stderr
    _assert_values(reader, "train/2-pods", 2)


def test_a_job_whose_output_exists_is_refused_up_front(server, reader, trained):
    out = _ckptd("reshard", "train/4", "--to", "full", "--server", server.url, "--json")
    assert out.returncode == 0, out.stderr
    before = reader.manifest_bytes("train", "4-full")
    jobs_before = sorted(reader.storage.list("jobs"))
    http = httpx.Client(base_url=server.url, timeout=30)
    r = http.post("/v1/reshard", json={"source": "train/4", "to": "full"})
    http.close()
    assert r.status_code == 409 and r.json()["error"]["code"] == "already_committed", r.text
    assert "train/4-full" in r.json()["error"]["message"]
    assert reader.manifest_bytes("train", "4-full") == before
    assert sorted(reader.storage.list("jobs")) == jobs_before  # no job recorded
    assert Leases(reader.storage).active("train", "4") == []
    again = _ckptd("reshard", "train/4", "--to", "full", "--server", server.url)
    assert again.returncode == 2 and "already committed" in again.stderr, again.stderr


def test_a_pooled_worker_lowers_its_priority_once_not_per_job():
    """Jobs share a worker process, and ``os.nice`` adds up: the worker lowers it when it starts, so the
    second job runs where the first did."""
    from ckptd.service.workers import Workers

    workers = Workers(1)
    try:
        seen = [workers().submit(os.nice, 0).result(timeout=120) for _ in range(3)]
    finally:
        workers.close()
    assert seen == [os.nice(0) + min(10, 19 - os.nice(0))] * 3, seen
