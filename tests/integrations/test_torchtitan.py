"""torchtitan's checkpoint manager through ckptd (``ckptd_client.integrations.torchtitan``), on a real ``ckptd serve``.

torchtitan's trainer does not run on a CPU-only host (docs/integrations-torchtitan.md: it stops at
``torch.cuda.set_device``, and its llama3 attention has no CPU backward), and torchtitan is not in the test
environment. So the scenario test makes, one for one, the calls torchtitan 0.3.0's ``CheckpointManager``
(``torchtitan/components/checkpointer/dcp.py``) makes, with its state-dict structure, through the adapter:

- the state: the FSDP2 (``fully_shard``) model's ``state_dict()`` flattened to the top level
  (``ModelWrapper``), ``optimizer`` FQN-keyed and flat (``state.l1.weight.exp_avg``,
  ``param_groups.l1.weight.lr``), ``lr_scheduler`` ``{"last_epoch"}``, ``dataloader`` a pickled entry
  per data-parallel rank and ``world_size``, ``train_state`` ``{"step", "ntokens_seen"}``;
- ``folder``, ``interval``, ``keep_latest_k`` and ``async_mode`` are read from the ``Config(...)`` call
  of examples/torchtitan_ckptd.py; step 2 uses torchtitan's ``async_with_pinned_mem`` dispatch (a process
  executor and a ``DefaultStager``; no pinned memory or non-blocking copy, which need an accelerator)
  and step 4 its synchronous one;
- storage calls through fsspec's ``url_to_fs`` as ``torchtitan.tools.filesystem`` makes them:
  ``_find_load_step``, the ``isdir`` check, ``_purge_stale_checkpoints`` and the purge thread.

Two gloo ranks train 10 steps and save at every interval up to step 9 (the job dies before its last
step); ``keep_latest_k=2`` removes step 2. Three ranks resume from the newest (8) without the data
loader (torchtitan's does not reshard) and compute the uninterrupted run's losses at steps 9 and 10
(float64; the tolerance is summation order), two ranks resume everything and compute them bit for bit.
Where torchtitan imports, the same scenario runs with the real manager built from the example's config.
"""

from __future__ import annotations

import ast
import os
import pickle
import posixpath
import queue
import re
import threading
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist

from ckptd_client import CheckpointClient
from ckptd_client.integrations import torchtitan as tt
from ckptd_schemas import InvalidName
from support import REPO, run_ranks

EXAMPLE = REPO / "examples" / "torchtitan_ckptd.py"
VOCAB, SEQ, GLOBAL_BATCH, STEPS, LAST_SAVED = 37, 9, 6, 10, 9


def example_core() -> str:
    """The lines of examples/torchtitan_ckptd.py between its markers (what the docs quote)."""
    return EXAMPLE.read_text().split("# [ckptd-torchtitan:begin]\n", 1)[1].split("# [ckptd-torchtitan:end]", 1)[0]


def example_settings() -> dict[str, Any]:
    """The keyword arguments of the example's ``CkptdCheckpointManager.Config(...)`` call, inside its markers."""
    for node in ast.walk(ast.parse(example_core())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "CkptdCheckpointManager.Config":
            return {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    raise AssertionError("no CkptdCheckpointManager.Config(...) call between the example's markers")


# -- torchtitan's storage calls (torchtitan.tools.filesystem, remote branch) ----------------------------

def _fs(path: str) -> tuple[Any, str]:
    return fsspec.core.url_to_fs(path)


def fs_listdir(path: str) -> list[str]:
    fs, p = _fs(path)
    return [posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False) if e.rstrip("/") != p.rstrip("/")]


def fs_rmtree(path: str) -> None:
    fs, p = _fs(path)
    try:
        fs.rm(p, recursive=True)
    except FileNotFoundError:
        pass


# -- torchtitan's Stateful objects, same state_dict structure ---------------------------------------------

class ModelWrapper:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return dict(self.model.state_dict())

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd, strict=False)


class FlatOptimizer:
    """torchtitan's ``OptimizersContainer`` state: FQN-keyed, flat."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model, self.opt, self.options = model, opt, StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.opt, options=self.options)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, sd, options=self.options)


class LRSchedulers:
    """torchtitan's ``LRSchedulersContainer``: only ``last_epoch`` is saved."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * max(0.1, 1 - s / 12))

    def step(self) -> None:
        self.sched.step()

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.sched.last_epoch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sched.last_epoch = sd["last_epoch"]
        self.sched._step_count = sd["last_epoch"] + 1
        self.sched._last_lr = self.sched.get_lr()


