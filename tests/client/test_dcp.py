"""``torch.distributed.checkpoint`` on top of ckptd, end to end over a real ``ckptd serve``.

FSDP2 trains on 4 gloo ranks and saves a DCP state dict (model and optimizer from
``get_model_state_dict``/``get_optimizer_state_dict``, plus Stateful objects: a data-loader
position, an LR scheduler, the RNG state) through ``client.dcp_writer`` with ``dcp.save``,
``dcp.async_save`` on a thread and ``dcp.async_save`` in a process (training goes on while
the async saves upload), and once more with ``CheckpointClient.save``. 3 and 2 ranks load
every checkpoint back through ``client.dcp_reader`` (the client-saved one included) and
the DCP-saved one through ``CheckpointClient.load``: bit for bit, optimizer state, learning
rate, scheduler, loader position and RNG included. The DCP-saved checkpoint is resharded
and verified with the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.optim.lr_scheduler import StepLR

from ckptd.storage import open_storage
from ckptd.store import CheckpointReader
from stored_tensors import read_tensor
from ckptd_client import CheckpointClient, InvalidName, InvalidRequest
from ckptd_client.dcp import DCP_METADATA, CkptdStorageReader, CkptdStorageWriter
from fsdp_job import LR, apply, build, full_tensors, train_step
from support import run_ranks

pytestmark = pytest.mark.slow


class LoaderPosition:
    """A data loader's position: a Stateful object as DCP expects (state_dict / load_state_dict)."""

    def __init__(self) -> None:
        self.epoch, self.index, self.order = 0, 0, [3, 1, 2]

    def advance(self) -> None:
        self.index += 1
        if self.index == 2:
            self.epoch, self.index, self.order = self.epoch + 1, 0, self.order[::-1]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "order": list(self.order)}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.index, self.order = sd["epoch"], sd["index"], list(sd["order"])


class RngState:
    def state_dict(self) -> dict:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, sd: dict) -> None:
        torch.set_rng_state(sd["cpu"])


def _parts(world: int, seed: int, lr: float = LR):
    model, opt = build(world, seed=seed, lr=lr)
    return model, opt, StepLR(opt, step_size=2, gamma=0.5), LoaderPosition(), RngState()


def _app_state(model, opt, sched, loader, rng, *, stateful: bool = True) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    extra = {"loader": loader, "sched": sched, "rng": rng}
    if not stateful:  # CheckpointClient.save/load take plain containers
        extra = {k: v.state_dict() for k, v in extra.items()}
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), **extra}


def _snapshot(model, opt, sched, loader) -> dict:
    from fsdp_job import state

    return {"tensors": full_tensors(state(model, opt)), "lr": opt.param_groups[0]["lr"],
            "sched": sched.state_dict(), "loader": loader.state_dict(), "rng": torch.get_rng_state()}


def save_job(rank: int, world: int, url: str) -> dict:
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # the process executor's own process group rendezvous here
    model, opt, sched, loader, rng = _parts(world, seed=0)
    for step in range(3):
        train_step(model, opt, step, rank, world)
        sched.step()
        loader.advance()
    client = CheckpointClient(url)
    torch.manual_seed(77)  # an RNG state every rank shares (DCP keeps one copy of a plain tensor)
    at3 = _snapshot(model, opt, sched, loader)

    writer = client.dcp_writer("dcp/3")
    dcp.save(_app_state(model, opt, sched, loader, rng), storage_writer=writer)
    ways = dict(writer.ways.bytes)  # which way this rank's bytes went
    client.save(_app_state(model, opt, sched, loader, rng, stateful=False), "cli/3").wait()

    # Async saves get their own process groups, so their collectives never interleave with training's.
    pg_thread, pg_proc = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    fut = dcp.async_save(_app_state(model, opt, sched, loader, rng), storage_writer=client.dcp_writer("thread/3"),
                         process_group=pg_thread, async_checkpointer_type=AsyncCheckpointerType.THREAD)
    train_step(model, opt, 3, rank, world)  # training mutates the state while the upload runs
    sched.step()
    loader.advance()
    fut.result()

    torch.manual_seed(78)
    at4 = _snapshot(model, opt, sched, loader)
    fut = dcp.async_save(_app_state(model, opt, sched, loader, rng), storage_writer=client.dcp_writer("proc/4"),
                         process_group=pg_proc, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    train_step(model, opt, 4, rank, world)
    sched.step()
    fut.result()
    client.close()
    return {"at3": at3, "at4": at4, "ways": ways}


def load_job(rank: int, world: int, url: str, loads: list[tuple[str, str]]) -> dict:
    client = CheckpointClient(url)
    out = {}
    for ref, via in loads:
        model, opt, sched, loader, rng = _parts(world, seed=123, lr=1.0)
        train_step(model, opt, 0, rank, world)  # optimizer state exists, with the wrong values
        torch.manual_seed(999)
        if via == "dcp":
            sd = _app_state(model, opt, sched, loader, rng)
            dcp.load(sd, storage_reader=client.dcp_reader(ref))  # Stateful objects are loaded in place
        else:
            sd = _app_state(model, opt, sched, loader, rng, stateful=False)
            client.load(sd, ref)
            sched.load_state_dict(sd["sched"])
            loader.load_state_dict(sd["loader"])
            rng.load_state_dict(sd["rng"])
        apply(model, opt, sd)
        out[(ref, via)] = _snapshot(model, opt, sched, loader)
    client.close()
    return out


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got["tensors"]) == set(want["tensors"]), what
    for name, t in want["tensors"].items():
        g = got["tensors"][name]
        assert g.dtype == t.dtype and g.shape == t.shape, f"{what}: {name}"
        assert torch.equal(g.view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8)), \
            f"{what}: {name} differs bitwise"
    assert got["lr"] == want["lr"], what
    assert got["sched"] == want["sched"], what
    assert got["loader"] == want["loader"], what
    assert torch.equal(got["rng"], want["rng"]), what


