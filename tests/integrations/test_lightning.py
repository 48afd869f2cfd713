"""PyTorch Lightning through ckptd: ``CkptdCheckpointIO`` with the real Trainer and a real ``ckptd serve``.

- paths map to refs, and a checkpoint dict's structure (int keys, lists of tensors, objects) comes back;
- two gloo ranks train with ``strategy="ddp"`` (Lightning's own DDP, in processes it finds already
  started), saving every epoch; one process resumes from the first checkpoint, into another run, and
  computes the same losses as the uninterrupted run at every later step (float64; the tolerance is
  summation order: two ranks' means averaged against one mean of the same six samples);
- ``ModelCheckpoint(save_top_k=2)`` asks ckptd to remove old checkpoints, which goes; the newest,
  which retention protects, stays with its reason;
- Lightning refuses FSDP without CUDA (why the DDP strategy is the one tested, docs/integrations.md);
- ``examples/lightning_ckptd.py`` runs as the README shows it: torchrun, 2 ranks, then 1 rank resumes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from support import REPO, assert_quoted, run_example, run_ranks

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from ckptd_client import CheckpointClient  # noqa: E402
from ckptd_client.integrations.lightning import CkptdCheckpointIO, name_for, structure_of, template_of  # noqa: E402

N, GLOBAL_BATCH, EPOCHS = 12, 6, 3  # two steps an epoch; every world size of 1, 2, 3 splits a batch evenly


def _data(rank: int, world: int) -> torch.utils.data.DataLoader:
    """This rank's share of one fixed order: step k's six samples are the same at every world size
    (the trainers run with ``use_distributed_sampler=False``; Lightning's own sampler shuffles)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    data = torch.utils.data.TensorDataset(x, torch.sin(x).sum(1, keepdim=True))
    return torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(rank, N, world)),
                                       batch_size=GLOBAL_BATCH // world)


class Tiny(L.LightningModule):
    """A float64 MLP; records the global loss of every step (the ranks' means averaged)."""

    def __init__(self, lr: float = 0.05, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)).double()
        self.losses: list[tuple[int, float]] = []

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        mean = loss.detach().clone()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(mean)
            mean /= torch.distributed.get_world_size()
        self.losses.append((self.global_step, mean.item()))
        self.log("newness", float(self.current_epoch), on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.6)}


def _trainer(world: int, run: str, url: str, root: str, epochs: int, **checkpointing: object) -> tuple:
    io = CkptdCheckpointIO(run, url=url)
    ckpt = ModelCheckpoint(dirpath=str(Path(root) / "ckpt"), every_n_epochs=1, **({"save_top_k": -1} | checkpointing))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", num_nodes=1,
                        max_epochs=epochs, plugins=[io], callbacks=[ckpt], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root, use_distributed_sampler=False)
    return trainer, io


def fit_job(rank: int, world: int, url: str, root: str, run: str, epochs: int, resume: str | None) -> dict:
    # The ranks are started (and their gloo group made) by run_ranks: Lightning's environment sees
    # LOCAL_RANK and takes them as its processes, as under torchrun.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    trainer, _ = _trainer(world, run, url, root, epochs)
    model = Tiny()
    trainer.fit(model, _data(rank, world), ckpt_path=resume)
    return {"losses": model.losses, "global_step": trainer.global_step}


def test_paths_map_to_refs_and_the_structure_comes_back():
    io = CkptdCheckpointIO("demo")
    assert io.ref_for("/x/ckpt/epoch=0-step=10.ckpt") == "demo/epoch0-step10"
    assert io.ref_for("/x/epoch=3-step=7-val_loss=0.25.ckpt") == "demo/epoch3-step7-val_loss0.25"
    assert io.ref_for("ckptd://other/latest") == "other/latest"
    assert name_for("last.ckpt") == "last"
    ck = {"state_dict": {"a.w": torch.ones(2, 3)}, "optimizer_states": [{"state": {0: {"m": torch.zeros(3)}},
          "param_groups": [{"params": [0], "lr": 0.1, "betas": (0.9, 0.99)}]}], "loops": {"x.y": {"n": 4}},
          "epoch": 1, "shapes": [1, 2]}
    tmpl = template_of(structure_of(ck), {"state_dict.a.w": ([2, 3], "float32"),
                                          "optimizer_states.0.state.0.m": ([3], "float32")}, "demo/x")
    assert list(tmpl) == list(ck)
    assert tmpl["state_dict"]["a.w"].shape == (2, 3) and tmpl["state_dict"]["a.w"].dtype == torch.float32
    assert list(tmpl["optimizer_states"][0]["state"]) == [0]  # an int key stays an int
    assert tmpl["optimizer_states"][0]["param_groups"][0] == {"params": None, "lr": None, "betas": None}
    assert tmpl["loops"] == {"x.y": {"n": None}} and tmpl["epoch"] is None and tmpl["shapes"] is None


def test_lightning_refuses_fsdp_on_cpu():
    """Why the integration is tested with DDP: Lightning's FSDP strategy needs CUDA (and does not call a
    CheckpointIO for sharded state, docs/integrations.md)."""
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", devices=2, strategy="fsdp")