class DataLoaderState:
    """torchtitan's ``ParallelAwareDataloader`` state: one pickled entry per dp rank, and the dp degree."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.sample = rank, world, 0

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": pickle.dumps({"sample": self.sample}), "world_size": self.world}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if f"dp_rank_{self.rank}" in sd:
            assert sd["world_size"] == self.world, "torchtitan's data loader does not reshard"
            self.sample = pickle.loads(sd[f"dp_rank_{self.rank}"])["sample"]


class TrainState:
    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


# -- torchtitan's CheckpointManager calls, one for one, through the adapter -------------------------------

class Calls:
    """``save``, ``maybe_wait_for_saving``, ``load``, ``_purge_stale_checkpoints``, ``close`` of torchtitan's
    manager, with :func:`tt.dcp_save` / :func:`tt.dcp_load` where it calls its ``dcp_save`` / ``dcp_load``."""

    def __init__(self, settings: dict, states: dict[str, Any], client: CheckpointClient) -> None:
        self.folder, self.interval = settings["folder"], settings["interval"]
        self.keep_latest_k, self.async_mode = settings["keep_latest_k"], settings.get("async_mode", "disabled")
        self.states, self.client = states, client
        self.pg = dist.new_group(backend="gloo")
        self.stager: Any = None
        self.save_future: Any = None
        self.purge_queue: queue.Queue = queue.Queue()
        self.purge_thread = threading.Thread(target=self._purge_loop, daemon=True)
        self.purge_thread.start()

    def _purge_loop(self) -> None:
        while (path := self.purge_queue.get()) is not None:
            fs_rmtree(path)

    def _flattened(self, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        sd = {k: v for k, v in self.states.items() if k != "model" and k not in exclude}
        sd.update(self.states["model"].state_dict())
        return sd

    def maybe_wait_for_saving(self) -> None:
        if self.save_future is not None:
            self.save_future.result()
            self.save_future = None

    def save(self, step: int, mode: str) -> None:
        if step % self.interval:
            return
        self.maybe_wait_for_saving()
        cid = posixpath.join(self.folder, f"step-{step}")
        if mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            if self.stager is None:  # torchtitan asks for pinned memory and non-blocking copies (accelerator only)
                self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                           use_async_staging=True, use_non_blocking_copy=False))
            result = tt.dcp_save(self.client, self._flattened(), cid, async_mode=mode, process_group=self.pg,
                                 stager=self.stager)
            result.staging_completion.result()
            self.save_future = result.upload_completion
        elif mode == "async":
            self.save_future = tt.dcp_save(self.client, self._flattened(), cid, async_mode=mode, process_group=self.pg)
        else:
            tt.dcp_save(self.client, self._flattened(), cid, async_mode="disabled")
        self._purge_stale_checkpoints()

    def _purge_stale_checkpoints(self) -> None:
        fs, p = _fs(self.folder)
        if not (self.keep_latest_k > 0 and dist.get_rank() == 0 and fs.isdir(p)):
            return
        found = sorted((int(m.group(1)), posixpath.join(self.folder, name)) for name in fs_listdir(self.folder)
                       if (m := re.search(r"step-(\d+)", name)))
        for _, path in found[: -self.keep_latest_k]:
            self.purge_queue.put(path)

    def _find_load_step(self) -> int:
        fs, _ = _fs(self.folder)
        steps = [int(m.group(1)) for name in fs_listdir(self.folder) if (m := re.search(r"step-(\d+)", name))
                 and fs.isfile(_fs(posixpath.join(self.folder, name, ".metadata"))[1])]
        return max(steps, default=-1)

    def load(self, exclude: tuple[str, ...] = ()) -> int:
        fs, p = _fs(self.folder)
        step = self._find_load_step() if fs.exists(p) else -1
        if step == -1:
            return -1
        cid = posixpath.join(self.folder, f"step-{step}")
        assert fs.isdir(_fs(cid)[1]), cid
        states = self._flattened(exclude)
        tt.dcp_load(self.client, states, cid)
        self.states["model"].load_state_dict(states)
        return step

    def close(self) -> None:
        self.maybe_wait_for_saving()
        self.purge_queue.put(None)
        self.purge_thread.join()
        if self.stager is not None:
            self.stager.close()


# -- the training job ------------------------------------------------------------------------------------

class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 12)
        self.l1 = torch.nn.Linear(12, 20)
        self.l2 = torch.nn.Linear(20, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.nn.functional.gelu(self.l1(self.emb(x))))


def build_model(seed: int, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TinyLM().to(torch.float64)
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.l1, model.l2):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(500 + step))
    per = GLOBAL_BATCH // world
    return tokens[rank * per:(rank + 1) * per]


def loss_of(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    tokens = batch(step, rank, world)
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def global_mean(loss: torch.Tensor, world: int) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total / world)


class Job:
    """A trainer: model, optimizer, schedule, data position, train state, and its checkpoint manager."""

    def __init__(self, kind: str, rank: int, world: int, url: str, seed: int, settings: dict) -> None:
        os.environ["CKPTD_URL"] = url
        os.environ["MASTER_ADDR"] = "127.0.0.1"  # the process executor's own process group meets here
        self.rank, self.world = rank, world
        self.model = build_model(seed, world)
        self.loader, self.train_state = DataLoaderState(rank, world), TrainState()
        if kind == "calls":
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
            self.sched = LRSchedulers(self.opt)
            states = {"model": ModelWrapper(self.model), "optimizer": FlatOptimizer(self.model, self.opt),
                      "dataloader": self.loader, "lr_scheduler": self.sched, "train_state": self.train_state}
            self.client = CheckpointClient()
            self.mgr: Any = Calls(settings, states, self.client)
        else:
            self.mgr = torchtitan_manager(self, settings)

    def lr(self) -> float:
        return float(getattr(self.opt, "optimizers", [self.opt])[0].param_groups[0]["lr"])

    def train(self, step: int) -> float:
        self.opt.zero_grad()
        loss = loss_of(self.model, step, self.rank, self.world)
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.train_state.step, self.train_state.ntokens_seen = step, self.train_state.ntokens_seen + GLOBAL_BATCH * SEQ
        self.loader.sample += GLOBAL_BATCH // self.world
        return global_mean(loss, self.world)


def save_job(rank: int, world: int, url: str, kind: str, settings: dict) -> dict:
    job = Job(kind, rank, world, url, seed=0, settings=settings)
    modes = {2: "async_with_pinned_mem", 4: "disabled"} if kind == "calls" else {}
    losses, seen = {}, {}
    for step in range(1, STEPS + 1):
        losses[step] = job.train(step)
        if step <= LAST_SAVED:  # the job dies after step 9, before its last-step save
            if kind == "calls":
                job.mgr.save(step, modes.get(step, settings["async_mode"]))
            else:
                job.mgr.save(curr_step=step)
            seen[step] = {"lr": job.lr(), "sample": job.loader.sample, "ntokens": job.train_state.ntokens_seen}
    job.mgr.maybe_wait_for_saving()
    job.mgr.close()
    return {"losses": losses, "seen": seen}


def resume_job(rank: int, world: int, url: str, kind: str, settings: dict, exclude: tuple[str, ...]) -> dict:
    settings = {**settings, "exclude_from_loading": list(exclude)}
    job = Job(kind, rank, world, url, seed=1 + rank, settings=settings)  # other weights
    with torch.no_grad():
        fresh = global_mean(loss_of(job.model, 9, rank, world), world)
    step = job.mgr.load(exclude) if kind == "calls" else (job.train_state.step if job.mgr.load() else -1)
    out = {"step": step, "train_step": job.train_state.step, "ntokens": job.train_state.ntokens_seen,
           "lr": job.lr(), "sample": job.loader.sample, "fresh": fresh, "losses": {}}
    for s in range(step + 1, STEPS + 1):
        out["losses"][s] = job.train(s)
    job.mgr.close()
    return out


def torchtitan_manager(job: Job, settings: dict) -> Any:
    """torchtitan's real manager, built from the example's config, with torchtitan's optimizer and schedule."""
    import dataclasses
    import importlib.util

    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    spec = importlib.util.spec_from_file_location("torchtitan_ckptd_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    config = dataclasses.replace(example.llama3_debugmodel_ckptd().checkpoint,
                                 exclude_from_loading=settings.get("exclude_from_loading", []))
    job.opt = default_adamw(lr=1e-2).build(model_parts=[job.model])
    job.sched = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                             min_lr_factor=0.0).build(optimizers=job.opt, training_steps=STEPS)
    return config.build(dataloader=job.loader, model_parts=[job.model], optimizers=job.opt,
                        lr_schedulers=job.sched, states={"train_state": job.train_state}, sd_adapter=None)