def ckptd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_fsdp2_dcp_save_4_load_3_2(server, tmp_path):
    saved = run_ranks(save_job, 4, server.url, tmp=tmp_path, timeout=240)[0]["result"]
    at3, at4 = saved["at3"], saved["at4"]
    # The DCP writer says which way its rank's bytes went: on the service's host, handed over or sent.
    assert sum(saved["ways"].values()) > 0 and {w for w, n in saved["ways"].items() if n} <= {"socket", "http"}
    assert any(k.endswith("exp_avg_sq") for k in at3["tensors"])
    assert at3["lr"] == LR * 0.5 and at3["sched"]["last_epoch"] == 3 and at3["loader"]["epoch"] == 1
    assert not all(torch.equal(at3["tensors"][k], at4["tensors"][k]) for k in at3["tensors"])

    client = CheckpointClient(server.url)
    for ref in ("dcp/3", "thread/3", "proc/4"):
        m = client.manifest(ref)
        assert m.topology.world_size == 4
        assert any(o.name == DCP_METADATA for o in m.objects)
        # DCP keeps one value per key: stored once, loadable by any rank at any world size.
        assert all(o.rank is None for o in m.objects), [(o.name, o.rank) for o in m.objects if o.rank is not None]
        assert {"loader.epoch", "sched.last_epoch", "optim.param_groups.0.lr"} <= {o.name for o in m.objects}
    client.close()

    loads = [("dcp/3", "dcp"), ("thread/3", "dcp"), ("proc/4", "dcp"), ("cli/3", "dcp"), ("dcp/3", "client")]
    expected = {"dcp/3": at3, "thread/3": at3, "proc/4": at4, "cli/3": at3}
    for world in (3, 2):
        got = run_ranks(load_job, world, server.url, loads, tmp=tmp_path, timeout=240)[0]["result"]
        for ref, via in loads:
            _assert_same(got[(ref, via)], expected[ref], f"{ref} loaded via {via} at world size {world}")

    # The DCP-saved checkpoint is an ordinary ckptd checkpoint: reshard it, verify it, read it.
    out = ckptd("reshard", "dcp/3", "--to", "fsdp2:dp=3", "--root", server.root, "--json")
    assert out.returncode == 0, out.stderr
    ref = json.loads(out.stdout)["ref"]
    assert ckptd("verify", ref, "--root", server.root).returncode == 0
    reader = CheckpointReader(open_storage(server.root))
    assert reader.manifest(*ref.split("/")).topology.world_size == 3
    for name, t in at3["tensors"].items():
        assert torch.equal(read_tensor(reader, ref, name), t), name


def test_dcp_endpoints_refuse_bad_refs_and_pickle_without_connections():
    import pickle

    with pytest.raises(InvalidName):
        CkptdStorageWriter("http://127.0.0.1:9", "gpt/latest")
    assert not CkptdStorageWriter.validate_checkpoint_id("gpt/latest")
    assert CkptdStorageReader.validate_checkpoint_id("gpt/latest")
    assert not CkptdStorageReader.validate_checkpoint_id("/tmp/some/dir")
    w = CkptdStorageWriter("http://127.0.0.1:9", "gpt/5")
    w.transport  # noqa: B018 - opens a connection pool, which must not travel to the process executor
    clone = pickle.loads(pickle.dumps(w))
    assert clone.ref == "gpt/5" and clone._transport is None
    with pytest.raises(InvalidRequest, match="use_collectives"):  # ranks must share one upload session
        w.set_up_storage_writer(True, rank=0, use_collectives=False)
