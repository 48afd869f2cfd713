"""PyTorch Lightning with ckptd: DDP on CPU ranks, a checkpoint every epoch, resumed at any world size.

    ckptd serve &                                                         # in another terminal
    torchrun --nproc-per-node 2 examples/lightning_ckptd.py --ckptd-run lit --epochs 2
    python examples/lightning_ckptd.py --ckptd-run lit-resumed --epochs 3 --resume ckptd://lit/latest

The first job saves lit/epoch0-step2 and lit/epoch1-step4 from rank 0 (DDP's state is replicated);
the second, one process, restores weights, optimizer, schedule and loop state from lit/epoch1-step4
and trains its third epoch, saving under its own run. The lines between the markers are the ones
docs/integrations.md and the README quote.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.02) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return (self.net(x) - y).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckptd-run", default="lit", help="the ckptd run to save to")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--resume", help="e.g. ckptd://lit/latest")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun sets it; Lightning finds its ranks the same way
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sin().sum(1, keepdim=True)),
                                       batch_size=8 // world)

    # ckptd: begin
    from ckptd_client.integrations.lightning import CkptdCheckpointIO

    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_epochs=args.epochs,
        plugins=[CkptdCheckpointIO(args.ckptd_run)],  # saves, loads, removes through ckptd ($CKPTD_URL)
        callbacks=[ModelCheckpoint(dirpath="ckpt", every_n_epochs=1, save_top_k=-1)],  # names only
        logger=False, enable_progress_bar=False,
    )
    trainer.fit(Regressor(), data, ckpt_path=args.resume)  # None, or ckptd://RUN/NAME at any world size
    # ckptd: end
    if trainer.is_global_zero:
        print(f"finished at step {trainer.global_step} on {world} ranks")


if __name__ == "__main__":
    main()