# -- the tests -------------------------------------------------------------------------------------------

def test_ids_map_to_numeric_checkpoint_names():
    assert tt.checkpoint_id("llama3-debug", 40) == "ckptd://llama3-debug/step-40"
    assert tt.ref_of("ckptd://llama3-debug/step-40") == "llama3-debug/40"
    for bad in ("/ckpt/step-40", "ckptd://llama3-debug/40", "ckptd://run/step-04", "ckptd://Run/step-1",
                "ckptd://a/b/step-1", "ckptd://../step-1"):
        with pytest.raises(InvalidName):
            tt.ref_of(bad)
    assert example_settings()["folder"].startswith("ckptd://")


def test_the_docs_quote_the_example():
    for name in ("docs/integrations-torchtitan.md", "README.md"):
        doc = (REPO / name).read_text()
        quoted = doc.split("<!-- [ckptd-torchtitan:begin] -->\n```python\n", 1)[1].split("```\n<!--", 1)[0]
        assert quoted == example_core(), name


def test_the_folder_lists_committed_steps_and_removes_through_retention(server, monkeypatch):
    monkeypatch.setenv("CKPTD_URL", server.url)  # what url_to_fs("ckptd://...") connects to
    with CheckpointClient(server.url) as client:
        for name in ("2", "3", "10", "notastep"):
            client.save({"w": torch.full((4,), float(len(name)))}, f"fsrun/{name}").wait()
        fs = tt.CkptdFileSystem(server.url)
        with client.lease("fsrun/2"):  # a reader holds it: the purge keeps it (409 on the wire), and says so
            fs.rm("fsrun/step-2", recursive=True)
        assert "2" in {c.name for c in client.list_checkpoints("fsrun")}
        fs.rm("fsrun/step-2", recursive=True)  # released: it goes
        assert fs.ls("fsrun", detail=False) == ["fsrun/step-3", "fsrun/step-10"]
        assert fs_listdir("ckptd://fsrun") == ["step-3", "step-10"]
        assert fs.isdir("fsrun") and fs.isdir("fsrun/step-10") and fs.isfile("fsrun/step-3/.metadata")
        assert not fs.exists("fsrun/step-4") and not fs.isfile("fsrun/step-3") and not fs.exists("nosuchrun")
        assert not fs.isfile("fsrun/step-3/model.safetensors.index.json")
        fs.rm("fsrun/step-3", recursive=True)  # what torchtitan's purge thread calls
        fs.rm("fsrun/step-10", recursive=True)  # the newest: retention keeps it
        assert sorted(c.name for c in client.list_checkpoints("fsrun")) == ["10", "notastep"]
        with pytest.raises(FileNotFoundError):
            fs.rm("fsrun/step-3")
        with pytest.raises(NotImplementedError):
            fs.open("fsrun/step-10/.metadata")


