"""Hugging Face Accelerate with ckptd: train on CPU ranks, save the accelerator's state, resume anywhere.

    ckptd serve &                                                         # in another terminal
    torchrun --nproc-per-node 2 examples/accelerate_ckptd.py --save hf/8 --steps 8
    python examples/accelerate_ckptd.py --load hf/latest --steps 12

The first job saves model, optimizer, scheduler, each rank's RNG states and the step as hf/8; the
second, one process, restores them and trains steps 8 to 11. The lines between the markers are the
ones docs/integrations.md and the README quote.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", help="checkpoint ref to save at the end, e.g. hf/8")
    ap.add_argument("--load", help="checkpoint ref to resume from, e.g. hf/latest")
    ap.add_argument("--steps", type=int, default=8, help="train until this step")
    args = ap.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)

    # ckptd: begin
    from ckptd_client import CheckpointClient
    from ckptd_client.integrations.accelerate import load_state, save_state

    client = CheckpointClient()  # $CKPTD_URL, else http://127.0.0.1:8470
    if args.load:  # model, optimizer, scheduler, RNG states and accelerator.step, at any world size
        loaded = load_state(accelerator, client, args.load)
    while accelerator.step < args.steps:
        train_step(accelerator, model, opt, sched)
    if args.save:
        save_state(accelerator, client, args.save).wait()  # collective; committed when wait() returns
    # ckptd: end
    world, done = accelerator.num_processes, accelerator.step
    if args.load and accelerator.is_main_process:
        print(f"resumed {loaded.report.ref} at step {loaded.step} on {world} rank{'s' if world > 1 else ''}")
    if args.save and accelerator.is_main_process:
        print(f"saved {args.save} at step {done} from {world} ranks")
    if accelerator.is_main_process:
        print(f"finished at step {done}")
    client.close()


def train_step(accelerator: Accelerator, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object) -> None:
    x = torch.randn(4, 8)
    with accelerator.accumulate(model):  # counts accelerator.step
        loss = (model(x) - x.sin().sum(1, keepdim=True)).pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