def test_save_top_k_removes_old_checkpoints_and_keeps_the_newest(server, tmp_path):
    if not hasattr(CheckpointClient, "remove"):
        pytest.skip("CheckpointClient.remove not available")
    trainer, io = _trainer(1, "topk", server.url, str(tmp_path), 4, monitor="newness", mode="max", save_top_k=2)
    trainer.fit(Tiny(), _data(0, 1))
    with CheckpointClient(server.url) as client:
        names = sorted(c.name for c in client.list_checkpoints("topk"))
        assert names == ["epoch2-step6", "epoch3-step8"], names
        assert [(r["ref"], r["removed"]) for r in io.removals] == [("topk/epoch0-step2", True),
                                                                  ("topk/epoch1-step4", True)], io.removals
        io.remove_checkpoint(tmp_path / "ckpt" / "epoch=3-step=8.ckpt")  # the newest: retention keeps it
        assert io.removals[-1]["removed"] is False and io.removals[-1]["reason"], io.removals[-1]
        assert sorted(c.name for c in client.list_checkpoints("topk")) == names
        io.remove_checkpoint(tmp_path / "ckpt" / "epoch=9-step=99.ckpt")  # never saved: skipped
        assert io.removals[-1] == {"ref": "topk/epoch9-step99", "removed": False, "reason": "not found"}
        with client.lease("topk/epoch2-step6"):  # a reader holds it: kept, the reader named (409 on the wire)
            io.remove_checkpoint(tmp_path / "ckpt" / "epoch=2-step=6.ckpt")
        assert io.removals[-1]["removed"] is False and "leased by client-" in io.removals[-1]["reason"], io.removals
        assert sorted(c.name for c in client.list_checkpoints("topk")) == names
    io.teardown()


@pytest.mark.slow
def test_ddp_on_two_ranks_resumes_on_one_with_the_same_losses(server, tmp_path):
    first = run_ranks(fit_job, 2, server.url, str(tmp_path / "a"), "ddp", EPOCHS, None, tmp=tmp_path)
    want = dict(first[0]["result"]["losses"])
    assert sorted(want) == list(range(EPOCHS * 2)) and first[0]["result"]["global_step"] == EPOCHS * 2
    with CheckpointClient(server.url) as client:
        saved = {c.name: c.step for c in client.list_checkpoints("ddp")}
        assert saved == {"epoch0-step2": 2, "epoch1-step4": 4, "epoch2-step6": 6}, saved
        manifest = client.manifest("ddp/epoch0-step2")
        assert manifest.topology.world_size == 1  # rank 0 saved it alone: DDP's state is replicated

    # One process resumes from the first epoch's checkpoint, saving into another run.
    trainer, io = _trainer(1, "ddp-resumed", server.url, str(tmp_path / "b"), EPOCHS)
    model = Tiny(lr=0.9)  # hyper-parameters and weights from the checkpoint, not from here
    torch.manual_seed(123)
    model.net[0].weight.data.normal_()
    trainer.fit(model, _data(0, 1), ckpt_path="ckptd://ddp/epoch0-step2")
    got = dict(model.losses)
    assert sorted(got) == [2, 3, 4, 5], got
    for step, loss in got.items():
        # float64: one mean of six samples against two means of three averaged; 1e-12 is far above
        # that rounding and far below what one wrong weight, moment or learning rate changes
        assert loss == pytest.approx(want[step], rel=1e-12, abs=0), (step, loss, want[step])
    assert trainer.global_step == EPOCHS * 2
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(0.05 * 0.6 ** EPOCHS)
    with CheckpointClient(server.url) as client:
        assert sorted(c.name for c in client.list_checkpoints("ddp-resumed")) == ["epoch1-step4", "epoch2-step6"]
        # resumed under a new run name: each of its checkpoints names the one it started from
        assert {c.parent for c in client.list_checkpoints("ddp-resumed")} == {"ddp/epoch0-step2"}


def test_the_docs_quote_the_example():
    assert_quoted(REPO / "examples" / "lightning_ckptd.py")


@pytest.mark.slow
def test_the_lightning_example_saves_on_two_ranks_and_resumes_on_one(server, tmp_path):
    example = REPO / "examples" / "lightning_ckptd.py"
    run_example(example, "--ckptd-run", "lit", "--epochs", "2", url=server.url, ranks=2, cwd=tmp_path,
                expect="finished at step 4 on 2 ranks")
    run_example(example, "--ckptd-run", "lit-resumed", "--epochs", "3", "--resume", "ckptd://lit/latest",
                url=server.url, cwd=tmp_path, expect="finished at step 6 on 1 ranks")
    with CheckpointClient(server.url) as client:
        assert sorted(c.name for c in client.list_checkpoints("lit")) == ["epoch0-step2", "epoch1-step4"]
        assert sorted(c.name for c in client.list_checkpoints("lit-resumed")) == ["epoch2-step6"]
        assert client.manifest("lit-resumed/epoch2-step6").parent == "lit/epoch1-step4"  # latest, resolved
    assert not (tmp_path / "ckpt").exists()  # ModelCheckpoint's directory only names the checkpoints