def _scenario(server, tmp_path, kind: str) -> None:
    settings = example_settings()
    run = settings["folder"].split("://", 1)[1]
    saved = run_ranks(save_job, 2, server.url, kind, settings, tmp=tmp_path)[0]["result"]
    with CheckpointClient(server.url) as client:
        assert [c.name for c in client.list_checkpoints(run)] == ["4", "6", "8"]  # keep_latest_k=2 removed 2
        m = client.manifest(f"{run}/latest")
        assert m.name == "8"
        names = {t.name for t in m.tensors} | {o.name for o in m.objects}
        assert {"l1.weight", "emb.weight", "optimizer.state.l1.weight.exp_avg", "optimizer.param_groups.l1.weight.lr",
                "lr_scheduler.last_epoch", "dataloader.dp_rank_0", "dataloader.dp_rank_1",
                "train_state.step"} <= names, sorted(names)
    want = saved["losses"]
    at8 = saved["seen"][8]

    wider = [r["result"] for r in run_ranks(resume_job, 3, server.url, kind, settings, ("dataloader",),
                                            tmp=tmp_path)]
    for r in wider:
        assert (r["step"], r["train_step"], r["ntokens"], r["lr"]) == (8, 8, at8["ntokens"], at8["lr"])
        assert r["sample"] == 0  # not loaded: torchtitan's data loader does not reshard
        assert abs(r["fresh"] - want[9]) > 1e-3  # a model that was not restored computes another loss
        for s in (9, 10):
            assert r["losses"][s] == pytest.approx(want[s], rel=1e-12, abs=0), (s, r["losses"][s], want[s])

    same = [r["result"] for r in run_ranks(resume_job, 2, server.url, kind, settings, (), tmp=tmp_path)]
    for r in same:
        assert (r["step"], r["sample"], r["lr"]) == (8, at8["sample"], at8["lr"])
        assert r["losses"] == {9: want[9], 10: want[10]}  # bit for bit


@pytest.mark.slow
def test_torchtitan_manager_calls_save_and_resume_at_another_world_size(server, tmp_path):
    _scenario(server, tmp_path, "calls")


@pytest.mark.slow
def test_real_torchtitan_manager_from_the_example(server, tmp_path):
    pytest.importorskip("torchtitan.components.checkpoint", reason=(
        "torchtitan is not installed: it is left out of the extras because its datasets pin pulls fsspec below "
        "s3fs; docs/integrations-torchtitan.md says how to run this test"))
    pytest.importorskip("torchtitan.models.llama3.config_registry", reason="the example's config needs it")
    _scenario(server, tmp_path, "torchtitan")
